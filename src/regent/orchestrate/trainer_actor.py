"""TrainerActor: one trainer rank of one replica, driven by its ReplicaActor.

The training loop runs in a worker thread so the actor keeps answering `ping` (the liveness watchdog) and
`inject` (the fault injector) while a step is running. An exception in the loop is reported to the
ReplicaActor with its full traceback (`report_training_error`) and then re-raised, which fails this actor;
its owner, the ReplicaActor, sees the failure through supervision and restarts the replica in place.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

from regent.actor import Actor, Port, concurrent_endpoint, current_rank, endpoint
from regent.orchestrate.events import make_event

logger = logging.getLogger(__name__)


# What the FT layer reports (Manager, Backstop, DiLoCo) that goes to events.jsonl. Not forwarded: "error" (the
# step's failure is in its "commit" event, committed false, with the error). tests/e2e/orchestrate check that every
# kind the FT layer emits is one or the other, so that none is dropped silently.
FORWARDED_KINDS = frozenset({
    "quorum", "quorum_reused", "heal_started", "heal_done", "commit", "peer_abort", "group_failed", "state_lost", "early_heal_done",
    "recover_failed", "backstop_saved", "backstop_failed", "backstop_corrupt", "backstop_unvouched", "state_digest",
    "heal_digest", "witness_digest",
    "bitflip_applied", "round_joined", "round_abandoned"})
NOT_FORWARDED_KINDS = frozenset({"error"})


def lower_thread_priority(increment: int) -> int | None:
    """Make the calling thread `increment` nicer (Linux nice is per thread); returns the new nice, or None.

    Called by the training loop once the trainer is built and holds the committed state: threads it starts
    later (Gloo's) inherit the value, threads started before (the actor's event loop answering pings, the
    Manager's gRPC and state-serving threads) keep theirs. Raising one's own nice needs no privilege."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return None
    tid = threading.get_native_id()
    try:
        value = min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as exc:  # reported: only the restart's priority over steady-state steps is lost
        logger.warning("could not lower the training thread's priority by %d: %s", increment, exc)
        return None
    return value


class TrainerActor(Actor):
    def __init__(self, cfg: Any, replica_index: int, generation: int, lighthouse_addr: str, report: Port,
                 supervisor: Any, resume_from: str | None = None, stop_at: int | None = None) -> None:
        self.cfg = cfg
        self.replica_index = replica_index
        self.generation = generation
        self.lighthouse_addr = lighthouse_addr
        self.report = report
        self.supervisor = supervisor
        self.resume_from = resume_from
        self.rank = current_rank().rank
        self.world_size = cfg.procs_per_replica
        os.environ["RANK"] = str(self.rank)
        os.environ["LOCAL_RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        self._t_init = time.time()
        self.session: Any = None
        self.final: dict[str, Any] | None = None
        self._pending_stop: int | None = stop_at  # known at spawn for a restart after the run decided to stop
        self._progress_told = False

    # -- reporting -----------------------------------------------------------------------------------
    def _event(self, kind: str, details: dict) -> None:
        if not self._progress_told and self.rank == 0 and (
                (kind == "commit" and details.get("committed")) or kind in ("heal_done", "early_heal_done")):
            self._progress_told = True  # once per incarnation: not a crash loop (orchestrate/policy.py)
            self.supervisor.made_progress.broadcast(self.generation)
        if kind not in FORWARDED_KINDS:
            return
        if kind in ("commit", "quorum", "peer_abort", "state_lost", "early_heal_done", "recover_failed",
                    "backstop_saved", "backstop_unvouched", "round_joined", "round_abandoned") and self.rank != 0:
            return  # one line per replica, not per rank
        details = dict(details)
        # the Manager counts syncs ("manager_step"); events carry the trainer's step like metrics.jsonl
        details["manager_step"] = details.pop("step", details.get("manager_step"))
        quorum_id = details.pop("quorum_id", None)
        step = self.session.trainer.step if self.session is not None else None
        self.report.send(("event", make_event(kind, replica=self.replica_index, generation=self.generation,
                                              quorum_id=quorum_id, step=step, rank=self.rank, **details)))

    # -- the loop -------------------------------------------------------------------------------------
    @concurrent_endpoint
    async def train(self) -> None:
        await asyncio.to_thread(self._train_thread)

    def _train_thread(self) -> None:
        try:
            from regent.orchestrate.session import TrainingSession

            self.session = TrainingSession(
                self.cfg, replica_index=self.replica_index, rank=self.rank, world_size=self.world_size,
                generation=self.generation, lighthouse_addr=self.lighthouse_addr, on_event=self._event,
                resume_from=self.resume_from, on_ready=self._ready,
            )
            lower_thread_priority(getattr(self.cfg, "training_nice", 0))
            if self._pending_stop is not None:
                self.session.stop_at = self._pending_stop
            if self.cfg.steps is not None:
                self.session.stop_at = self.cfg.steps
            while not self.session.should_stop():
                record = self.session.step()
                if self.rank == 0:
                    self.report.send(("metric", record))
            # this rank's whole agreed state (regent.ft.digest); the replica combines its ranks' in rank order
            digest, parts = self.session.state_digest()
            self.final = {"step": self.session.trainer.step, "digest": digest,
                          "manager_step": self.session.manager.current_step(), "rank": self.rank,
                          "parts": parts}
            self.supervisor.training_finished.broadcast(self.generation, self.rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, then re-raised (the `finally`)
            tb = traceback.format_exc()
            try:
                self.supervisor.report_training_error.broadcast(self.generation, self.rank, repr(exc), tb)
                time.sleep(0.2)  # let the report leave before the actor fails
            finally:
                raise

    def _ready(self, session: Any) -> None:
        """The process is up, torch imported, model built: from here on it only waits for its quorum."""
        self.session = session
        if self._pending_stop is not None:  # before it recovers: a healer at the stop step joins no further round
            session.stop_at = self._pending_stop
        marks = getattr(session, "build_marks", None)
        if self.rank == 0 and marks:
            # where the build went (restart_done's "build" phase, split): "actor" from this actor's creation to
            # the session's start, then each part of the session, in seconds
            phases = {"actor": round(marks[0][1] - self._t_init, 3)}
            phases.update({name: round(t - marks[i][1], 3) for i, (name, t) in enumerate(marks[1:])})
            self.report.send(("event", make_event("trainer_built", replica=self.replica_index,
                                                  generation=self.generation, quorum_id=None, step=None,
                                                  rank=self.rank, phases=phases)))

    # -- control --------------------------------------------------------------------------------------
    @concurrent_endpoint
    async def ping(self) -> int:
        """This rank's step (-1 until its model is built). The liveness watchdog's probe: it must answer as soon
        as the event loop runs, so it is concurrent (never queued behind another endpoint) and only reads one
        attribute; its latency is what the adaptive hang rule learns from (orchestrate/hang.py)."""
        session = self.session
        return session.trainer.step if session is not None else -1

    @endpoint
    async def stop_at(self, step: int) -> None:
        self._pending_stop = step
        if self.session is not None:
            self.session.stop_at = step

    @endpoint
    async def final_state(self) -> dict[str, Any] | None:
        return self.final

    @endpoint
    async def digest_committed(self, step: int) -> None:
        """Digest this rank's committed state of `step` before its next step, if it still holds it: another
        replica copied it, and the controller checks the copy (`TrainingSession.answer_witness_requests`)."""
        if self.session is not None:
            self.session.witness_requests.add(step)

    @endpoint
    async def peer_failed(self, replica_prefix: str, group: str | None = None) -> bool:
        """Another replica died (or, with `group`, that build of its replicated group failed): fail a
        collective with it now rather than after the timeout."""
        if self.session is None:
            return False
        if group is None:
            return self.session.manager.peer_failed(replica_prefix)
        return self.session.manager.peer_failed(replica_prefix, "lost its replicated group", group=group)

    @endpoint
    async def inject(self, kind: str, seconds: float = 0.0) -> dict[str, Any] | None:
        """Carry out one fault on this process (the injector picked it).

        `straggler` only says where this process is (its pid and host): the ReplicaActor pauses and resumes it
        from outside, as a stuck host would. `straggler_self` (for a trainer on another host than its
        ReplicaActor) has a helper process pause this one for `seconds`."""
        logger.warning("replica %d rank %d: injecting %s", self.replica_index, self.rank, kind)
        if kind == "straggler":
            import socket

            return {"pid": os.getpid(), "host": socket.gethostname()}
        if kind == "straggler_self":
            import subprocess

            pid = os.getpid()
            # a separate process: this one cannot resume itself once stopped
            subprocess.Popen(["sh", "-c", f"sleep 0.1; kill -STOP {pid}; sleep {float(seconds)}; kill -CONT {pid}"],
                             start_new_session=True)
            return None
        if kind == "exception":
            if self.session is not None:
                self.session.inject_exception = True
        elif kind == "bitflip":
            if self.session is not None:  # applied by the training thread before its next step (bitflip_applied)
                self.session.inject_bitflip = True
        elif kind == "segfault":
            ctypes.string_at(0)
        elif kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "exit":
            os._exit(1)
        elif kind == "comm":
            if self.session is not None:
                # like NCCL on a communication error, fail our collectives in flight too (this process leaves
                # with os._exit: see ReplicatedGroup.abort)
                self.session.manager.pg.abort(RuntimeError("injected communication failure (group aborted)"),
                                              fail_pending=True)
        elif kind == "hang":
            threading.Thread(target=_hold_gil_forever, daemon=True).start()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        return None


def _hold_gil_forever() -> None:
    """A deadlock that holds the GIL: nothing else in this process runs again (detected by the watchdog)."""
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGSTOP)
