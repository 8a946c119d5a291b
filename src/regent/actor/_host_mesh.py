"""Hosts: `HostMesh` (the machines procs are started on: this one, or `regent worker`s), `this_host()`,
`attach_to_workers` and `release_workers`. Starting the processes is `_spawner`'s job; the proc meshes they make
are `_proc_mesh`'s; where their output goes, `_proc_logs`'s.

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
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from regent.actor._config import config
from regent.actor._context import context
from regent.actor._errors import ActorError, format_remote_traceback
from regent.actor._future import Future
from regent.actor._messages import (
    HostKeepWarm,
    HostShutdown,
    HostSpawn,
)
from regent.actor._pickle import dumps, loads
from regent.actor._proc_logs import HostEvents, LogRouter, _label
from regent.actor._proc_mesh import ProcMesh, ProcMeshState, _mark_stopping, _register_owned
from regent.actor._process import ActorRuntime, get_runtime, runtime_if_started
from regent.actor._runtime import (
    ERROR,
    OK,
    OneShot,
    new_id,
)
from regent.actor._shape import Extent, MeshTrait, Point, Shape
from regent.actor._spawner import (
    BootstrapCommand,
    check_proc_bind,
    default_bootstrap_cmd,
    spawner_of,
)
from regent.actor._transport import split_address

logger = logging.getLogger("regent.actor")


class HostMeshState:
    def __init__(self, kind: str, addresses: list[str], name: str) -> None:
        self.kind = kind  # "local" or "remote"
        self.addresses = addresses
        self.name = name
        self.agent_pids: dict[int, str] = {}
        self.shut_down = False
        self.owned = True
        self.initialized: Future | None = None
        self.stream_logs = True  # proc meshes spawned here start forwarding their output to the client (else a
        # worker prints it on its own stdout/stderr)


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
        (`ProcMesh.logging_option` changes it per proc mesh). False for meshes from `attach_to_workers` (as in
        Monarch: the output stays on the worker's stdout/stderr) unless it was given `stream_logs=True`; True for
        `this_host()`, whose procs' output reaches this client's terminal either way."""
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
                    "output_to_owner": self._state.stream_logs,  # else a worker prints it where the proc runs
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

    async def _spawn_all(self, rt: ActorRuntime, state: ProcMeshState, specs_by_host: list, bootstrap: bytes) -> None:
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

    async def _agent(self, rt: ActorRuntime, host_rank: int) -> str:
        pid = self._state.agent_pids.get(host_rank)
        if pid is not None and pid in rt.routes:
            return pid
        pid = await rt.connect_address(dial_address(await self._address(host_rank)))
        self._state.agent_pids[host_rank] = pid
        return pid

    async def _spawn_remote(self, rt: ActorRuntime, state: ProcMeshState, host_rank: int, specs: list[dict],
                            bootstrap: bytes) -> None:
        agent = await self._agent(rt, host_rank)
        events = HostEvents(rt, state.logs)
        fut = rt.loop.create_future()
        port = rt.new_port(OneShot(fut))
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


_local_host: dict[int, HostMesh] = {}


def local_host_mesh() -> HostMesh:
    rt = get_runtime()
    host = _local_host.get(id(rt))
    if host is None:
        host = HostMesh(HostMeshState("local", [], "local"), Shape.from_extent(Extent([], [])))
        _local_host[id(rt)] = host
    return host


def this_host() -> HostMesh:
    """The host of the current proc, as a 0-dimensional HostMesh (spawns children of this process). In a proc
    spawned from `with_python_executable(python)`, it spawns under that interpreter too, as the host mesh the
    proc came from does (Monarch keeps the bootstrap command on the host mesh a proc gets as `this_host()`)."""
    host = local_host_mesh()
    python = get_runtime().host_python
    return host if python is None else host.with_python_executable(python)


def attach_to_workers(workers: list[str | Future] | None = None, name: str | None = None,
                      ca: str = "trust_all_connections", secret: bytes | None = None, *,
                      private_key: object = None, stream_logs: bool = False) -> HostMesh:
    """A HostMesh `{"hosts": N}` served by `regent worker` / `run_worker_loop_forever` processes. Returns at
    once; `initialized` says when every host answered.

    A worker is an address string or a `Future[str]` resolving to one (awaited before it is dialled, so a mesh
    can be made before the workers are known). Monarch's forms are accepted: `tcp://HOST:PORT`,
    `DIAL@BIND` (the worker's alias form, `tcp://fqdn:p@tcp://0.0.0.0:p`: this dials the first) and
    `<proc-id>@URL`. The workers must share this controller's job secret (REGENT_JOB_SECRET / --secret-file).

    As in Monarch, the mesh's `stream_logs` is False: what its procs print stays on their worker's stdout/stderr
    (prefixed with the proc) until `ProcMesh.logging_option(stream_to_client=True)` brings it to this client.
    `stream_logs=True` (a Regent extension; Regent's cluster jobs pass it, as Monarch's remote allocator
    streams) forwards it from the start.
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
    state.stream_logs = bool(stream_logs)
    return HostMesh(state, Shape.from_extent(Extent(["hosts"], [len(addresses)])))
