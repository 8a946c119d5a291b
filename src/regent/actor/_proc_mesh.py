"""Proc meshes: `ProcMesh` (spawning actors on its procs, stopping them), adoption by a new controller
(`adopt_proc_mesh`, `attach_actor_mesh`), this process as a proc mesh (`this_proc()`), and
`get_or_spawn_controller`. The hosts that start procs are `_host_mesh`'s (see there who watches whom).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from regent.actor._actor import check_constructor_args, validate_actor_class
from regent.actor._config import config
from regent.actor._context import context, ensure_proc_context
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
    HostKill,
    LogLevel,
    Spawn,
    StopProc,
)
from regent.actor._pickle import dumps, loads
from regent.actor._proc_logs import LOG_SYNC_TIMEOUT, LogRouter
from regent.actor._process import ActorRuntime, get_runtime
from regent.actor._runtime import (
    ERROR,
    OK,
    OneShot,
    check_reference_job,
    learn_addresses,
    new_id,
    remove_sock_dir,
)
from regent.actor._shape import Extent, MeshTrait, Point, Shape, Slice
from regent.actor._spawner import LOG_TO_HOST, LOG_TO_OWNER
from regent.actor._supervision import CONTROLLERS_KEY, ROOT_KEY, MeshState
from regent.actor._tree import SPAWN, send_cast

if TYPE_CHECKING:  # type only: host meshes build on proc meshes
    from regent.actor._host_mesh import HostMesh

logger = logging.getLogger("regent.actor")


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
        self.lost: dict[int, str] = {}  # rank -> why: procs `adopt_proc_mesh(lost_ok=True)` found gone


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
    def lost_ranks(self) -> dict[int, str]:
        """The ranks (of the whole mesh) whose procs were already gone when `adopt_proc_mesh(..., lost_ok=True)`
        took it over, each with why (Regent extension); empty for a mesh spawned here. Their actors' calls raise
        SupervisionError; no failure is delivered for them (the adopter was told here)."""
        state = self._state.base or self._state
        return dict(state.lost)

    @property
    def host_mesh(self) -> HostMesh:
        if self._state.host is None:
            return get_runtime().parts.local_host()  # `_host_mesh.local_host_mesh`
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

        `stream_to_client`: forward their stdout/stderr here (prefixed with the proc), or not: then procs on a
        worker print it on the worker's stdout/stderr, and procs of `this_host()` print nothing.
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
            # the token's end tells a worker where the procs' lines after the mark go (`log_destination_after`)
            token = new_id("logsync") + (LOG_TO_OWNER if stream_to_client else LOG_TO_HOST)
            synced = state.logs.expect(token, {(pid, s) for pid in state.proc_ids for s in ("stdout", "stderr")})
            waits = []
            for pid in state.proc_ids:
                fut = rt.loop.create_future()
                waits.append((fut, rt.new_port(OneShot(fut))))
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


def _mark_stopping(rt: ActorRuntime, state: ProcMeshState) -> None:
    """(loop thread) The procs of `state` end on purpose: their exits, and their actor meshes', are no failure."""
    state.stopping = True
    procs = set(state.proc_ids)
    for ms in list(rt.supervision.mesh_states.values()):
        if ms.kind == "actor" and ms.stopped is None and procs.intersection(ms.rank_procs):
            ms.stopped = "actor mesh is stopped due to proc mesh shutdown"
    for pid in state.proc_ids:
        rt.supervision.graceful.add(pid)


def _rebuild_proc_mesh(mesh_id, name, labels, sizes, proc_ids, infos, shape, host, referrer=None) -> ProcMesh:
    rt = get_runtime()
    learn_addresses(rt, infos, referrer, "ProcMesh")
    state = ProcMeshState(mesh_id, name, Extent(labels, sizes), list(proc_ids), "", host)
    state.owned = False
    state.initialized._set_result(True)
    if len(proc_ids) == 1 and proc_ids[0] == rt.proc_id:
        state.is_self = True
    return ProcMesh(state, shape)


def kill_proc(rt: ActorRuntime, pid: str) -> None:
    agent = rt.remote_procs.get(pid)
    if agent is not None:
        rt.send(agent, HostKill([pid]))
    elif rt.spawner is not None and rt.spawner.is_child(pid):
        rt.spawner.kill(pid)
    elif pid in rt.adopted_os_pids:
        _kill_adopted(rt, pid)


def _kill_adopted(rt: ActorRuntime, pid: str) -> None:
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


def _register_owned(rt: ActorRuntime, owner_key: str, mesh: Any) -> None:
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


def _check_reference(rt: ActorRuntime, ref: Any, kind: str) -> None:
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


def adopt_proc_mesh(ref: dict, *, force: bool = False, detach_grace: float | None = None,
                    lost_ok: bool = False) -> ProcMesh:
    """Take over the procs of `ref` (a `ProcMesh.reference()` written by a controller that died) as if this
    process had spawned them: their failures come here, `stop()` and this runtime's shutdown end them (killing
    those on this machine that do not exit in time), and actors can be spawned on them.

    Each proc is sent `Adopt` and must answer within ADOPT_TIMEOUT_S. A proc still connected to its owner
    refuses, so two live controllers never share it; `force=True` overrides that (the old controller is hung,
    e.g. SIGSTOPped). `detach_grace` replaces how long the procs may run on without a controller (None: keep
    theirs). Raises `ForeignJobError` for a reference of another job, and `AdoptError` naming every proc that
    refused or did not answer.

    `lost_ok=True` (Regent extension): a proc that is gone (unreachable, or no answer in time) does not fail the
    adoption of the others; it counts as a proc that died before the adoption, its ranks are in
    `mesh.lost_ranks`, and no failure is delivered for it (a caller that replaces it knows already). A proc
    that refused, or none answering at all, still raises AdoptError. A proc that did not answer may still be
    running (hung): end it, if it may not run on beside its replacement. Blocks: call it outside the runtime's
    loop (not in an async endpoint)."""
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
    rt.submit(_adopt(rt, mesh, ref["infos"], bool(force), grace, bool(lost_ok))).get(timeout=ADOPT_TIMEOUT_S + 10)
    _register_owned(rt, owner_key, mesh)
    return mesh


async def _adopt(rt: ActorRuntime, mesh: ProcMesh, infos: dict, force: bool, grace: float | None,
                 lost_ok: bool = False) -> None:
    """On the loop: send `Adopt` to every proc of `mesh`, then register it as owned here, or raise AdoptError
    (with `lost_ok`, only for a refusal or when no proc answered)."""
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
        ports.append(rt.new_port(OneShot(fut)))
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
    if lost_ok and unreachable and answers and not refused:
        for pid, why in unreachable.items():
            # dead before this process owned the mesh: nothing is dispatched for it (the mesh is not owned yet),
            # the calls of actors on it fail at once
            rt.supervision.proc_gone(pid, f"gone before the adoption: {why}")
            for rank, rank_pid in enumerate(state.proc_ids):
                if rank_pid == pid:
                    state.lost[rank] = why
        unreachable = {}
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
def self_proc_mesh(rt: ActorRuntime, rank: Any = None) -> ProcMesh:
    extent = Extent([], [])
    state = ProcMeshState("self-" + rt.proc_id, "this_proc", extent, [rt.proc_id], ROOT_KEY, None)
    state.is_self = True
    state.owned = False
    state.initialized._set_result(True)
    return ProcMesh(state, Shape(extent.labels, Slice(0, [], [])))


def this_proc() -> ProcMesh:
    """The proc the current actor runs on (on the client: the client process itself)."""
    return context().actor_instance.proc


# ============================================================================================ controllers
def get_or_spawn_controller(name: str, Class: type, *args: Any, **kwargs: Any) -> Future:
    """A named singleton actor living in the client process, spawned on first request."""
    rt = get_runtime()
    if rt.is_controller:
        return rt.submit(controller_local(rt, name, Class, args, kwargs))
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


async def controller_local(rt: ActorRuntime, name: str, cls: type, args: tuple, kwargs: dict) -> ActorMesh:
    """The `get_or_spawn_controller` singleton `name` of this (client) process, spawned on first request
    (`ProcessParts.spawn_controller`)."""
    failure = rt.supervision.controller_failures.get(name)
    if failure is not None:
        raise ValueError(f"Failure on {name}: {failure}")
    mesh = rt.controllers.get(name)
    if mesh is None:
        ensure_proc_context()
        mesh = spawn_actor_mesh(rt.self_proc, name, cls, args, kwargs, CONTROLLERS_KEY)
        rt.controllers[name] = mesh
    return mesh
