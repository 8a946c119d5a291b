"""This process as an actor runtime: routing (`_runtime.Runtime`) together with the state that lives on its loop,
and the process's life as a proc; and the one runtime of each process (`get_runtime`).

The process layer of `regent.actor` (tests/unit/actor/test_layers.py): above routing, below cells, handlers, meshes
and procs. What it needs from those layers is handed to it as `ProcessParts` (`install_parts`, called once by the
package's `__init__`, the composition root): the handler table, how this process is made a `ProcMesh`, how a
`get_or_spawn_controller` singleton is spawned, this machine as a host mesh, and the client's fault hook. The state it holds (see
docs/runtime.md):

- `supervision` (`_supervision.Supervision`): which meshes exist here, which ranks are failed, which calls wait
  on which processes, and what happens when a process dies. Routing tells it a process is gone (it is the
  runtime's `faults`); it tells routing to forget the process (`forget_proc`).
- `actors` (`_directory.ActorDirectory`): the actors living in this process, why gone ones are gone, and
  messages waiting for an actor not spawned yet.
- `tree` (`_tree.TreeState`): per-sender order of messages and, on host agents, reply batches of tree casts.
- the procs it started (`spawner`), owns (`owned_proc_meshes`) or adopted, and, in a proc, its owner: the
  orphan timeout and the detach grace (`orphan_watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

from regent import settings
from regent.actor._config import config
from regent.actor._directory import ActorDirectory
from regent.actor._errors import MeshFailure
from regent.actor._messages import Bye, encode
from regent.actor._runtime import (
    _TLS,
    OK,
    ChannelTransport,
    Handler,
    OneShot,
    Runtime,
    exit_gracefully,
    new_id,
    remove_sock_dir,
)
from regent.actor._supervision import Supervision
from regent.actor._transport import parse_address
from regent.actor._tree import TreeState
from regent.auth import job_secret_from_env, user_secret

logger = logging.getLogger("regent.actor")

# A proc with a detach grace whose owner's connection dropped (its parent still alive) detaches after this long.
DETACH_AFTER_S = 10.0


@dataclasses.dataclass(frozen=True)
class ProcessParts:
    """What the process layer is given by the layers above it, which it may not import (`install_parts`)."""

    handlers: Callable[[ActorRuntime], Mapping[str, Handler]]  # `_handlers.ProcHandlers(rt).table()`
    self_proc: Callable[[ActorRuntime], Any]  # this process as a `ProcMesh` (`_proc_mesh.self_proc_mesh`)
    # spawn a `get_or_spawn_controller` singleton here: (rt, name, class, args, kwargs) -> its ActorMesh
    spawn_controller: Callable[[ActorRuntime, str, type, tuple, dict], Coroutine[Any, Any, Any]]
    fault_hook: Callable[[MeshFailure], None]  # the client's `unhandled_fault_hook`, looked up at each fault
    local_host: Callable[[], Any]  # this machine as a `HostMesh` (`_host_mesh.local_host_mesh`)


class Children(Protocol):
    """What this layer asks of the procs this process started (`_spawner.LocalSpawner`, created lazily by
    `spawner_of`)."""

    def is_child(self, proc_id: str) -> bool: ...

    def forget_spare(self, proc_id: str) -> None: ...

    def kill_all(self) -> None: ...


class ActorRuntime(Runtime):
    """One process's runtime: routing, and the state that lives on its loop (see the module docstring)."""

    def __init__(self, proc_id: str, is_controller: bool, parts: ProcessParts, **routing: Any) -> None:
        self.parts = parts
        self.supervision = Supervision(self, parts.fault_hook)
        self.actors = ActorDirectory()  # the actors living in this process (`_directory`)
        # tree casts: per-sender order of messages and (on agents) reply batches waiting on child processes
        self.tree = TreeState(self)
        self.spawner: Children | None = None  # a `_spawner.LocalSpawner`, created by `spawner_of`
        self.shared_sync_thread: Any = None  # a `_cell.SharedSyncThread`, with shared_asyncio_runtime
        self.owned_proc_meshes: dict[str, Any] = {}  # mesh id -> the `ProcMesh` this process owns
        self.controllers: dict[str, Any] = {}  # get_or_spawn_controller singletons (controller only): ActorMeshes
        self.proc_context: Any = None  # the `_context.Instance` used outside actors in this process
        self.self_proc: Any = None  # this process as a `ProcMesh` (`this_proc()`)
        # procs adopted from a dead controller (`adopt_proc_mesh`) on this machine: proc id -> (OS pid, start time
        # in clock ticks, socket directory), so a stop can still kill one that hangs, as a parent would
        self.adopted_os_pids: dict[str, tuple[int, int | None, str | None]] = {}
        self.owner_proc_id: str | None = None  # for procs: the process whose loss makes us an orphan
        # Procs spawned with a detach grace (`HostMesh.spawn_procs(detach_grace=...)`) outlive a lost owner for
        # that many seconds instead of exiting at once, so a new owner can adopt them (`adopt_proc_mesh`).
        self.detach_grace: float | None = None
        self.detach_log: str | None = None  # where stdout/stderr go once the owner (which read them) is gone
        self.detached_since: float | None = None  # wall time the owner was lost; None while it is there
        self.parent_os_pid: int | None = None  # the process that started this proc, while its death ends it
        self.on_detach: list[Callable[[str], None]] = []  # called with the reason when the owner is lost
        self.on_attach: list[Callable[[], None]] = []  # called when a (new) owner is connected again
        self.root_info: dict | None = None  # the controller's address, for get_or_spawn_controller
        self.host_python: str | None = None  # procs: the interpreter of `with_python_executable` they were spawned by
        # how a cast to many actors is sent: "tree" (one message per host agent), "proc" (one per process) or
        # "actor" (one per actor, replies one by one: the design before tree casts; kept for comparison)
        self.cast_mode = settings.REGENT_CAST.get()
        super().__init__(proc_id, is_controller, handlers=parts.handlers(self), faults=self.supervision, **routing)

    def ensure_self_proc(self) -> Any:
        """This process as a `ProcMesh` (made once)."""
        if self.self_proc is None:
            self.self_proc = self.parts.self_proc(self)
        return self.self_proc

    def is_child(self, peer: str) -> bool:
        return (self.spawner is not None and self.spawner.is_child(peer)) or super().is_child(peer)

    def forget_proc(self, proc_id: str) -> None:
        super().forget_proc(proc_id)
        if self.spawner is not None:
            self.spawner.forget_spare(proc_id)

    async def stop_owned(self, timeout: float) -> None:
        meshes = list(self.owned_proc_meshes.values())
        if meshes:
            await asyncio.wait([asyncio.ensure_future(pm._stop_async(timeout)) for pm in meshes],
                               timeout=timeout + 1)
        if self.spawner is not None:
            self.spawner.kill_all()

    # ------------------------------------------------------------------ orphans and the detach grace
    def owner_connected(self) -> bool:
        owner = self.owner_proc_id
        if owner is None:
            return True
        return any(c.peer == owner and not c.closed for c in self.connections)

    async def orphan_watch(self, parent_os_pid: int | None = None) -> None:
        """Procs only: exit when the owner process has been unreachable for `orphan_timeout` seconds, or at
        once when `parent_os_pid` (the process that started this one) is gone: a killed `regent train` then
        takes its replicas and their trainers with it within a second or two, instead of leaving them to
        train on until the orphan timeout.

        With a detach grace (set by the spawner's configure, so read at every tick) a lost owner detaches
        this proc instead: it goes on for up to `detach_grace` seconds (its actors keep working, what it owns
        stays up), is attached again when an owner connects (`Adopt`), and after the grace stops gracefully:
        the actors' `__cleanup__` and the atexit handlers run (allocations are released)."""
        self.parent_os_pid = parent_os_pid
        last_seen = self.loop.time()
        while True:
            timeout = config.orphan_timeout
            parent_os_pid = self.parent_os_pid  # cleared by a detach, and by an adoption (`on_adopt`)
            await asyncio.sleep(min(1.0, timeout / 4) if timeout is not None else 1.0)
            now = self.loop.time()
            if self.detached_since is not None:
                if self.owner_connected():
                    self._leave_detached()
                    last_seen = now
                elif self.detach_grace is not None and time.time() - self.detached_since >= self.detach_grace:
                    await self._orphan_exit_gracefully()
                continue
            orphaned = parent_os_pid is not None and os.getppid() != parent_os_pid
            if not orphaned and self.owner_connected():
                last_seen = now
                continue
            if self.detach_grace is not None:
                # the parent gone is certain; a dropped connection alone gets the detach delay (a restart of
                # the owner's loop or a transient network failure must not detach a healthy proc)
                if orphaned or now - last_seen >= min(DETACH_AFTER_S, timeout if timeout is not None else
                                                      DETACH_AFTER_S):
                    self._enter_detached("its parent process is gone" if orphaned else
                                         f"owner {self.owner_proc_id} unreachable for {now - last_seen:.1f} s")
                    self.parent_os_pid = None  # from here on, only an owner's connection counts
                continue
            if timeout is None and not orphaned:
                continue
            if orphaned or now - last_seen >= timeout:
                if orphaned:
                    logger.error("the process that started this proc (pid %d) is gone; this proc exits",
                                 parent_os_pid)
                else:
                    logger.error("owner process %s unreachable for %.1f s; this proc exits (orphan timeout, "
                                 "REGENT_ORPHAN_TIMEOUT)", self.owner_proc_id, now - last_seen)
                if self.spawner is not None:
                    self.spawner.kill_all()  # what this proc owns cannot outlive it
                with contextlib.suppress(Exception):  # a closed stdout/stderr: nowhere to report; exiting anyway
                    sys.stdout.flush()
                    sys.stderr.flush()
                remove_sock_dir(self.sock_dir)
                os._exit(0)

    def _enter_detached(self, reason: str) -> None:
        """The owner is lost: keep going for the grace, with output to the detach log (the pipes the owner
        read have no reader any more: writes to them would fail), and tell the hooks."""
        self.detached_since = time.time()
        if self.detach_log:
            try:
                os.makedirs(os.path.dirname(self.detach_log) or ".", exist_ok=True)
                fd = os.open(self.detach_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                with contextlib.suppress(Exception):  # a closed stdout/stderr: nothing to flush
                    sys.stdout.flush()
                    sys.stderr.flush()
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
            except OSError as exc:
                logger.error("cannot open the detach log %s (%s); this proc's output is lost from here on",
                             self.detach_log, exc)
        logger.warning("proc %s: owner lost (%s); going on without it for up to %.0f s (detach grace), "
                       "waiting to be adopted", self.proc_id, reason, self.detach_grace or 0.0)
        for hook in list(self.on_detach):
            try:
                hook(reason)
            except Exception:
                logger.exception("a detach hook failed")

    def _leave_detached(self) -> None:
        """An owner is connected again (it adopted this proc): the hooks resume what waited for it."""
        if self.detached_since is None:
            return
        logger.warning("proc %s: adopted by %s after %.1f s without an owner", self.proc_id, self.owner_proc_id,
                       time.time() - self.detached_since)
        self.detached_since = None
        for hook in list(self.on_attach):
            try:
                hook()
            except Exception:
                logger.exception("an attach hook failed")

    async def _orphan_exit_gracefully(self) -> None:
        """The grace is over and nobody adopted this proc: stop its actors (their `__cleanup__` releases what
        they hold, e.g. a cluster allocation) and exit through the atexit handlers."""
        logger.error("proc %s: no owner for %.0f s (detach grace %.0f s): stopping, what it holds released",
                     self.proc_id, time.time() - (self.detached_since or time.time()), self.detach_grace or 0.0)
        try:
            await asyncio.wait_for(stop_self(self, None), timeout=config.stop_timeout + 30)
        finally:  # stop_self exits the process; reached only if it failed or hung
            if self.spawner is not None:
                self.spawner.kill_all()
            remove_sock_dir(self.sock_dir)
            os._exit(1)


async def stop_self(rt: ActorRuntime, reply: tuple | None, teardown: bool = False) -> None:
    """Stop every actor of this proc (running `__cleanup__`), say goodbye to peers, and exit (`teardown`: through
    the interpreter's own exit where that is safe, see `exit_gracefully`)."""
    waits = []
    for cell in rt.actors.running():
        fut = rt.loop.create_future()
        port = rt.new_port(OneShot(fut))
        cell.post(("stop", (rt.proc_id, port, 0), "proc mesh stopped"))
        waits.append(fut)
    if waits:
        await asyncio.wait(waits, timeout=config.stop_timeout)
    if reply is not None:
        rt.send_reply(reply, OK, None)
    await asyncio.sleep(0)
    for conn in list(rt.connections):
        with contextlib.suppress(Exception):  # a peer that is gone already needs no goodbye
            conn.send(encode(Bye()), b"")
            conn.flush()
    rt.stopping = True
    if rt.spawner is not None:
        rt.spawner.kill_all()
    await asyncio.sleep(0.05)
    exit_gracefully(0, teardown)  # atexit handlers and finalizers run, and with `teardown` module teardown


# ---------------------------------------------------------------------------------- the runtime of this process
_runtime: ActorRuntime | None = None
_runtime_lock = threading.Lock()
_parts: list[ProcessParts] = []


def install_parts(parts: ProcessParts) -> None:
    """Called once, by the package's `__init__` (which imports every layer): what runtimes are built with."""
    _parts[:] = [parts]


def new_runtime(proc_id: str, is_controller: bool, **routing: Any) -> ActorRuntime:
    """A runtime of this process (a client's, a proc's or a worker's), built with the installed parts."""
    if not _parts:
        raise RuntimeError("regent.actor is not fully imported (its __init__ installs the runtime's parts)")
    return ActorRuntime(proc_id, is_controller, _parts[0], **routing)


_transport: dict[str, Any] = {}  # this controller's listener choice (enable_transport), read at runtime start


def enable_transport(transport: ChannelTransport | str) -> None:
    """Choose how this program (and the procs it starts) can be reached, before the runtime starts (the
    first mesh, `context()` or `this_host()` call); afterwards it raises RuntimeError.

    `"ipc"`/`ChannelTransport.Unix` (default) and `TcpWithLocalhost`: listeners on loopback, so only this
    machine reaches them. `"tcp"`/`TcpWithHostname`: listeners on every interface, advertised under this
    host's name, for workers on other machines that must reach back. `"tcp://HOST:PORT"`: this program's TCP
    listener on exactly that address (its procs listen on HOST with ports of their own). Every connection is
    authenticated with the job secret whichever is chosen; the TLS transports are not provided.
    """
    if isinstance(transport, str) and "://" not in transport:
        try:
            transport = ChannelTransport(transport)
        except ValueError:
            raise ValueError(f"unknown transport {transport!r}: use 'ipc', 'tcp', 'tcp://HOST:PORT' or a "
                             "ChannelTransport") from None
    if transport in _TLS:
        raise NotImplementedError(f"{transport}: Regent has no TLS transport; connections are authenticated "
                                  "with the job secret (use 'tcp' to be reachable from other machines)")
    if runtime_if_started() is not None:
        raise RuntimeError("`enable_transport()` must be called before any other calls in the regent.actor API "
                           "(this process's runtime has already started)")
    if isinstance(transport, str):
        kind, where = parse_address(transport)
        if kind != "tcp":
            raise ValueError(f"enable_transport({transport!r}): an explicit address must be tcp://HOST:PORT")
        choice = {"host": where[0], "port": where[1], "advertise": None}
    elif transport is ChannelTransport.TcpWithHostname:
        choice = {"host": "0.0.0.0", "port": 0, "advertise": socket.gethostname()}
    elif isinstance(transport, ChannelTransport):
        choice = {"host": "127.0.0.1", "port": 0, "advertise": None}
    else:
        raise TypeError(f"enable_transport needs a ChannelTransport or a string, got {transport!r}")
    _transport.clear()
    _transport.update(choice)


def get_runtime() -> ActorRuntime:
    """This process's runtime; the first call in a controller starts it on a background thread."""
    global _runtime
    rt = _runtime
    if rt is not None:
        return rt
    with _runtime_lock:
        if _runtime is None:
            from_env = job_secret_from_env()
            rt = new_runtime(proc_id=new_id("client"), is_controller=True,
                             secret=from_env or inherited_secret() or client_user_secret(),
                             tcp_host=_transport.get("host"), advertise_host=_transport.get("advertise"),
                             tcp_port=_transport.get("port", 0))
            if from_env is None:
                share_secret_with_children(rt)
            rt.start_in_thread()
            _runtime = rt
        return _runtime


# A client without REGENT_JOB_SECRET(_FILE) makes up its job secret; the programs it starts (a `multiprocessing`
# child given one of its meshes, as in Monarch's test_client_hard_exit_cleanup) find it through this variable: the
# path of a file only this user can read, in the client's private socket directory (gone when the client is).
INHERITED_SECRET_ENV = settings.REGENT_JOB_SECRET_INHERITED_FILE.name


def share_secret_with_children(rt: ActorRuntime) -> None:
    """Let the programs this client starts join its job, as its procs do (they get the secret itself): they
    inherit the path of a 0600 file holding it, not the secret. Only a `regent.actor` client reads it
    (`inherited_secret`): a `regent worker` still needs an explicit secret, and the ft layers' RPC and transfer
    authentication still follow REGENT_JOB_SECRET(_FILE) alone."""
    path = os.path.join(rt.sock_dir, "job-secret")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(rt.secret.hex())
    except OSError as exc:  # a program this client starts then has to be given the secret explicitly
        logger.debug("could not leave the job secret for child programs: %s", exc)
        return
    os.environ[INHERITED_SECRET_ENV] = path


def inherited_secret() -> bytes | None:
    """The job secret of the client that started this program (`share_secret_with_children`) while that client
    runs; None when there is none (or its file is gone: the client ended, or this program runs elsewhere)."""
    path = settings.REGENT_JOB_SECRET_INHERITED_FILE.get()
    if not path:
        return None
    try:
        with open(path) as f:
            return bytes.fromhex(f.read().strip())
    except (OSError, ValueError):  # the client ended (its socket directory is gone) or it is not ours: no secret
        return None


def client_user_secret() -> bytes | None:
    """This user's default secret (`regent.auth.user_secret`) for a client given none, so that a worker started
    with none (`run_worker_loop_forever(address)`, as in Monarch) accepts it. A file others can read is refused
    (InsecureSecretFile); one that cannot be made leaves the client a secret of its own, as before."""
    try:
        return user_secret()
    except OSError as exc:
        logger.warning("no per-user job secret (%s); this client makes up its own, so workers must be given "
                       "it: set REGENT_JOB_SECRET_FILE in both", exc)
        return None


def set_runtime(rt: ActorRuntime) -> None:
    global _runtime
    _runtime = rt


def runtime_if_started() -> ActorRuntime | None:
    return _runtime


