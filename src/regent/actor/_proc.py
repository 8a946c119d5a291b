"""Processes and hosts: `HostMesh`, `ProcMesh`, `this_host()`, `this_proc()`, `attach_to_workers`, and
`get_or_spawn_controller`. Starting the processes is `_spawner`'s job; the messages they exchange are
handled in `_handlers`.

Who watches whom:
- the process that starts a proc (its parent) reaps it and reports its exit status ("Killed(sig=9)");
- a proc watches its owner (the process that asked for it): if the owner has been unreachable for
  `orphan_timeout` seconds, the proc exits, so trainers never outlive a killed controller;
- a proc started on a remote host by `regent worker` has the worker as parent and the controller as owner;
  the worker forwards exit statuses and output to the owner.
- a proc adopted by a new controller (`adopt_proc_mesh`, after its controller died) keeps its parent but has
  the new controller as owner; nobody reaps it for the new owner, which learns of its end by the connection
  closing and kills it by OS pid if it hangs in a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from regent.actor._actor import check_constructor_args, validate_actor_class
from regent.actor._config import config
from regent.actor._context import Instance, context
from regent.actor._errors import ActorError, format_remote_traceback
from regent.actor._future import Future
from regent.actor._mesh import (
    REFERENCE_VERSION,
    ActorMesh,
    ActorMeshRef,
    Gather,
    _register_state,
    actor_mesh_refs,
    reference_os_pids,
)
from regent.actor._messages import (
    Adopt,
    GetOrSpawnController,
    HostKeepWarm,
    HostKill,
    HostShutdown,
    HostSpawn,
    LogLevel,
    Spawn,
    StopProc,
)
from regent.actor._pickle import dumps, loads
from regent.actor._runtime import (
    CONTROLLERS_KEY,
    ERROR,
    OK,
    ROOT_KEY,
    MeshState,
    Runtime,
    check_reference_job,
    get_runtime,
    new_id,
    remove_sock_dir,
    runtime_if_started,
)
from regent.actor._shape import Extent, MeshTrait, Point, Shape, Slice
from regent.actor._spawner import (
    LOG_SYNC_MARK,
    BootstrapCommand,
    _OneShot,
    _write_output,
    check_proc_bind,
    default_bootstrap_cmd,
    spawner_of,
)
from regent.actor._transport import split_address
from regent.actor._tree import SPAWN, send_cast

logger = logging.getLogger("regent.actor")
LOG_SYNC_TIMEOUT = 5.0  # how long logging_option waits for procs' earlier output to drain through the pipes


# ============================================================================================ hosts
class HostMeshState:
    def __init__(self, kind: str, addresses: list[str], name: str) -> None:
        self.kind = kind  # "local" or "remote"
        self.addresses = addresses
        self.name = name
        self.agent_pids: dict[int, str] = {}
        self.shut_down = False
        self.owned = True
        self.initialized: Future | None = None
        self.stream_logs = True  # proc meshes spawned here start forwarding their output to the client


def dial_address(address: str) -> str:
    """The address to dial for a worker given in any of Monarch's forms (`URL`, `URL@BIND`, `ID@URL[@BIND]`)."""
    dial, _ = split_address(address)
    if dial.startswith("tcp://*"):
        raise NotImplementedError(f"tcp://* addresses are not supported ({address!r}); give the worker's host")
    return dial


class HostMesh(MeshTrait):
    """Hosts that can start procs. `this_host()` is the local machine (no dimensions); meshes from
    `attach_to_workers` or a job have one dimension `{"hosts": N}`."""

    def __init__(self, state: HostMeshState, shape: Shape, python: str | None = None) -> None:
        self._state = state
        self._shape = shape
        self._python = python  # with_python_executable: the interpreter procs spawned from this view run

    def _new_with_shape(self, shape: Shape) -> HostMesh:
        return HostMesh(self._state, shape, self._python)

    @property
    def stream_logs(self) -> bool:
        """Whether proc meshes spawned here start with their stdout/stderr forwarded to this client
        (`ProcMesh.logging_option` changes it per proc mesh). True for every Regent host mesh."""
        return self._state.stream_logs

    @property
    def is_fake_in_process(self) -> bool:
        """Always False: every Regent host mesh starts real OS processes (there is no in-process host)."""
        return False

    def with_python_executable(self, python: str) -> HostMesh:
        """This host mesh, but procs spawned from the result run under `python` (a path, or a name looked up
        on PATH when spawning) as `python -m regent.actor._proc_main`. That interpreter must be able to import
        regent and its dependencies (install them there, or pass `env={"PYTHONPATH": ...}` to `spawn_procs`).
        Warm spares run this process's interpreter, so such procs are always started cold."""
        if not isinstance(python, (str, os.PathLike)) or not str(python):
            raise TypeError(f"with_python_executable needs the interpreter's path, got {python!r}")
        return HostMesh(self._state, self._shape, os.fspath(python))

    @property
    def initialized(self) -> Future:
        """Resolves to True once every host of this mesh answers (at once for the local host); fails
        with the reason when a host cannot be reached."""
        state = self._state
        if state.initialized is None:
            if state.kind == "local":
                state.initialized = Future._resolved(True)
            else:
                rt = get_runtime()

                async def reach(h: int) -> None:
                    try:
                        await self._agent(rt, h)
                    except Exception as exc:  # re-raised naming the host and the fix
                        # "attach failed: config push failed during attach" is Monarch's wording (programs match it)
                        raise ConnectionError(
                            f"attach failed: config push failed during attach: host {h} of host mesh {state.name} "
                            f"at {state.addresses[h]} cannot be reached: {exc!r}; is `regent worker --address ...` "
                            f"running there with this job's secret?"
                        ) from exc

                async def reach_all() -> bool:
                    await asyncio.gather(*(reach(h) for h in range(len(state.addresses))))
                    return True

                state.initialized = rt.submit(reach_all())
        return state.initialized

    @property
    def region(self) -> Extent:
        return self._shape.extent

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        bootstrap: Callable[[], Any] | None = None,
        name: str | None = None,
        proc_bind: list[dict] | None = None,
        bootstrap_command: Any = None,
        env: dict[str, str] | None = None,
        detach_grace: float | None = None,
        detach_log_dir: str | None = None,
    ) -> ProcMesh:
        """Start `prod(per_host)` procs on every host of this mesh; returns at once (`initialized` waits).

        `detach_grace` (Regent extension): when this process (their owner) is lost, the procs go on for that
        many seconds instead of exiting at once, waiting to be adopted by a new owner (`adopt_proc_mesh`); their
        output goes to `detach_log_dir/detached-<proc id>.log` then. After the grace they stop gracefully. Procs
        they spawn themselves keep the default rule (they end with their own owner).

        `env` (Regent extension) is set in every proc before anything is imported. `bootstrap` runs in
        every proc before any actor (use `current_rank()` in it for per-rank settings). Procs come from
        warm spares when `keep_warm` made some. `bootstrap_command` (a `BootstrapCommand`, an argv list, or a
        function of the proc's Point returning one) is the command that starts each proc instead of
        `default_bootstrap_cmd()`; it must end up running `python -m regent.actor._proc_main` (a wrapper
        script may prepare things and `exec "$@"`). Procs started by such a command never claim warm spares.
        """
        if self._state.shut_down:
            raise RuntimeError("HostMesh has already been shut down")
        per_host = dict(per_host or {})
        host_extent = self._shape.extent
        clash = set(per_host) & set(host_extent.labels)
        if clash:
            raise ValueError(f"per_host labels {sorted(clash)} clash with the host mesh dimensions {host_extent.labels}")
        for label, size in per_host.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"per_host[{label!r}] must be a positive int, got {size!r}")
        binds: list[dict] | None = None
        if proc_bind is not None:
            import math

            per = math.prod(per_host.values())
            if len(proc_bind) != per:  # Monarch's wording
                raise ValueError(f"proc_bind length ({len(proc_bind)}) must equal procs_per_host ({per}): "
                                 "one entry per proc of a host")
            binds = [check_proc_bind(entry) for entry in proc_bind]
        rt = get_runtime()
        owner_key = context().actor_instance.key
        extent = Extent(host_extent.labels + list(per_host), host_extent.sizes + list(per_host.values()))
        commands = self._commands(bootstrap_command, extent)
        name = name or new_id("procs")
        mesh_id = new_id("pm")
        proc_ids = [f"{name}-{mesh_id[3:9]}-{r}" for r in range(extent.nelements)]
        state = ProcMeshState(mesh_id, name, extent, proc_ids, owner_key, self)
        state.logs = LogRouter(rt, self._state.stream_logs)
        mesh = ProcMesh(state, Shape.from_extent(extent))
        bootstrap_body = dumps(bootstrap)[0] if bootstrap is not None else b""
        per_host_n = extent.nelements // max(host_extent.nelements, 1)
        host_ranks = self._shape.ranks()
        specs_by_host: list[list[dict]] = []
        for h, host_rank in enumerate(host_ranks):
            specs = []
            for i in range(per_host_n):
                r = h * per_host_n + i
                label = _label(name, Point(r, extent))
                specs.append({
                    "pid": proc_ids[r],
                    "env": {**config.child_env(), **(env or {})},
                    "gpu_index": i if "gpus" in per_host else None,
                    "label": label,
                    "sys_path": [p for p in sys.path if p],
                    "command": commands[r],
                    "cfg": {"owner": rt.proc_id, "mesh_id": mesh_id, "name": name, "labels": extent.labels,
                            "sizes": extent.sizes, "rank": r, "root": rt.root_info or rt.info,
                            "sys_path": [p for p in sys.path if p], "bind": binds[i] if binds else None,
                            "detach_grace": detach_grace, "detach_log_dir": detach_log_dir,
                            "python": self._python},
                })
            specs_by_host.append((host_rank, specs))

        def register() -> None:
            for pid in proc_ids:
                rt.held.add(pid)
            rt.owned_proc_meshes[mesh_id] = mesh
            state.task = rt.loop.create_task(self._spawn_all(rt, state, specs_by_host, bootstrap_body))

        rt.run_on_loop(register)
        _register_owned(rt, owner_key, mesh)
        return mesh

    def _commands(self, bootstrap_command: Any, extent: Extent) -> list[dict | None]:
        """The bootstrap command of every proc (None: Regent's default, which may claim a warm spare)."""
        if bootstrap_command is None:
            if self._python is None:
                return [None] * extent.nelements
            bootstrap_command = default_bootstrap_cmd(self._python)
        out: list[dict | None] = []
        for r in range(extent.nelements):
            cmd = bootstrap_command(Point(r, extent)) if callable(bootstrap_command) else bootstrap_command
            if isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, (str, os.PathLike)) for a in cmd):
                cmd = BootstrapCommand(program=os.fspath(cmd[0]), args=[os.fspath(a) for a in cmd[1:]])
            if not isinstance(cmd, BootstrapCommand):
                raise TypeError("bootstrap_command must be a BootstrapCommand (see default_bootstrap_cmd()), an "
                                f"argv list, or a function of the proc's Point returning one; got {cmd!r}")
            out.append(cmd.to_spec())
        return out

    async def _spawn_all(self, rt: Runtime, state: ProcMeshState, specs_by_host: list, bootstrap: bytes) -> None:
        try:
            if self._state.kind == "local":
                spawner = spawner_of(rt)
                specs = [s for _, host_specs in specs_by_host for s in host_specs]
                infos = await spawner.spawn(specs, bootstrap, rt.supervision.proc_exited, state.logs, release=True)
                state.from_spare = {info["id"]: info["from_spare"] for info in infos}
            else:
                await asyncio.gather(*(self._spawn_remote(rt, state, host_rank, specs, bootstrap)
                                       for host_rank, specs in specs_by_host))
        except BaseException as exc:  # noqa: BLE001 - reported through `initialized`, not supervision
            state.stopping = True
            for pid in state.proc_ids:
                if pid not in rt.routes:
                    rt.supervision.proc_gone(pid, f"proc failed to start: {exc}")
            if isinstance(exc, ActorError):
                state.initialized._set_exception(exc)
            else:
                state.initialized._set_exception(ActorError(exc, f"spawning procs {state.name} failed",
                                                            format_remote_traceback(exc)))
            return
        state.initialized._set_result(True)

    async def _address(self, host_rank: int) -> str:
        """The worker address of a host; a `Future[str]` given to `attach_to_workers` is awaited here."""
        address = self._state.addresses[host_rank]
        if isinstance(address, Future):
            address = await address
            if not isinstance(address, str):
                raise TypeError(f"the Future given for host {host_rank} resolved to {address!r}, not an address")
            self._state.addresses[host_rank] = address
        return address

    async def _agent(self, rt: Runtime, host_rank: int) -> str:
        pid = self._state.agent_pids.get(host_rank)
        if pid is not None and pid in rt.routes:
            return pid
        pid = await rt.connect_address(dial_address(await self._address(host_rank)))
        self._state.agent_pids[host_rank] = pid
        return pid

    async def _spawn_remote(self, rt: Runtime, state: ProcMeshState, host_rank: int, specs: list[dict],
                            bootstrap: bytes) -> None:
        agent = await self._agent(rt, host_rank)
        events = HostEvents(rt, state.logs)
        fut = rt.loop.create_future()
        port = rt.new_port(_OneShot(fut))
        try:
            rt.send(agent, HostSpawn(specs, (rt.proc_id, events.port_id, 0), (rt.proc_id, port, 0)), bootstrap)
            rt.stats["host_spawn_sent"] += 1
            status, body, buffers = await fut
        finally:
            rt.drop_port(port)
        value = loads(body, buffers)
        if status != OK:
            if status == ERROR:
                raise ActorError(*value)
            raise RuntimeError(str(value))
        for spec, info in zip(specs, value):
            state.from_spare[spec["pid"]] = bool(info.pop("from_spare", False))
            rt.release_remote(spec["pid"], info)
            self._state.agent_pids.setdefault(host_rank, agent)
            rt.remote_procs[spec["pid"]] = agent

    def keep_warm(self, n: int, preload: list[str] | tuple[str, ...] = (), refill_delay_s: float = 0.0) -> Future:
        """Keep `n` idle procs per host that already imported `preload`; `spawn_procs` claims them.
        `refill_delay_s`: start the replacement of a claimed spare this much later, so that its imports do not
        compete for the CPU with the claimed proc while it starts (a restart's critical path)."""
        rt = get_runtime()

        async def run() -> None:
            if self._state.kind == "local":
                spawner_of(rt).keep_warm(n, list(preload), refill_delay_s)
                return
            for host_rank in self._shape.ranks():
                agent = await self._agent(rt, host_rank)
                rt.send(agent, HostKeepWarm(n, list(preload), refill_delay_s))

        return rt.submit(run())

    def shutdown(self) -> Future:
        """Stop its procs and, for worker hosts, end the `regent worker` processes too."""
        if not self._state.owned:
            raise RuntimeError("cannot shut down `HostMesh` that is a reference instead of owned")
        if self._state.shut_down:
            raise RuntimeError("HostMesh has already been shut down")
        self._state.shut_down = True
        rt = get_runtime()
        stopped = self.stop()

        async def run() -> None:
            await stopped
            if self._state.kind == "remote":
                for host_rank in self._shape.ranks():
                    pid = self._state.agent_pids.get(host_rank)
                    if pid is not None and pid not in rt.supervision.dead:
                        rt.supervision.graceful.add(pid)
                        rt.send(pid, HostShutdown())

        return rt.submit(run())

    def stop(self) -> Future:
        """Stop every proc mesh spawned from this host mesh (the workers stay up)."""
        rt = get_runtime()

        async def run() -> None:
            meshes = [pm for pm in list(rt.owned_proc_meshes.values())
                      if pm._state.host is not None and pm._state.host._state is self._state]
            await asyncio.gather(*(pm._stop_async() for pm in meshes), return_exceptions=True)

        return rt.submit(run())

    def __reduce__(self):
        addresses = [a.get() if isinstance(a, Future) else a for a in self._state.addresses]
        return (_rebuild_host_mesh, (self._state.kind, addresses, self._state.name, self._shape, self._python,
                                     self._state.stream_logs))

    async def __aenter__(self) -> HostMesh:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._state.owned and not self._state.shut_down:
            await self.shutdown()

    def __repr__(self) -> str:
        return f"<HostMesh {self._state.name} {self._shape.extent}>"


def _rebuild_host_mesh(kind: str, addresses: list[str], name: str, shape: Shape, python: str | None = None,
                       stream_logs: bool = True) -> HostMesh:
    state = HostMeshState(kind, addresses, name)
    state.owned = False
    state.stream_logs = stream_logs
    return HostMesh(state, shape, python)


def _label(name: str, point: Point) -> str:
    coords = ",".join(f"{label}={point[label]}" for label in point) if len(point) else "0"
    return f"{name} {coords}"


class HostEvents:
    """Receives exit and output events about procs a remote worker started for this process."""

    def __init__(self, rt: Runtime, output: Callable[[str, str, str], None] = _write_output) -> None:
        self.rt = rt
        self.output = output
        self.port_id = rt.new_port(self)

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
        event = loads(body, buffers)
        if event[0] == "exits":
            self.rt.supervision.procs_gone([tuple(e) for e in event[1]])
        elif event[0] == "exit":
            self.rt.supervision.proc_gone(event[1], event[2])
        elif event[0] == "out":
            self.output(event[1], event[2], event[3])


class LogRouter:
    """Where the stdout/stderr lines of one proc mesh's procs go (`ProcMesh.logging_option`): to this client's
    stdout/stderr (prefixed with the proc), nowhere, or, with an aggregation window, gathered for that long
    and printed once per distinct line with its count (`[4 similar log lines] loss=0.1`), so N ranks printing
    the same line do not flood the terminal. Called on the runtime's loop."""

    def __init__(self, rt: Runtime, stream: bool) -> None:
        self.rt = rt
        self.stream = stream
        self.window: float | None = None
        self.pending: dict[tuple[str, str], list] = {}  # (stream, line without the proc prefix) -> [count, line]
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.syncs: dict[str, tuple[set, asyncio.Future]] = {}  # token -> (pid/stream marks awaited, done)

    def expect(self, token: str, keys: set[tuple[str, str]]) -> asyncio.Future:
        """A future that completes once every (pid, stream) in `keys` printed the sync mark `token`."""
        done = self.rt.loop.create_future()
        self.syncs[token] = (set(keys), done)
        return done

    def _synced(self, pid: str, stream: str, token: str) -> None:
        entry = self.syncs.get(token)
        if entry is None:
            return
        entry[0].discard((pid, stream))
        if not entry[0]:
            del self.syncs[token]
            if not entry[1].done():
                entry[1].set_result(None)

    def set_mode(self, stream: bool, window: float | None) -> None:
        self.stream = stream
        self.window = window
        if window is None:
            self.flush()

    def __call__(self, pid: str, stream: str, text: str) -> None:
        if LOG_SYNC_MARK in text:
            before, _, token = text.partition(LOG_SYNC_MARK)
            self._synced(pid, stream, token.strip())
            if not _without_label(before).strip():
                return
            text = before + "\n"  # a partial line the proc printed just before the mark
        if not self.stream:
            return
        if self.window is None or self.closed:
            _write_output(pid, stream, text)
            return
        key = (stream, _without_label(text))
        entry = self.pending.get(key)
        if entry is None:
            self.pending[key] = [1, text]
        else:
            entry[0] += 1
        if self.timer is None:
            self.timer = self.rt.loop.call_later(self.window, self.flush)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        pending, self.pending = self.pending, {}
        for (stream, line), (count, first) in pending.items():
            _write_output("", stream, first if count == 1 else f"[{count} similar log lines] {line}")

    def close(self) -> None:
        """The mesh stopped: print what is gathered; lines still draining from the pipes go out at once."""
        self.flush()
        self.closed = True


def _without_label(text: str) -> str:
    if text.startswith("[") and "] " in text:
        return text.split("] ", 1)[1]
    return text


# ============================================================================================ proc meshes
class ProcMeshState:
    def __init__(self, mesh_id: str, name: str, extent: Extent, proc_ids: list[str], owner_key: str,
                 host: HostMesh | None) -> None:
        self.mesh_id = mesh_id
        self.name = name
        self.extent = extent
        self.proc_ids = proc_ids
        self.owner_key = owner_key
        self.host = host
        self.initialized: Future = Future._new()
        self.stopping = False
        self.stopped = False
        self.is_self = False
        self.owned = True
        self.task: asyncio.Task | None = None
        self.logs: LogRouter | None = None
        self.base: ProcMeshState | None = None  # the mesh a `colocated` view was made from
        self.from_spare: dict[str, bool] = {}  # proc id -> it was a claimed warm spare (filled as procs start)


class ProcMesh(MeshTrait):
    """A mesh of processes. `spawn` starts actors on them; `stop` ends them (never hangs)."""

    def __init__(self, state: ProcMeshState, shape: Shape) -> None:
        self._state = state
        self._shape = shape

    def _new_with_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._state, shape)

    @property
    def initialized(self) -> Future:
        return self._state.initialized

    @property
    def spares_claimed(self) -> int | None:
        """How many procs of the mesh `spawn_procs` made (all of it, for slices and views) were warm spares
        claimed from `keep_warm` (Regent extension); None until `initialized` resolved. A restart that asked for
        warm procs can so say whether it really got them."""
        state = self._state.base or self._state
        if not state.initialized.done() or state.initialized.exception() is not None:
            return None
        return sum(state.from_spare.get(pid, False) for pid in state.proc_ids)

    @property
    def host_mesh(self) -> HostMesh:
        if self._state.host is None:
            return local_host_mesh()
        return self._state.host

    def colocated(self, label: str, n: int) -> ProcMesh:
        """This proc mesh with an extra innermost dimension `label` of size `n` whose ranks share processes:
        spawning on the result puts `n` actors of the mesh in every proc (Regent extension; many actors per
        process without starting more processes). Stop the original mesh, not this view."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"colocated needs n >= 1, got {n!r}")
        extent = self._shape.extent
        if label in extent.labels:
            raise ValueError(f"dimension {label!r} already exists in {extent}")
        st = self._state
        pids = [st.proc_ids[r] for r in self._shape.ranks() for _ in range(n)]
        new_extent = Extent(extent.labels + [label], extent.sizes + [n])
        view = ProcMeshState(st.mesh_id, st.name, new_extent, pids, st.owner_key, st.host)
        view.owned = False
        view.initialized = st.initialized
        view.base = st
        return ProcMesh(view, Shape.from_extent(new_extent))

    def spawn(self, name: str, Class: type, *args: Any, **kwargs: Any) -> Any:
        """Start one `Class(*args, **kwargs)` actor per proc; returns the ActorMesh at once."""
        base = self._state.base
        if self._state.stopped or self._state.stopping or (base is not None and (base.stopped or base.stopping)):
            raise RuntimeError("`ProcMesh` has already been stopped")
        owner_key = context().actor_instance.key
        return spawn_actor_mesh(self, name, Class, args, kwargs, owner_key)

    def stop(self, reason: str = "stopped by client", timeout: float | None = None) -> Future:
        """Stop every actor (running `__cleanup__`) and end the procs. Procs still there after `timeout`
        seconds (Regent extension; default REGENT_STOP_TIMEOUT, 10 s) are killed, so this never hangs;
        `timeout=0` kills at once (fast restarts when actors may be stuck in a collective)."""
        if not self._state.owned or len(self._shape) != self._state.extent.nelements and not self._state.is_self:
            raise ValueError("ProcMesh is not owned; must be stopped by an owner")
        return get_runtime().submit(self._stop_async(timeout))

    async def _stop_async(self, timeout: float | None = None) -> None:
        state = self._state
        if state.is_self or state.stopped:
            return
        rt = get_runtime()
        timeout = config.stop_timeout if timeout is None else timeout
        _mark_stopping(rt, state)
        exits = [rt.supervision.exit_future(pid) for pid in state.proc_ids]
        for pid in state.proc_ids:
            if pid not in rt.supervision.dead:
                rt.send(pid, StopProc("stopped by owner", None, rt.proc_id, rt.tree.next_seq(pid)))
        if exits:
            pending = {f for f in exits if not f.done()}
            if timeout > 0:
                _, pending = await asyncio.wait(exits, timeout=timeout)
            if pending:
                for pid in state.proc_ids:
                    if pid not in rt.supervision.dead:
                        kill_proc(rt, pid)
                await asyncio.wait(pending, timeout=5.0)
                for pid in state.proc_ids:
                    if pid not in rt.supervision.dead:
                        rt.supervision.proc_gone(pid, None)
        if state.task is not None and not state.task.done():
            state.task.cancel()
        if not state.initialized.done():
            state.initialized._set_exception(RuntimeError(f"proc mesh {state.name} was stopped while starting"))
        state.stopped = True
        rt.owned_proc_meshes.pop(state.mesh_id, None)
        for pid in state.proc_ids:
            rt.adopted_os_pids.pop(pid, None)
        if state.logs is not None:
            state.logs.close()

    def logging_option(self, stream_to_client: bool = False, aggregate_window_sec: float | None = None,
                       level: int = logging.INFO) -> Future:
        """Choose what this proc mesh's processes print on this client (Monarch's defaults; await it or `.get()`).

        `stream_to_client`: forward their stdout/stderr here (prefixed with the proc), or drop it.
        `aggregate_window_sec`: gather lines for that many seconds and print each distinct line once with its
        count (needs `stream_to_client=True`; None prints every line as it comes).
        `level`: the level of the procs' root Python logger (what `logging` calls inside them emit).
        Applies to the whole mesh, also when called on a slice.
        """
        if not isinstance(level, int) or not 0 <= level <= 255:
            raise ValueError(f"Invalid logging level: {level!r}")
        if aggregate_window_sec is not None:
            if not stream_to_client:
                raise ValueError("aggregate_window_sec needs stream_to_client=True: only streamed lines are aggregated")
            if aggregate_window_sec <= 0:
                raise ValueError(f"aggregate_window_sec must be positive, got {aggregate_window_sec!r}")
        state = self._state
        if state.is_self or state.logs is None:
            raise RuntimeError("logging_option applies to proc meshes spawned by this process "
                               "(not to this_proc() or to a reference received from elsewhere)")
        rt = get_runtime()

        async def run() -> None:
            await state.initialized
            token = new_id("logsync")
            synced = state.logs.expect(token, {(pid, s) for pid in state.proc_ids for s in ("stdout", "stderr")})
            waits = []
            for pid in state.proc_ids:
                fut = rt.loop.create_future()
                waits.append((fut, rt.new_port(_OneShot(fut))))
                rt.send(pid, LogLevel(int(level), token, (rt.proc_id, waits[-1][1], 0)))
            try:
                replies = await asyncio.wait_for(asyncio.gather(*(f for f, _ in waits)), config.spawn_timeout)
            finally:
                for _, port in waits:
                    rt.drop_port(port)
            for pid, (status, body, buffers) in zip(state.proc_ids, replies):
                if status != OK:
                    raise RuntimeError(f"proc {pid} did not take the logging options: {loads(body, buffers)}")
            # Lines the procs printed before this call are ahead of the marks in their pipes: wait for the
            # marks so those lines keep the old options and every line printed after this returns gets the new.
            try:
                await asyncio.wait_for(synced, LOG_SYNC_TIMEOUT)
            except asyncio.TimeoutError:  # a proc closed or redirected its stdout/stderr: apply anyway
                state.logs.syncs.pop(token, None)
                logger.warning("logging_option on %s: not every proc's output caught up within %s s; the new "
                               "options apply from now", state.name, LOG_SYNC_TIMEOUT)
            state.logs.set_mode(bool(stream_to_client), aggregate_window_sec)

        return rt.submit(run())

    def reference(self) -> dict:
        """A JSON-able description of the whole proc mesh (also when called on a slice or a `colocated` view)
        that outlives this process: a new controller with the same job secret gives it to `adopt_proc_mesh`
        to take the procs over once this one is gone. Unlike a pickle, it names no referrer (a dead process
        to ask for addresses); it carries every proc's address, OS pid and the job's secret fingerprint."""
        st = self._state.base or self._state
        if st.is_self:
            raise ValueError("this_proc() has no reference to adopt: only spawned proc meshes have one")
        if not st.initialized.done():
            raise RuntimeError(f"proc mesh {st.name} is still starting: wait for `initialized` before taking "
                               "its reference (addresses are known only then)")
        if st.initialized.exception() is not None:
            raise RuntimeError(f"proc mesh {st.name} failed to start; it has no reference to adopt")
        rt = get_runtime()
        return {
            "kind": "proc_mesh", "version": REFERENCE_VERSION, "mesh_id": st.mesh_id, "name": st.name,
            "labels": list(st.extent.labels), "sizes": list(st.extent.sizes), "rank_procs": list(st.proc_ids),
            "infos": {pid: rt.directory.get(pid) for pid in st.proc_ids}, "job": rt.info["job"],
            "os_pids": reference_os_pids(rt, st.proc_ids), "machine": rt.info["machine"],
        }

    def __reduce__(self):
        st = self._state
        rt = get_runtime()
        infos = {pid: rt.directory.get(pid) for pid in st.proc_ids}
        return (_rebuild_proc_mesh, (st.mesh_id, st.name, st.extent.labels, st.extent.sizes, st.proc_ids, infos,
                                     self._shape, st.host if st.host is not None else None, rt.info))

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"<ProcMesh {self._state.name} {self._shape.extent}>"


def _mark_stopping(rt: Runtime, state: ProcMeshState) -> None:
    """(loop thread) The procs of `state` end on purpose: their exits, and their actor meshes', are no failure."""
    state.stopping = True
    procs = set(state.proc_ids)
    for ms in list(rt.supervision.mesh_states.values()):
        if ms.kind == "actor" and ms.stopped is None and procs.intersection(ms.rank_procs):
            ms.stopped = "actor mesh is stopped due to proc mesh shutdown"
    for pid in state.proc_ids:
        rt.supervision.graceful.add(pid)


def release_workers(addresses: list[str], timeout: float = 10.0) -> None:
    """The workers at `addresses` are about to be ended on purpose (a job's `kill()`): the procs this client
    spawned there, and the workers themselves, going away is a stop, not a failure for `unhandled_fault_hook`
    (which by default ends the client). No-op in a process whose runtime never started."""
    rt = runtime_if_started()
    if rt is None or not addresses:
        return
    dials = {dial_address(a) for a in addresses}

    def on_host(host: HostMesh | None) -> bool:
        return host is not None and any(isinstance(a, str) and dial_address(a) in dials
                                        for a in host._state.addresses)

    async def run() -> None:
        for pm in list(rt.owned_proc_meshes.values()):
            host = pm._state.host
            if on_host(host) and not pm._state.stopped:
                _mark_stopping(rt, pm._state)
                for pid in host._state.agent_pids.values():
                    rt.supervision.graceful.add(pid)

    if rt.on_loop_thread():
        raise RuntimeError("release_workers blocks: call it from outside the runtime's loop")
    rt.submit(run()).get(timeout=timeout)


def _rebuild_proc_mesh(mesh_id, name, labels, sizes, proc_ids, infos, shape, host, referrer=None) -> ProcMesh:
    from regent.actor._mesh import learn_addresses

    rt = get_runtime()
    learn_addresses(rt, infos, referrer, "ProcMesh")
    state = ProcMeshState(mesh_id, name, Extent(labels, sizes), list(proc_ids), "", host)
    state.owned = False
    state.initialized._set_result(True)
    if len(proc_ids) == 1 and proc_ids[0] == rt.proc_id:
        state.is_self = True
    return ProcMesh(state, shape)


def kill_proc(rt: Runtime, pid: str) -> None:
    agent = rt.remote_procs.get(pid)
    if agent is not None:
        rt.send(agent, HostKill([pid]))
    elif rt.spawner is not None and rt.spawner.is_child(pid):
        rt.spawner.kill(pid)
    elif pid in rt.adopted_os_pids:
        _kill_adopted(rt, pid)


def _kill_adopted(rt: Runtime, pid: str) -> None:
    """SIGKILL an adopted proc of this machine (its parent, the dead controller, cannot), and remove its socket
    directory as a parent would. Only if its OS pid still names the same process (same start time)."""
    os_pid, started, sock_dir = rt.adopted_os_pids[pid]
    if started is None or _start_time(os_pid) != started:
        return  # already gone, and the pid may belong to another process by now
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(os_pid, signal.SIGKILL)
    if sock_dir is not None:
        remove_sock_dir(sock_dir)


def _start_time(os_pid: int) -> int | None:
    """When process `os_pid` started (clock ticks since boot, /proc/PID/stat field 22), or None if it is gone:
    with the pid it names one process, never a later one that reuses the pid."""
    try:
        with open(f"/proc/{os_pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": the comm may hold spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _register_owned(rt: Runtime, owner_key: str, mesh: Any) -> None:
    if owner_key in (ROOT_KEY, CONTROLLERS_KEY):
        return
    cell = rt.actors.get(owner_key)
    if cell is not None:
        cell.owned.append(mesh)


def spawn_actor_mesh(pm: ProcMesh, name: str, cls: type, args: tuple, kwargs: dict, owner_key: str) -> ActorMesh:
    is_async = validate_actor_class(cls)
    check_constructor_args(cls, args, kwargs)
    rt = get_runtime()
    st = pm._state
    view_ranks = pm._shape.ranks()
    extent = pm._shape.extent
    rank_procs = [st.proc_ids[r] for r in view_ranks]
    mesh_id = new_id("am")
    mstate = MeshState(mesh_id, name, "actor", rank_procs, owner_key)
    for i in range(len(rank_procs)):
        mstate.display[i] = f"{cls.__module__}.{cls.__qualname__} {name}{Point(i, extent)}"
    ref = ActorMeshRef(mesh_id, name, cls, extent, rank_procs, (rt.proc_id, owner_key), mstate)
    ref.proc_mesh = pm
    actor_mesh_refs[(id(rt), mesh_id)] = ref
    body, buffers = dumps((cls, args, kwargs))
    init = Future._new()
    ref.initialized = init
    shape = Shape.from_extent(extent)
    targets = [(mesh_id, i, pid) for i, pid in enumerate(rank_procs)]
    gather = Gather(rt, Future._new(), shape, targets, f"{name}.__init__", False)

    def init_done(f: Future) -> None:
        try:
            f._outcome()
        except BaseException as exc:  # noqa: BLE001 - reported: the mesh's `initialized` future fails with it
            init._set_exception(exc)
            return
        init._set_result(None)

    gather.future.add_done_callback(init_done)
    mesh = ActorMesh(ref, shape)
    mstate.mesh = mesh

    def on_loop() -> None:
        rt.supervision.register_mesh(mstate)
        rt.supervision.track(gather)
        if len(rank_procs) > 1 and rt.cast_mode != "actor":
            # one message per host agent (see _tree), which spawns on its procs and gathers their replies
            items = [(i, i, i) for i in range(len(rank_procs))]
            relays = send_cast(rt, mesh_id, [SPAWN, name, [rt.proc_id, owner_key], is_async], rank_procs,
                               extent.labels, extent.sizes, items, body, buffers, (rt.proc_id, gather.port_id, "b"),
                               rt.cast_mode == "tree")
            if relays:
                gather.vias = relays
                for agent in relays:
                    rt.supervision.pending_by_proc[agent].add(gather.port_id)
            return
        for i, pid in enumerate(rank_procs):
            rt.send(pid, Spawn(f"{mesh_id}/{i}", mesh_id, i, name, (extent.labels, extent.sizes, i),
                               (rt.proc_id, owner_key), is_async, (rt.proc_id, gather.port_id, i)), body, buffers)

    rt.run_on_loop(on_loop)
    _register_owned(rt, owner_key, mesh)
    return mesh


# ============================================================================================ adoption
ADOPT_TIMEOUT_S = 10.0  # how long each proc has to answer `Adopt`


class AdoptError(RuntimeError):
    """`adopt_proc_mesh` could not take over every proc of the mesh. `refused`: proc id -> why (a live controller
    still owns it); `unreachable`: proc id -> why (gone, or no answer within ADOPT_TIMEOUT_S). `adopted`: the
    procs that did accept, which now name this process as their owner (stop or kill them if giving up)."""

    def __init__(self, message: str, refused: dict[str, str], unreachable: dict[str, str],
                 adopted: list[str]) -> None:
        super().__init__(message)
        self.refused = refused
        self.unreachable = unreachable
        self.adopted = adopted

    def __reduce__(self):
        return (AdoptError, (str(self), self.refused, self.unreachable, self.adopted))


_REFERENCE_KEYS = ("mesh_id", "name", "labels", "sizes", "rank_procs", "infos", "job")


def _check_reference(rt: Runtime, ref: Any, kind: str) -> None:
    """Refuse a reference that is not a `kind` one from `.reference()` (ValueError) or comes from another job
    (`ForeignJobError`), before anything is sent."""
    if not isinstance(ref, dict) or ref.get("kind") != kind:
        got = ref.get("kind") if isinstance(ref, dict) else type(ref).__name__
        raise ValueError(f"expected a {kind} reference (the dict `.reference()` returns), got {got!r}")
    if ref.get("version") != REFERENCE_VERSION:
        raise ValueError(f"{kind} reference version {ref.get('version')!r} is not {REFERENCE_VERSION}, the one "
                         "this Regent reads")
    missing = [key for key in _REFERENCE_KEYS if key not in ref]
    if missing:
        raise ValueError(f"{kind} reference {ref.get('name')!r} lacks {missing}")
    check_reference_job(rt, ref["job"], f"the {kind.replace('_', ' ')} reference {ref['name']!r}")
    if len(ref["rank_procs"]) != Extent(list(ref["labels"]), list(ref["sizes"])).nelements:
        raise ValueError(f"{kind} reference {ref['name']!r}: {len(ref['rank_procs'])} procs for sizes {ref['sizes']}")


def adopt_proc_mesh(ref: dict, *, force: bool = False, detach_grace: float | None = None) -> ProcMesh:
    """Take over the procs of `ref` (a `ProcMesh.reference()` written by a controller that died) as if this
    process had spawned them: their failures come here, `stop()` and this runtime's shutdown end them (killing
    those on this machine that do not exit in time), and actors can be spawned on them.

    Each proc is sent `Adopt` and must answer within ADOPT_TIMEOUT_S. A proc still connected to its owner
    refuses, so two live controllers never share it; `force=True` overrides that (the old controller is hung,
    e.g. SIGSTOPped). `detach_grace` replaces how long the procs may run on without a controller (None: keep
    theirs). Raises `ForeignJobError` for a reference of another job, and `AdoptError` naming every proc that
    refused or did not answer. Blocks: call it outside the runtime's loop (not in an async endpoint)."""
    rt = get_runtime()
    _check_reference(rt, ref, "proc_mesh")
    if detach_grace is not None and detach_grace < 0:
        raise ValueError(f"detach_grace must be >= 0 seconds, got {detach_grace!r}")
    if rt.on_loop_thread():
        raise RuntimeError("adopt_proc_mesh blocks until the procs answer: call it outside the runtime's loop")
    owner_key = context().actor_instance.key
    extent = Extent(list(ref["labels"]), list(ref["sizes"]))
    state = ProcMeshState(ref["mesh_id"], ref["name"], extent, list(ref["rank_procs"]), owner_key, None)
    state.initialized._set_result(True)
    mesh = ProcMesh(state, Shape.from_extent(extent))
    grace = None if detach_grace is None else float(detach_grace)
    rt.submit(_adopt(rt, mesh, ref["infos"], bool(force), grace)).get(timeout=ADOPT_TIMEOUT_S + 10)
    _register_owned(rt, owner_key, mesh)
    return mesh


async def _adopt(rt: Runtime, mesh: ProcMesh, infos: dict, force: bool, grace: float | None) -> None:
    """On the loop: send `Adopt` to every proc of `mesh`, then register it as owned here, or raise AdoptError."""
    state = mesh._state
    procs = list(dict.fromkeys(state.proc_ids))
    unreachable: dict[str, str] = {}
    waits: dict[str, asyncio.Future] = {}
    ports = []
    for pid in procs:
        info = infos.get(pid)
        if info is None and pid not in rt.directory:
            unreachable[pid] = "the reference has no address for it (it had not started)"
            continue
        if pid not in rt.directory:
            rt.learn(pid, info)
        fut = rt.loop.create_future()
        ports.append(rt.new_port(_OneShot(fut)))
        waits[pid] = fut
        rt.send(pid, Adopt(dict(rt.info), grace, force, (rt.proc_id, ports[-1], 0)))
    try:
        if waits:
            await asyncio.wait(list(waits.values()), timeout=ADOPT_TIMEOUT_S)
    finally:
        for port in ports:
            rt.drop_port(port)
    refused: dict[str, str] = {}
    answers: dict[str, dict] = {}
    for pid, fut in waits.items():
        if not fut.done():
            unreachable[pid] = f"no answer within {ADOPT_TIMEOUT_S:g} s"
            continue
        status, body, buffers = fut.result()
        value = loads(body, buffers)
        if status == OK:
            answers[pid] = value
        elif status == ERROR:
            refused[pid] = str(value[1])
        else:
            unreachable[pid] = str(value)
    if refused or unreachable:
        lines = [f"  {pid}: refused: {why}" for pid, why in refused.items()]
        lines += [f"  {pid}: unreachable: {why}" for pid, why in unreachable.items()]
        raise AdoptError(f"could not adopt proc mesh {state.name} ({len(answers)} of {len(procs)} procs "
                         "accepted):\n" + "\n".join(lines), refused, unreachable, list(answers))
    for pid, answer in answers.items():
        info = rt.directory.get(pid) or {}
        if info.get("machine") == rt.info["machine"]:
            unix = info.get("unix") or ""
            sock_dir = os.path.dirname(unix[len("unix://"):]) if unix.startswith("unix://") else None
            if sock_dir is not None and not os.path.basename(sock_dir).startswith("regent-"):
                sock_dir = None  # only a proc's own private directory is ever removed
            rt.adopted_os_pids[pid] = (answer["os_pid"], _start_time(answer["os_pid"]), sock_dir)
    rt.owned_proc_meshes[state.mesh_id] = mesh


def _import_class(path: str) -> type:
    """The class named `module:qualname` (how a reference names an actor class)."""
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"actor class {path} cannot be imported in this process ({exc}); the controller "
                          "that attaches must be able to import the module that defines it") from exc
    if not isinstance(obj, type):
        raise TypeError(f"{path} is not a class")
    return obj


def attach_actor_mesh(ref: dict, proc_mesh: ProcMesh | None = None) -> ActorMesh:
    """A handle on the actor mesh of `ref` (an `ActorMesh.reference()`) that this process owns, as if it had
    spawned it: the failure of one of its ranks reaches the caller's `__supervise__` (on the client,
    `unhandled_fault_hook`) as a `MeshFailure` whose `.mesh` is the returned handle. Adopt its procs first
    (`adopt_proc_mesh`, passed as `proc_mesh`), so that they report to this process. The actor class must be
    importable here. Raises `ForeignJobError` for a reference of another job."""
    rt = get_runtime()
    _check_reference(rt, ref, "actor_mesh")
    cls = _import_class(ref["cls"])
    rank_procs = list(ref["rank_procs"])
    if proc_mesh is not None:
        foreign = set(rank_procs) - set(proc_mesh._state.proc_ids)
        if foreign:
            raise ValueError(f"actor mesh {ref['name']} runs on procs {sorted(foreign)} that are not in "
                             f"proc mesh {proc_mesh._state.name}")
    from regent.actor._mesh import learn_addresses

    learn_addresses(rt, ref["infos"], None, "ActorMesh")
    owner_key = context().actor_instance.key
    extent = Extent(list(ref["labels"]), list(ref["sizes"]))
    mesh_id, name = ref["mesh_id"], ref["name"]
    display = {i: f"{cls.__module__}.{cls.__qualname__} {name}{Point(i, extent)}" for i in range(len(rank_procs))}
    # another handle of this mesh here (an unpickled reference) shares its state: it becomes owned too
    mstate = _register_state(rt, MeshState(mesh_id, name, "actor", rank_procs, owner_key))
    aref = ActorMeshRef(mesh_id, name, cls, extent, rank_procs, (rt.proc_id, owner_key), mstate)
    aref.proc_mesh = proc_mesh
    mesh = ActorMesh(aref, Shape.from_extent(extent))

    def own() -> None:
        mstate.owner_key = owner_key
        mstate.mesh = mesh
        mstate.display.update(display)
        rt.supervision.set_controller(mstate, None)  # supervised here from now on

    rt.run_on_loop(own)
    actor_mesh_refs[(id(rt), mesh_id)] = aref
    _register_owned(rt, owner_key, mesh)
    return mesh


# ============================================================================================ this process
_local_host: dict[int, HostMesh] = {}


def local_host_mesh() -> HostMesh:
    rt = get_runtime()
    host = _local_host.get(id(rt))
    if host is None:
        host = HostMesh(HostMeshState("local", [], "local"), Shape.from_extent(Extent([], [])))
        _local_host[id(rt)] = host
    return host


def self_proc_mesh(rt: Runtime, rank: Any = None) -> ProcMesh:
    extent = Extent([], [])
    state = ProcMeshState("self-" + rt.proc_id, "this_proc", extent, [rt.proc_id], ROOT_KEY, None)
    state.is_self = True
    state.owned = False
    state.initialized._set_result(True)
    return ProcMesh(state, Shape(extent.labels, Slice(0, [], [])))


def ensure_proc_context() -> Instance:
    rt = get_runtime()
    if rt.proc_context is None:
        proc = self_proc_mesh(rt)
        rt.proc_context = Instance(ROOT_KEY, "<root>", "RootClientActor", Point(0, Extent([], [])), proc)
        rt.self_proc = proc
    return rt.proc_context


def this_proc() -> ProcMesh:
    """The proc the current actor runs on (on the client: the client process itself)."""
    return context().actor_instance.proc


def this_host() -> HostMesh:
    """The host of the current proc, as a 0-dimensional HostMesh (spawns children of this process). In a proc
    spawned from `with_python_executable(python)`, it spawns under that interpreter too, as the host mesh the
    proc came from does (Monarch keeps the bootstrap command on the host mesh a proc gets as `this_host()`)."""
    host = local_host_mesh()
    python = get_runtime().host_python
    return host if python is None else host.with_python_executable(python)


def attach_to_workers(workers: list[str | Future] | None = None, name: str | None = None,
                      ca: str = "trust_all_connections", secret: bytes | None = None, *,
                      private_key: object = None) -> HostMesh:
    """A HostMesh `{"hosts": N}` served by `regent worker` / `run_worker_loop_forever` processes. Returns at
    once; `initialized` says when every host answered.

    A worker is an address string or a `Future[str]` resolving to one (awaited before it is dialled, so a mesh
    can be made before the workers are known). Monarch's forms are accepted: `tcp://HOST:PORT`,
    `DIAL@BIND` (the worker's alias form, `tcp://fqdn:p@tcp://0.0.0.0:p`: this dials the first) and
    `<proc-id>@URL`. The workers must share this controller's job secret (REGENT_JOB_SECRET / --secret-file).
    """
    if private_key is not None or ca != "trust_all_connections":
        raise NotImplementedError("TLS security plumbing: only ca='trust_all_connections' (and no private_key) "
                                  "is supported; connections are authenticated with the job secret")
    if workers is None:
        raise TypeError("attach_to_workers needs workers=[address or Future[str], ...]")
    addresses: list[str | Future] = []
    for w in workers:
        if isinstance(w, Future):
            addresses.append(w)
        else:
            w = str(w)
            dial_address(w)  # a malformed address fails here, not later on the loop
            addresses.append(w)
    rt = get_runtime()
    if secret is not None and secret != rt.secret:
        raise ValueError("attach_to_workers(secret=...) differs from this runtime's secret; "
                         "set REGENT_JOB_SECRET before the runtime starts instead")
    state = HostMeshState("remote", addresses, name or "hosts")
    return HostMesh(state, Shape.from_extent(Extent(["hosts"], [len(addresses)])))


# ============================================================================================ controllers
def get_or_spawn_controller(name: str, Class: type, *args: Any, **kwargs: Any) -> Future:
    """A named singleton actor living in the client process, spawned on first request."""
    rt = get_runtime()
    if rt.is_controller:
        return rt.submit(_controller_local(rt, name, Class, args, kwargs))
    root = rt.root_info
    if root is None:
        raise RuntimeError("this process does not know its controller; get_or_spawn_controller needs one")
    body, buffers = dumps((Class, args, kwargs))
    fut = Future._new()

    class _Reply:
        def deliver(self, index: int, status: int, b: Any, bufs: list) -> None:
            rt.drop_port(port)
            value = loads(b, bufs)
            if status == OK:
                fut._set_result(value)
            elif status == ERROR:
                fut._set_exception(value[0])
            else:
                fut._set_exception(RuntimeError(str(value)))

    port = rt.new_port(_Reply())

    def on_loop() -> None:
        rt.directory.setdefault(root["id"], root)
        rt.send(root["id"], GetOrSpawnController(name, (rt.proc_id, port, 0)), body, buffers)

    rt.run_on_loop(on_loop)
    return fut


async def _controller_local(rt: Runtime, name: str, cls: type, args: tuple, kwargs: dict) -> ActorMesh:
    failure = rt.supervision.controller_failures.get(name)
    if failure is not None:
        raise ValueError(f"Failure on {name}: {failure}")
    mesh = rt.controllers.get(name)
    if mesh is None:
        ensure_proc_context()
        mesh = spawn_actor_mesh(rt.self_proc, name, cls, args, kwargs, CONTROLLERS_KEY)
        rt.controllers[name] = mesh
    return mesh


def ensure_self_proc(rt: Runtime) -> ProcMesh:
    if rt.self_proc is None:
        rt.self_proc = self_proc_mesh(rt)
    return rt.self_proc
