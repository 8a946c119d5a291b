"""Supervision bookkeeping of one process: which meshes exist here and who owns them, which processes are gone,
which calls wait on which processes, and how failures reach their owners.

It is per process and lives on the runtime's event loop (`ActorRuntime.supervision`); the runtime's routing tells it
when a process is gone (`proc_gone`, or `proc_exited` for exits to gather), and it tells the routing to forget
that process (`Runtime.forget_proc`). Procs lost together (a host losing them all) are aggregated on the wire
(one exit event per host, one report per mesh in `rt.stats["supervision_reports"]`), but what the API delivers
follows Monarch: one `MeshFailure` per failed rank, to `__supervise__` or `unhandled_fault_hook`, so a Monarch
program counting failures per rank sees the same with one host or many.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from regent import settings
from regent.actor._errors import MeshFailure, SupervisionError, ranks_text
from regent.actor._shape import Point

if TYPE_CHECKING:  # type only: the process layer builds on this module
    from regent.actor._process import ActorRuntime

logger = logging.getLogger("regent.actor")
_fault_exit_lock = threading.Lock()

ROOT_KEY = "<root>"
CONTROLLERS_KEY = "<controllers>"
GRACEFUL_TEXT = "actor mesh is stopped due to proc mesh shutdown"  # why the ranks of a stopped proc are gone


class MeshState:
    """What this process knows about one actor or proc mesh: failed ranks, stop status, ownership."""

    __slots__ = ("mesh_id", "name", "kind", "failed", "stopped", "owner_key", "rank_procs", "dispatched",
                 "display", "mesh", "controller", "controller_lost")

    def __init__(self, mesh_id: str, name: str, kind: str, rank_procs: list[str], owner_key: str | None,
                 controller: tuple[str, str] | None = None) -> None:
        self.mesh_id = mesh_id
        self.name = name
        self.kind = kind
        self.rank_procs = rank_procs
        self.owner_key = owner_key
        self.failed: dict[int, str] = {}
        self.stopped: str | None = None
        self.dispatched: set[int] = set()
        self.display: dict[int, str] = {}
        self.mesh: Any = None  # the mesh object, in the owner's process
        # a reference to a mesh owned by an actor of another process: that owner `(proc_id, actor key)`, whose
        # process's loss leaves the mesh without its controller (`controller_lost` then says so)
        self.controller = controller
        self.controller_lost: str | None = None

    def problem(self, ranks: list[int]) -> str | None:
        """Why a message to these ranks cannot succeed, or None."""
        if self.stopped is not None:
            return self.stopped
        if self.controller_lost is not None:
            return self.controller_lost
        if self.failed:
            bad = [r for r in ranks if r in self.failed]
            if bad:
                event = death_text(self.display.get(bad[0], f"{self.name}[{bad[0]}]"), self.failed[bad[0]])
                return f'failure on mesh "{self.name}" at {ranks_text(bad)} with event: {event}'
        return None


def controller_lost_text(name: str, controller: tuple[str, str], reason: str) -> str:
    """Monarch's wording for a reference whose mesh lost its owner (its "controller"), which programs match on:
    "timed out reaching controller <owner> for mesh <name>. Assuming controller's proc is dead". Monarch says
    so after `supervision_watchdog_timeout` of silence; Regent as soon as the owner's process is known gone,
    and adds why."""
    owner = f"{controller[1]}@{controller[0]}"
    return (f'failure on mesh "{name}" with event: Supervision event: actor {owner} failed: timed out reaching '
            f"controller {owner} for mesh {name}. Assuming controller's proc is dead ({reason})")


def death_text(who: str, reason: str) -> str:
    """Monarch's wording for a dead rank, which programs match on: "The actor <who> and all its descendants
    have failed: <reason>" (a reason that already says it, or a stop, is kept as it is)."""
    if reason.startswith(("actor mesh is stopped", "The actor ")):
        return reason
    if not reason.startswith(("Supervision event", "the process")):
        reason = f"the process this actor was running on failed: {reason}"
    return f"The actor {who} and all its descendants have failed: {reason}"


class PendingReply:
    """Something waiting for replies from specific processes/ranks; failed if they die."""

    port_id: int
    targets: list[tuple[str, int, str]]  # (mesh_id, rank, proc_id)
    vias: tuple[str, ...] | list[str] = ()  # host agents relaying the call (`_tree`): their loss fails it

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:  # pragma: no cover
        raise NotImplementedError

    def fail_rank(self, index: int, error: BaseException) -> None:  # pragma: no cover
        raise NotImplementedError


class Supervision:
    """The supervision state of one process (see the module docstring); the routing's `faults`."""

    def __init__(self, rt: ActorRuntime, fault_hook: Callable[[MeshFailure], None] | None = None) -> None:
        self.rt = rt
        # the client's hook for a failure no owner handled (`regent.actor.unhandled_fault_hook`, looked up at
        # each call by the caller that gives it); None: such failures are only logged
        self.fault_hook = fault_hook
        self.mesh_states: dict[str, MeshState] = {}
        self.ranks_on_proc: dict[str, set[tuple[str, int]]] = collections.defaultdict(set)
        self.pending_by_proc: dict[str, set[int]] = collections.defaultdict(set)
        self.dead: dict[str, str] = {}  # proc id -> why it is gone
        self.graceful: set[str] = set()  # procs stopping on purpose: their exit is no failure
        self.exit_futures: dict[str, asyncio.Future] = {}
        self.controller_failures: dict[str, str] = {}  # get_or_spawn_controller singletons that failed
        # process exits reported within `exit_window_s` of each other make one supervision report per mesh
        # (still one MeshFailure per rank at the API)
        self.exit_window_s = settings.REGENT_EXIT_WINDOW.get()
        self._exits: list[tuple[str, str | None]] = []
        self._exits_timer: asyncio.TimerHandle | None = None
        self._exits_first = 0.0
        self._failure_sink: dict | None = None

    def track(self, pending: PendingReply) -> None:
        for _mesh_id, _rank, proc_id in pending.targets:
            self.pending_by_proc[proc_id].add(pending.port_id)
            if proc_id in self.dead:
                self.rt.loop.call_soon(self._fail_pending_for_proc, proc_id)
        for agent in pending.vias:
            self.pending_by_proc[agent].add(pending.port_id)
            if agent in self.dead:
                self.rt.loop.call_soon(self._fail_pending_for_proc, agent)

    def track_relays(self, pending: PendingReply, relays: list[str]) -> None:
        """The host agents relaying `pending`'s call (`_tree.send_cast`), known only once it is sent: the loss
        of one fails the replies it had not passed on."""
        pending.vias = relays
        for agent in relays:
            self.pending_by_proc[agent].add(pending.port_id)
            if agent in self.dead:
                self.rt.loop.call_soon(self._fail_pending_for_proc, agent)

    def untrack(self, pending: PendingReply) -> None:
        self.rt.drop_port(pending.port_id)
        for _mesh_id, _rank, proc_id in pending.targets:
            s = self.pending_by_proc.get(proc_id)
            if s is not None:
                s.discard(pending.port_id)
        for agent in pending.vias:
            s = self.pending_by_proc.get(agent)
            if s is not None:
                s.discard(pending.port_id)

    def _fail_pending_for_proc(self, proc_id: str) -> None:
        reason = self.dead.get(proc_id)
        if reason is None:
            return
        for port_id in list(self.pending_by_proc.pop(proc_id, ())):
            pending = self.rt.ports.get(port_id)
            if pending is None or not isinstance(pending, PendingReply):
                continue
            if proc_id in pending.vias:
                # the host agent relaying this call is gone: what it had not passed on never will be
                got = getattr(pending, "got", [])
                for idx, (_mesh_id, _rank, _pid) in enumerate(pending.targets):
                    if idx < len(got) and not got[idx]:
                        pending.fail_rank(idx, SupervisionError(
                            f"the host agent {proc_id} relaying this call failed: {reason}"))
                continue
            for idx, (mesh_id, rank, pid) in enumerate(pending.targets):
                if pid == proc_id:
                    state = self.mesh_states.get(mesh_id)
                    pending.fail_rank(idx, SupervisionError(self._death_text(state, rank, reason)))

    def _death_text(self, state: MeshState | None, rank: int, reason: str) -> str:
        who = state.display.get(rank, f"{state.name}[{rank}]") if state else f"rank {rank}"
        return death_text(who, reason)

    def fail_pending_for_mesh(self, mesh_id: str, rank: int, reason: str) -> None:
        state = self.mesh_states.get(mesh_id)
        for port_id in list(self.rt.ports):
            pending = self.rt.ports.get(port_id)
            if not isinstance(pending, PendingReply):
                continue
            for idx, (mid, r, _pid) in enumerate(pending.targets):
                if mid == mesh_id and r == rank:
                    pending.fail_rank(idx, SupervisionError(self._death_text(state, rank, reason)))

    def register_mesh(self, state: MeshState) -> MeshState:
        existing = self.mesh_states.get(state.mesh_id)
        if existing is not None:
            return existing
        self.mesh_states[state.mesh_id] = state
        self._check_controller(state)
        if state.kind == "actor":
            for rank, proc_id in enumerate(state.rank_procs):
                self.ranks_on_proc[proc_id].add((state.mesh_id, rank))
                if proc_id in self.dead and rank not in state.failed:
                    state.failed[rank] = f"the process this actor was running on failed: {self.dead[proc_id]}"
        return state

    def _check_controller(self, state: MeshState) -> None:
        """A reference whose owner's process failed (not a graceful stop, after which the owner has stopped
        its meshes itself) can no longer be supervised: its calls fail with Monarch's "timed out reaching
        controller" (`controller_lost_text`)."""
        if state.controller is None or state.owner_key is not None or state.controller_lost is not None:
            return
        proc_id = state.controller[0]
        reason = self.dead.get(proc_id)
        if reason is not None and reason != GRACEFUL_TEXT:
            state.controller_lost = controller_lost_text(state.name, state.controller, reason)

    def set_controller(self, state: MeshState, controller: tuple[str, str] | None) -> None:
        """Loop thread: the mesh of `state` now has this owner (a reference from a new owner, or this process
        took it over): whether its previous one was lost no longer matters."""
        state.controller = controller
        state.controller_lost = None
        self._check_controller(state)

    def _stop_orphaned_actors(self, proc_id: str, reason: str) -> None:
        """Actors here that an actor of the failed process `proc_id` owned stop: a mesh does not outlive its
        owner, and nobody is left to stop them. Actors of a client (its root, its `get_or_spawn_controller`
        singletons) are not stopped here: a lost client is the orphan timeout or the detach grace."""
        for cell in list(self.rt.actors.running()):
            owner_proc, owner_key = cell.owner
            if owner_proc == proc_id and owner_key not in (ROOT_KEY, CONTROLLERS_KEY):
                cell.post(("stop", None, f"its owner {owner_key}@{owner_proc} failed: {reason}"))

    def exit_future(self, proc_id: str) -> asyncio.Future:
        """Resolves when `proc_id` is known to be gone."""
        fut = self.exit_futures.get(proc_id)
        if fut is None:
            fut = self.rt.loop.create_future()
            if proc_id in self.dead:
                fut.set_result(self.dead[proc_id])
            self.exit_futures[proc_id] = fut
        return fut

    def proc_gone(self, proc_id: str, reason: str | None) -> None:
        """A process exited or became unreachable. `reason=None` means a graceful stop."""
        if proc_id in self.dead:
            return
        graceful = reason is None or proc_id in self.graceful
        text = GRACEFUL_TEXT if graceful else reason
        self.dead[proc_id] = text
        fut = self.exit_futures.get(proc_id)
        if fut is not None and not fut.done():
            fut.set_result(text)
        self.rt.forget_proc(proc_id)
        if not graceful:  # before any waiting call fails: what its caller does next must see the loss
            for state in self.mesh_states.values():
                if state.controller is not None and state.controller[0] == proc_id:
                    self._check_controller(state)
            self._stop_orphaned_actors(proc_id, reason)
        self._fail_pending_for_proc(proc_id)
        owned_actor_mesh_on_proc = False
        for mesh_id, rank in sorted(self.ranks_on_proc.get(proc_id, ())):
            state = self.mesh_states.get(mesh_id)
            if state is None:
                continue
            if graceful:
                state.failed.setdefault(rank, text)
                continue
            if state.owner_key is not None:
                owned_actor_mesh_on_proc = True
            self.rank_failed(mesh_id, rank, f"the process this actor was running on failed: {reason}")
        if not graceful:
            for pm in list(self.rt.owned_proc_meshes.values()):
                pm_state = pm._state
                started = pm_state.initialized.done() and pm_state.initialized._state == 1
                # a proc that dies while its mesh is starting is reported through `initialized`
                if proc_id in pm_state.proc_ids and started and not pm_state.stopping \
                        and not owned_actor_mesh_on_proc:
                    rank = pm_state.proc_ids.index(proc_id)
                    if self._failure_sink is not None:
                        self._failure_sink.setdefault(("proc", pm_state.mesh_id), (pm, []))[1].append(
                            (rank, f"the process {proc_id} failed: {reason}", reason))
                        continue
                    self.dispatch_failure(
                        pm_state.owner_key,
                        MeshFailure(pm_state.name, [rank], f"the process {proc_id} failed: {reason}", mesh=pm,
                                    actor_name=f"{pm_state.name}{Point(rank, pm_state.extent)}"),
                    )

    def proc_exited(self, proc_id: str, reason: str | None) -> None:
        """A child process exited: report it with the other exits of the next `exit_window_s` seconds (a
        host losing all its procs at once): one supervision report per mesh, delivered per rank."""
        self._exits.append((proc_id, reason))
        now = self.rt.loop.time()
        if self._exits_timer is None:
            self._exits_first = now
        else:
            self._exits_timer.cancel()
        # wait for a quiet spell, but never more than 10 windows after the first exit
        delay = min(self.exit_window_s, max(0.0, self._exits_first + 10 * self.exit_window_s - now))
        self._exits_timer = self.rt.loop.call_later(delay, self._flush_exits)

    def _flush_exits(self) -> None:
        self._exits_timer = None
        exits, self._exits = self._exits, []
        if exits:
            self.procs_gone(exits)

    def procs_gone(self, gone: list[tuple[str, str | None]]) -> None:
        """Several processes exited together (one event on the wire): `proc_gone` for each, counted as one
        supervision report per mesh, then delivered as one `MeshFailure` per failed rank, in rank order
        (Monarch's API: its hook and `__supervise__` see a failure per rank, however the loss travelled)."""
        if self._failure_sink is not None:
            for proc_id, reason in gone:
                self.proc_gone(proc_id, reason)
            return
        self._failure_sink = sink = {}
        try:
            for proc_id, reason in gone:
                self.proc_gone(proc_id, reason)
        finally:
            self._failure_sink = None
        self.rt.stats["supervision_reports"] += len(sink)
        for (kind, _mesh_id), (holder, failed) in sink.items():
            failed.sort(key=lambda f: f[0])
            if kind == "actor":
                failures = [self._actor_mesh_failure(holder, rank, event) for rank, event, _ in failed]
                self.dispatch_failures(holder.owner_key, failures)
            else:
                pm_state = holder._state
                self.dispatch_failures(pm_state.owner_key, [
                    MeshFailure(pm_state.name, [rank], event, mesh=holder,
                                actor_name=f"{pm_state.name}{Point(rank, pm_state.extent)}")
                    for rank, event, _ in failed])

    def rank_failed(self, mesh_id: str, rank: int, event: str) -> None:
        """Rank `rank` of mesh `mesh_id` failed: poison it, fail waiting calls, tell the owner at once (a
        report gathered for a quiet spell reached `__supervise__` after the caller had moved on, and named
        several ranks where Monarch's owner sees one failure per rank)."""
        state = self.mesh_states.get(mesh_id)
        if state is None:
            return
        if rank not in state.failed:
            state.failed[rank] = event
        self.fail_pending_for_mesh(mesh_id, rank, event)
        if state.owner_key is None or state.stopped is not None or rank in state.dispatched:
            return
        state.dispatched.add(rank)
        if self._failure_sink is not None:
            self._failure_sink.setdefault(("actor", mesh_id), (state, []))[1].append((rank, event, event))
            return
        self.rt.stats["supervision_reports"] += 1
        self.dispatch_failure(state.owner_key, self._actor_mesh_failure(state, rank, event))

    @staticmethod
    def _actor_mesh_failure(state: Any, rank: int, event: str) -> MeshFailure:
        """The MeshFailure of one failed rank of an actor mesh."""
        failure = MeshFailure(state.name, [rank], event, mesh=state.mesh, actor_name=state.display.get(rank))
        failure._mesh_id = state.mesh_id
        return failure

    def failure_is_stale(self, failure: MeshFailure) -> bool:
        """True when the failed mesh was stopped since (its owner already dealt with it)."""
        state = self.mesh_states.get(failure._mesh_id) if failure._mesh_id else None
        return state is not None and state.stopped is not None

    def dispatch_failure(self, owner_key: str, failure: MeshFailure) -> None:
        """Deliver one failure to the owner of its mesh."""
        self.dispatch_failures(owner_key, [failure])

    def dispatch_failures(self, owner_key: str, failures: list[MeshFailure]) -> None:
        """Deliver failures (one per rank) to their owner in order: `__supervise__` once each, or, on the
        client, `unhandled_fault_hook` once each on one thread (not a thread per rank of a lost host)."""
        if not failures:
            return
        if owner_key == CONTROLLERS_KEY:
            # get_or_spawn_controller singletons: remember the failure, a later request reports it
            for failure in failures:
                self.controller_failures[failure.mesh_name] = failure.report()
                self.rt.controllers.pop(failure.mesh_name, None)
            return
        if owner_key == ROOT_KEY:
            if self.rt.is_controller and self.fault_hook is not None:
                threading.Thread(target=self._run_fault_hook, args=(failures,), daemon=True,
                                 name="regent-fault-hook").start()
            else:
                for failure in failures:
                    logger.error("unhandled failure in a mesh owned outside any actor: %s", failure.report())
            return
        cell = self.rt.actors.get(owner_key)
        for failure in failures:
            if cell is None or not cell.alive:
                logger.warning("owner %s of mesh %s is gone; dropping %s", owner_key, failure.mesh_name, failure)
                continue
            cell.supervise(failure)

    def _run_fault_hook(self, failures: list[MeshFailure]) -> None:
        """Fault-hook thread: the user's hook for each failure; one that raises makes the client exit (once:
        the ranks of one loss each raising in the default hook must not interrupt the exit again)."""
        hook = self.fault_hook
        assert hook is not None  # dispatch_failures starts this thread only with a hook
        for failure in failures:
            try:
                hook(failure)
            except BaseException as exc:  # noqa: BLE001 - any exception from the hook is "unhandled"
                try:
                    sys.stderr.write(f"Unhandled monarch-style fault: {failure.report()}\n({exc!r})\n")
                    sys.stderr.flush()
                except Exception:  # noqa: BLE001 - stderr itself is gone: nowhere left to report; the exit code below still says it
                    pass
                with _fault_exit_lock:
                    first = self.rt.exit_code is None  # not exiting yet
                    if first:
                        self.rt.exit_code = 1
                if first:
                    self.rt.exit_main_thread(1)
                return
