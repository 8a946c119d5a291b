"""OrchestrationManager: the controller of the case study.

It starts a LighthouseActor and N ReplicaActors, runs the fault injector, writes the run directory, and stops
everything cleanly at the end or on Ctrl-C. Events and metrics flow back to it through one port.

What it does on its own, beyond starting and stopping:
- a replica's `failure_detected` is passed on at once to the other replicas (`_tell_peers`: abort collectives
  with it) and to the Lighthouse (`_forget_at_lighthouse`: do not wait for its heartbeats to time out);
- the Lighthouse process dying (the `lighthouse` fault, or a real crash) is not the end of the run: a new one
  is started on the same address (the port the first one got is kept) with the same state file, so quorum ids
  keep increasing, and the trainers' clients reconnect by themselves;
- a fatal `state_lost` (no live replica and no backstop holds the committed state) stops the run at once:
  `run_failed` with the reason, exit code 1;
- processes of this run still alive after everything was stopped are listed in summary.json (`leaked_pids`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from regent import settings
from regent.actor import ActorError, Channel, this_host
from regent.actor import config as actor_config
from regent.orchestrate.config import RunConfig, constant_batch_choice
from regent.orchestrate.events import BALLOT_KINDS, JsonlWriter, make_event, read_jsonl
from regent.orchestrate.faults import (
    PlannedFault,
    RandomFaultSchedule,
    ReplayFaultSchedule,
    failure_expected_within,
    fault_record,
)
from regent.orchestrate.live import LiveDisplay, RunView
from regent.orchestrate.policy import left_behind, supervisor_respawn
from regent.orchestrate.replica import as_awaitable
from regent.orchestrate.replica_set import ReplicaSet, adoption_plan
from regent.orchestrate.resume import (
    ATTACH_FILE,
    ControllerLease,
    ControllerLock,
    ResumePlan,
    controller_dir,
    last_rseqs,
    secret_source_env,
    write_json_atomic,
    write_secret,
)
from regent.orchestrate.summary import compute_summary, healthy_step_rate

logger = logging.getLogger(__name__)

# Set in the controller's environment before anything is spawned: every process of this run inherits it, which
# is how processes left behind are found at the end (`leaked_processes`).
RUN_MARKER_ENV = settings.REGENT_RUN_MARKER.name
# Exit codes of `regent train` (README "Exit codes"): a fatal `state_lost` or another reason the run could not go
# on; 2 is a configuration error (before launch); the run finished but its checker found a violation (an
# uncounted loss, replicas left out of or failing the final comparison, ...); 130 an interrupt.
EXIT_RUN_FAILED = 1
EXIT_CHECK_FAILED = 3
EXIT_REPLACED = 4  # another controller took the run over while this one was stopped


# After one replica reported its final state, how long the others may take to report theirs before a replica
# still without one is taken to have missed the last sync (a member of it only reports a digest later).
LEFT_BEHIND_GRACE_S = 15.0
# A standby ReplicaActor (`_keep_standby`) starts this long after training began, and the next one this long after
# the last was adopted: its warm processes' imports (seconds of CPU) would compete with the replicas' own start
# or restart. Short runs (tests, smoke runs) end before the first is needed.
STANDBY_FIRST_DELAY_S = 20.0
STANDBY_DELAY_S = 10.0
STANDBY_CALL_TIMEOUT_S = 30.0  # a standby answers `warm_standby` and `adopt` at once; longer means it is stuck


class OrchestrationManager:
    def __init__(self, cfg: RunConfig, resume: ResumePlan | None = None) -> None:
        self.cfg = cfg
        self.resume = resume  # `regent train --resume`: take over this run instead of starting one
        self.run_dir = Path(cfg.run_dir) if resume is None else resume.run_dir
        if resume is not None:
            _end_torn_lines(self.run_dir)
        elif (self.run_dir / "events.jsonl").exists():
            # A run directory holds one run: keep the previous one next to it rather than appending to it.
            kept = self.run_dir.with_name(f"{self.run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
            self.run_dir.rename(kept)
            print(f"[regent] {self.run_dir} held an earlier run; moved it to {kept}", flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = JsonlWriter(self.run_dir / "events.jsonl")
        self.metrics = JsonlWriter(self.run_dir / "metrics.jsonl")
        from regent.orchestrate.sinks import MetricSinks

        self.sinks = MetricSinks(self.run_dir, tensorboard=bool(getattr(cfg.train, "tensorboard", False)),
                                 wandb_project=cfg.wandb_project, config=dataclasses.asdict(cfg))
        self.faults_log = JsonlWriter(self.run_dir / "faults.jsonl")
        self.view = RunView(cfg.replicas)
        self.display = LiveDisplay(self.view, cfg.live)
        self.max_step = 0
        # the highest (manager step, lineage) a replica reported holding: a restarted Lighthouse starts from it
        self.committed_seen = (0, 0)
        self.t_start = time.time()
        self._replay_overrun_said = False
        # replica -> (injected at, seconds its failure report may take): a fault delivered whose failure has not
        # been reported yet. The run does not end in that gap (a replay's last fault, a pending full restart).
        self._failure_awaited: dict[int, tuple[float, float]] = {}
        self._failure_seen_at: dict[int, float] = {}  # replica -> when its last failure was reported
        self._undelivered_said: tuple[str, float] | None = None
        self.t_train: float | None = None  # the first step: the fault clock starts here, after start-up
        self.healthy_since: dict[int, float | None] = {r: None for r in range(cfg.replicas)}
        self.full_restart_pending = False
        self.stop_requested_at: int | None = None
        self.final_states: list[dict[str, Any]] = []
        self.finished_replicas: set[int] = set()
        from regent.orchestrate.vote import StateVotes

        self.votes = StateVotes(cfg.replicas)
        self.final_diverged: list[dict[str, Any]] = []  # final states left out by the last vote (_final_vote)
        self.violations: list[str] = []
        self._replicas: ReplicaSet | None = None
        self._tasks: set[asyncio.Task] = set()
        self._told_group_failed: set[tuple[int, str | None]] = set()
        self._lighthouse: Any = None
        self._replica_ids: dict[int, dict[str, int]] = {}  # replica -> {Lighthouse id seen: its generation}
        self._lh_procs: list[Any] = []  # every Lighthouse process mesh started (a killed one is stopped too)
        self._lh_actors: list[Any] = []  # ... and their actors: a failure of any of them is the Lighthouse's
        self._lh_killed: list[Any] = []  # Lighthouse actors killed on purpose (the `lighthouse` fault)
        self._lh_bind: str | None = None  # where a restarted Lighthouse binds: the first one's address
        self._lh_address: str | None = None
        self._lh_task: asyncio.Task | None = None  # a Lighthouse restart in progress
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Event | None = None
        self.failed_reason: str | None = None
        self.leaked_pids: list[int] = []
        self._lock = ControllerLock(self.run_dir)
        self._lease = ControllerLease(self.run_dir, on_replaced=_replaced)
        self._attach: dict[str, Any] = {}  # what a successor needs (controller/attach.json)
        self._last_event_at: dict[int, float] = {}  # replica -> monotonic time of its latest event
        self._generations_seen = 0  # the highest replica generation in the run's events (a resume goes past it)
        self._host: Any = None  # where ReplicaActors run (a respawned one too), and the port they report to
        self._report_port: Any = None
        self._rseq_held: dict[int, int] = {}  # replica -> the highest journal rseq written (drain drops repeats)
        self._respawns: dict[int, asyncio.Task] = {}  # replica -> its ReplicaActor's respawn in progress
        self._respawn_streak: dict[int, tuple[int, int]] = {}  # replica -> (deaths in a row, step at the last one)
        # the standby ReplicaActor (`_keep_standby`): (its proc mesh, its actor mesh) once warm, and every standby
        # started and not adopted, warm or still warming (the fault hook knows them all: a standby's death must
        # not reach the hook that ends the run; stopped at the end; an adopted one is stopped as a replica)
        self._standby: tuple[Any, Any] | None = None
        self._standby_task: asyncio.Task | None = None
        self._standbys: list[tuple[Any, Any]] = []
        self._standby_closed = False  # the run is stopping: no new standby
        # Lighthouse ids of replica incarnations whose state a vote found wrong or could not trust, and of those
        # that copied one of them: a heal from any of them is stopped too (`_distrust_copies`)
        self._distrusted: dict[str, str] = {}  # replica id -> why
        self._final_vote_begun = False  # heals from here on are the final vote's own (`_check_copy`)
        self._heal_log: list[tuple[int, int | None, str, str, int]] = []  # (healer, its generation, its id, donor id,
        #   committed step), in the order reported

    # -- event intake ---------------------------------------------------------------------------------
    def record_event(self, e: dict[str, Any]) -> None:
        if e["kind"] == "state_digest":  # one rank's ballot, not a line of events.jsonl: state_vote records the vote
            self._ballot(e)
            return
        if e["kind"] == "witness_digest":  # likewise: copy_checked records what the holders' digests showed
            if e.get("declined"):  # that holder moved past the step: its state of it is gone
                self.votes.decline_witness(int(e["manager_step"]), int(e["replica"]))
            else:
                self.votes.add_witness(int(e["manager_step"]), int(e["replica"]), int(e.get("rank") or 0),
                                       int(e.get("ranks") or 1), str(e["digest"]))
            return
        self.events.write(e)
        line = self.view.on_event(e)
        self.display.feed_line(line)
        r = e.get("replica")
        if r is not None:
            self._last_event_at[r] = time.monotonic()  # the end of a run: a replica still reporting is not stuck
        if r is not None and e.get("replica_id") and e.get("generation") is not None:
            self._replica_ids.setdefault(r, {})[e["replica_id"]] = e["generation"]
        if isinstance(e.get("generation"), int) and e["generation"] > self._generations_seen:
            self._generations_seen = e["generation"]  # a respawned ReplicaActor starts past every generation seen
        if e["kind"] in ("failure_detected", "gave_up", "restart_started") and r is not None:
            self.healthy_since[r] = None
            self._failure_awaited.pop(r, None)
            self._failure_seen_at[r] = time.time()
        if self._note_heal(e):
            self._distrust_copies(e)
            self._check_copy(e)
        if e["kind"] == "state_lost" and e.get("restored_step") is not None:
            self.votes.forget_after(int(e["restored_step"]))  # the steps above it are committed again, anew
        if e["kind"] == "state_lost" and e.get("fatal"):
            detail = e.get("reason") or "no live replica and no backstop holds the committed state"
            lost = e.get("lost_step", e.get("step"))
            self.fail_run(f"the committed state of step {lost} is lost (reported by replica {r}): {detail}")
        if e["kind"] == "failure_detected" and r is not None and self._lighthouse is not None:
            # Its processes are gone: the Lighthouse should not count them healthy until their heartbeats
            # time out (the survivors would wait that long for them before training on).
            self._spawn(self._forget_at_lighthouse(r, e.get("generation")))
        if e["kind"] == "failure_detected" and self.cfg.recovery == "restart":
            self.full_restart_pending = True
        elif e["kind"] == "failure_detected" and r is not None and self._replicas is not None:
            # The survivors may be inside a collective with the dead replica: have them abort it now.
            self._spawn(self._tell_peers(r))
        elif e["kind"] == "group_failed" and r is not None and self._replicas is not None:
            # No process died, but replica r's group is gone (say, a communication fault): its peers would
            # wait for it until their collective timed out. One notice per replica and build of the group
            # (each of its ranks reports).
            key = (r, e.get("group"))
            if key not in self._told_group_failed:
                self._told_group_failed.add(key)
                self._spawn(self._tell_peers(r, e.get("group")))

    # -- state votes (orchestrate/vote.py) ------------------------------------------------------------------
    def _note_heal(self, e: dict[str, Any]) -> bool:
        """What the state votes must know of a heal (live, or replayed from events.jsonl on resume): who copied
        whom at which committed step (a copy is no witness in the next vote, `vote.decide`) and the healer's
        digests of what it copied (a verified copy is one, `vote.StateVotes.verified`). True for a heal."""
        r = e.get("replica")
        if r is None or e.get("manager_step") is None:
            return False
        if e.get("kind") == "heal_digest":
            self.votes.note_heal_digest(r, e.get("generation"), int(e["manager_step"]), int(e.get("rank") or 0),
                                        int(e.get("ranks") or 1), str(e["digest"]))
            return False
        if e.get("kind") not in ("heal_done", "early_heal_done"):
            return False
        donor = donor_replica(e.get("donor"))
        if donor is not None:
            self.votes.note_heal(r, donor, int(e["manager_step"]), e.get("generation"))
        return True

    def _check_copy(self, e: dict[str, Any]) -> None:
        """An early heal in DiLoCo copied the committed state of a step with no vote: ask every other live
        replica for its digest of that step while it still holds it (until its next sync), so the copy can be
        checked (`vote.StateVotes.witnessed`) and be a witness in the next vote. Per-step mode's holders commit
        a newer step before they could answer, and a heal at a quorum (heal_done) was no early copy."""
        step, r = int(e["manager_step"]), int(e["replica"])
        every = self.cfg.ft.vote_interval()
        if (e["kind"] != "early_heal_done" or self.cfg.ft.mode != "diloco" or not every or step % every == 0
                or self._replicas is None or self._final_vote_begun):
            # a heal to a vote's step is checked against that vote (`StateVotes.verified`); one healed by the final
            # vote comes after every vote, and its finished peers take no further step to answer from
            return
        asked = {q for q, since in self.healthy_since.items() if since is not None and q != r}
        self.votes.open_check(r, e.get("generation"), step, asked)
        for q in sorted(asked):
            self._spawn(self._ask_witness(q, step))

    async def _ask_witness(self, replica: int, step: int) -> None:
        try:
            await self._replicas.slice(replicas=replica).digest_committed.call_one(step)
        except Exception as exc:  # noqa: BLE001 - reported; the copy check then goes without this holder
            logger.warning("asking replica %d for its digest of committed step %d: %r", replica, step, exc)

    def _ballot(self, e: dict[str, Any]) -> None:
        late = self.votes.add(int(e["manager_step"]), int(e["replica"]), int(e.get("rank") or 0),
                              int(e.get("ranks") or 1), str(e["digest"]), e.get("generation"), parts=e.get("parts"))
        if late is not None:
            self._act_on_verdict(late)

    def _decide_votes(self) -> None:
        live = {r for r, since in self.healthy_since.items() if since is not None}
        expected = {r for r, v in self.view.reps.items() if v.status not in ("gave up", "ended failed")}
        for verdict in self.votes.due(live, expected):
            self._act_on_verdict(verdict)
        for check in self.votes.checks_due():
            self.record_event(_event("copy_checked", **check))

    def _act_on_verdict(self, v: Any) -> None:
        from regent.orchestrate.vote import verdict_event

        self.record_event(_event("state_vote", **verdict_event(v)))
        self._vouch_backstop(v)
        if v.undecided:
            logger.warning("state vote at committed step %d: replicas %s disagree with no majority and not every "
                           "replica voted; left to the next vote", v.manager_step, v.voters)
        if not v.diverged:
            return
        why = (f"its state at committed step {v.manager_step} differs from the majority of replicas {v.voters}"
               if v.action == "heal" else
               f"replicas {v.voters} hold different states at committed step {v.manager_step} and no majority "
               "agrees: none can be trusted, the backstop is restored")
        self.record_event(_event("state_diverged", replicas=v.diverged, manager_step=v.manager_step,
                                 action=v.action, voters=v.voters, majority=(v.majority or "")[:16], reason=why,
                                 differs={str(r): parts for r, parts in v.differs.items()}))
        print(f"[regent] STATE DIVERGED: replica(s) {v.diverged}: {why}; stopping them", flush=True)
        what = f"replica(s) {v.diverged}'s state at committed step {v.manager_step} ({v.action})"
        for r in v.diverged:
            gen = v.generations.get(r)
            for rid, g in self._replica_ids.get(r, {}).items():
                if gen is not None and g == gen:
                    self._distrusted[rid] = what
        if self._replicas is not None:
            for r in v.diverged:
                self._spawn(self._stop_diverged(r, v.generations.get(r), why))
        # copies made since the previous vote, which did not vote themselves, carry what the vote found wrong too
        since = self.votes.previous(v.manager_step)
        for healer, gen, rid, donor, step in self._heal_log:
            if step > since and donor in self._distrusted and rid not in self._distrusted and healer not in v.voters:
                self._stop_copy(healer, gen, rid, donor)

    def _distrust_copies(self, e: dict[str, Any]) -> None:
        """A heal from a replica incarnation that a vote stopped (or is stopping) copied a state nobody can
        trust: stop the healer too, and distrust its copy in turn. Without this, a replica that was restarting
        when a tie was found healed from one of the tied replicas before they stopped, and the run went on from
        that copy instead of its backstop. A heal from anyone else replaces a distrusted state."""
        healer, donor = e.get("replica_id"), str(e.get("donor") or "")
        if healer is None or e.get("replica") is None:
            return
        self._heal_log.append((int(e["replica"]), e.get("generation"), healer, donor, int(e.get("manager_step") or -1)))
        if len(self._heal_log) > 4096:
            del self._heal_log[:2048]
        if donor in self._distrusted:
            self._stop_copy(int(e["replica"]), e.get("generation"), healer, donor)
        else:
            self._distrusted.pop(healer, None)

    def _stop_copy(self, replica: int, generation: int | None, rid: str, donor: str) -> None:
        """Replica incarnation `rid` healed from distrusted `donor`: distrust it in turn and stop it."""
        why = self._distrusted[donor]
        self._distrusted[rid] = f"a copy of {why}"
        reason = f"it healed from {donor.partition(':')[0]}, whose state a state vote stopped: {why}"
        print(f"[regent] replica {replica} copied a state a vote stopped; stopping it too ({reason})", flush=True)
        if self._replicas is not None:
            self._spawn(self._stop_diverged(replica, generation, reason))

    def _vouch_backstop(self, v: Any) -> None:
        """Tell the backstop which state a vote's majority held (`<run>/backstop/verdicts.json`): a restore takes
        the newest backstop whose recorded digest is a majority's (`Backstop.latest`). The writing replica may
        hold a flip its vote had not found yet; restoring that would bring the flip back past every vote (all
        replicas restore the same copy, so they agree on it)."""
        if v.late or not v.majority or v.action == "backstop" or self.run_dir is None:
            return
        from regent.ft.backstop import record_verdict

        try:
            record_verdict(os.path.join(self.run_dir, "backstop"), v.manager_step, v.majority)
        except OSError as err:  # reported; a restore then passes over this step's backstop (it cannot vouch)
            logger.warning("recording the vote at committed step %d for the backstop: %s", v.manager_step, err)

    async def _final_vote(self, replicas: Any, wait: float = 300.0) -> None:
        """The final states are a last vote: a flip after the last vote of the run leaves one replica different at
        the end. A strict majority keeps the committed state. Each replica that differs from it is healed: its
        trainers restart and pull the committed state from a finished peer (they serve it until `release`), and
        its final state is collected and compared again (`state_diverged` action "heal", `final` true). One that
        still differs, or cannot be healed, ends as failed (its `ended_failed` says why) and its state is
        left out. No majority is left to the checker (the run fails its final comparison)."""
        from regent.orchestrate.vote import decide

        self._final_vote_begun = True
        states = {s["replica"]: s for s in self.final_states if s and s.get("digest") and s.get("step") is not None}
        steps = {s["step"] for s in states.values()}
        if len(states) < 2 or len(steps) != 1:
            return
        manager_step = max(int(s.get("manager_step") or 0) for s in states.values())
        v = decide(manager_step, {r: s["digest"] for r, s in states.items()}, self.votes.copies(manager_step))
        if v.agreed or v.action != "heal":
            return
        why = f"its final state at committed step {manager_step} differs from the majority of replicas {v.voters}"
        self.record_event(_event("state_vote", manager_step=manager_step, voters=v.voters, agreed=False,
                                 diverged=v.diverged, majority=(v.majority or "")[:16], final=True))
        self.record_event(_event("state_diverged", replicas=v.diverged, manager_step=manager_step, action="heal",
                                 voters=v.voters, majority=(v.majority or "")[:16], reason=why, final=True))
        print(f"[regent] STATE DIVERGED at the end: replica(s) {v.diverged}: {why}; healing them from the "
              "majority", flush=True)
        ended = []
        for r in v.diverged:
            healed = None
            try:
                if await replicas.slice(replicas=r).heal_at_end.call_one(why):
                    healed = await asyncio.wait_for(as_awaitable(replicas.slice(replicas=r).finish.call_one(wait)),
                                                    timeout=wait + 60)
            except Exception as exc:  # noqa: BLE001 - reported; the replica then ends failed, left out below
                logger.warning("healing diverged replica %d at the end: %r", r, exc)
            if healed and healed.get("digest") == v.majority and healed.get("step") == next(iter(steps)):
                self.final_states = [healed if (s and s.get("replica") == r) else s for s in self.final_states]
                print(f"[regent] replica {r} healed at the end: its final state is the majority's", flush=True)
            else:
                ended.append(r)
        if not ended:
            return
        # one divergence, one `state_diverged` (the checker pairs each with a bitflip): the failed heal is told by
        # the replica's `ended_failed`
        why_end = f"{why}, and healing it at the end did not give the majority's state"
        print(f"[regent] replica(s) {ended} could not be healed at the end; they end as failed", flush=True)
        for r in ended:
            try:
                await replicas.slice(replicas=r).end_diverged.call_one(why_end)
            except Exception as exc:  # noqa: BLE001 - reported; it is left out of the comparison either way
                logger.warning("ending diverged replica %d: %r", r, exc)
        self.final_diverged = [s for s in self.final_states if s and s.get("replica") in ended]
        self.final_states = [s for s in self.final_states if not (s and s.get("replica") in ended)]

    async def _stop_diverged(self, replica: int, generation: int | None, why: str) -> None:
        try:
            if generation is None:
                return
            stopped = await self._replicas.slice(replicas=replica).stop_diverged.call_one(generation, why)
            if not stopped:
                logger.info("replica %d: diverged generation %s had already been replaced", replica, generation)
        except Exception as exc:  # noqa: BLE001 - reported; that replica is failing already, its supervisor restarts it
            logger.warning("stopping diverged replica %d: %r", replica, exc)

    def fail_run(self, reason: str) -> None:
        """The run cannot go on (its committed state is gone, or the Lighthouse cannot be restarted): say why,
        record `run_failed`, and make `run` stop everything at once and exit with EXIT_RUN_FAILED."""
        if self.failed_reason is not None:
            return
        self.failed_reason = reason
        print(f"[regent] RUN FAILED: {reason}", flush=True)
        self.record_event(_event("run_failed", reason=reason, step=self.max_step))
        if self._failed is not None:
            self._failed.set()

    def _spawn(self, coro: Any) -> None:
        self._tasks.add(task := asyncio.get_running_loop().create_task(coro))
        task.add_done_callback(self._tasks.discard)

    async def _forget_at_lighthouse(self, failed: int, generation: int | None) -> None:
        ids = sorted(rid for rid, gen in self._replica_ids.get(failed, {}).items()
                     if generation is None or gen <= generation)
        if not ids:
            return  # it never reached a quorum; a new incarnation retires its id itself at its first heartbeat
        try:
            await self._lighthouse.forget_replicas.call_one(ids)
        except Exception as exc:  # noqa: BLE001 - reported; the Lighthouse still times them out, slower, not wrong
            logger.warning("telling the Lighthouse that replica %d failed: %r", failed, exc)

    async def _tell_peers(self, failed: int, group: str | None = None) -> None:
        for q in range(self.cfg.replicas):
            if q != failed and self._replicas is not None and q in self._replicas:
                try:
                    await self._replicas.slice(replicas=q).peer_failed.call_one(failed, group)
                except Exception as exc:  # noqa: BLE001 - that replica may be failing too; its own supervisor reports it
                    logger.warning("telling replica %d about replica %d (group %s) failed: %r", q, failed, group, exc)

    def record_metric(self, m: dict[str, Any]) -> None:
        self.metrics.write(m)
        self.sinks.write(m)
        self.view.on_metric(m)
        r = m.get("replica")
        if r is not None and self.healthy_since.get(r) is None:
            self.healthy_since[r] = time.time()
        self.max_step = max(self.max_step, m.get("step", 0))
        self.committed_seen = highest_commit(self.committed_seen, m)
        if self.t_train is None:
            self.t_train = time.time()

    def _detach_options(self) -> dict[str, Any]:
        """The replicas and the Lighthouse train on without this controller for `--controller-grace`."""
        if not self.cfg.controller_grace:
            return {}
        return {"detach_grace": float(self.cfg.controller_grace),
                "detach_log_dir": str((self.run_dir / "controller").resolve())}

    async def drain(self, receiver: Any) -> None:
        while True:
            item = await receiver.recv()
            kind, payload = item[0], item[1]
            if len(item) > 2:  # through a replica's journal: its sequence number goes into the line (resume)
                r = payload.get("replica")
                if r is not None:
                    if item[2] <= self._rseq_held.get(r, 0):
                        # sent by a ReplicaActor that died before this arrived, and written already from its
                        # journal (`_respawn_replica`): once is the record
                        continue
                    self._rseq_held[r] = item[2]
                payload = {**payload, "rseq": item[2]}
            if kind == "event":
                self.record_event(payload)
            elif kind == "metric":
                self.record_metric(payload)

    # -- main -----------------------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.cfg
        self._loop = asyncio.get_running_loop()
        self._failed = asyncio.Event()
        resume = self.resume
        try:
            self._lock.acquire()
        except OSError:
            print(f"regent train: error: run {self.run_dir} is controlled by another process (its lock "
                  f"{self._lock.path} is held)", file=sys.stderr, flush=True)
            return 2
        self._lease.start()
        if resume is None:
            marker = os.environ[RUN_MARKER_ENV] = uuid.uuid4().hex
            (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
        else:
            marker = os.environ[RUN_MARKER_ENV] = resume.attach["marker"]
            os.environ.update(secret_source_env(resume))  # before the runtime starts: the run's own secret
            self._replay_history()
        port, receiver = Channel.open()
        drain = asyncio.get_running_loop().create_task(self.drain(receiver))
        if resume is None:
            self.record_event(make_event("run_started", replicas=cfg.replicas,
                                         procs_per_replica=cfg.procs_per_replica, mode=cfg.ft.mode,
                                         recovery=cfg.recovery, vote_every=cfg.ft.vote_interval()))
        import regent.actor as actor_api

        previous_hook = actor_api.unhandled_fault_hook
        actor_api.unhandled_fault_hook = self._fault_hook(previous_hook)
        host = this_host()
        self._host, self._report_port = host, port
        self._attach = self._attach_record(marker)
        code = 0
        try:
            if resume is None:
                replicas = await self._start_run(host, port)
                self.t_start = time.time()
            else:
                replicas = await self._resume_run(host, port)
            self._keep_standby(STANDBY_FIRST_DELAY_S)
            try:
                with self.display:
                    await self._unless_failed(self._supervise_run(replicas))
            except (KeyboardInterrupt, asyncio.CancelledError):
                print("[regent] interrupted: stopping every replica now", flush=True)
                code = 130
            if code == 0 and self.failed_reason is None:
                if self._lh_task is not None:
                    await asyncio.wait({self._lh_task}, timeout=120)  # the trainers need it to reach the stop step
                # stop at a common sync boundary and compare the replicas
                await self._unless_failed(self._finish(replicas))
        finally:
            if self.failed_reason is not None and code == 0:
                code = EXIT_RUN_FAILED
            drain.cancel()
            if self._lh_task is not None:
                self._lh_task.cancel()
            rep_meshes = self._replicas.proc_meshes() if self._replicas is not None else []
            self._standby_closed = True
            if self._standby_task is not None:
                self._standby_task.cancel()
            standby_procs = [procs for procs, _ in self._standbys]
            for mesh in [m for m in (*rep_meshes, *standby_procs, *self._lh_procs) if m is not None]:
                try:
                    await asyncio.wait_for(as_awaitable(mesh.stop()), timeout=30)
                except Exception as exc:  # noqa: BLE001 - reported; the other meshes are still stopped
                    logger.warning("stopping %s: %r", mesh, exc)
            self.leaked_pids = await asyncio.to_thread(leaked_processes, marker)
            if self.leaked_pids:
                print(f"[regent] processes of this run still alive after it stopped: {self.leaked_pids}", flush=True)
            actor_api.unhandled_fault_hook = previous_hook
            self.record_event(make_event("run_finished"))
            self.sinks.close()
            self.write_summary()
            self._lease.stop()
            self._lock.release()
        if code == 0 and self.violations:
            code = EXIT_CHECK_FAILED
        if code == EXIT_CHECK_FAILED:
            print(f"[regent] the run checker found {len(self.violations)} violation(s) (exit {code}); first: "
                  f"{self.violations[0]}", flush=True)
        elif code == EXIT_RUN_FAILED:
            print(f"[regent] the run failed (exit {code}): {self.failed_reason}", flush=True)
        return code

    async def _start_run(self, host: Any, port: Any) -> ReplicaSet:
        """A fresh run: the Lighthouse, then the replicas, each starting its first trainers."""
        cfg = self.cfg
        lc = cfg.lighthouse
        if lc.address:
            await self._start_lighthouse(None)  # only to have a `forget_replicas` to call; it serves nothing
            addr, dashboard = lc.address, ""
        else:
            info = await self._start_lighthouse(lc.bind)
            addr, dashboard = info["address"], info["dashboard"]
        self.view.dashboard = dashboard
        print(f"[regent] run directory {self.run_dir}", flush=True)
        print(f"[regent] Lighthouse {addr}  dashboard {dashboard}", flush=True)
        if not cfg.no_ft and cfg.replicas > 1:
            on, why = constant_batch_choice(cfg)
            print(f"[regent] constant global batch {'on' if on else 'off'}: {why}", flush=True)
        replicas = self._spawn_replicas(host, addr, port, first_generation=0)
        await self._introduce(replicas)
        try:
            await asyncio.gather(*[replicas.slice(replicas=r).start.call_one(replicas.slice(replicas=r))
                                   for r in range(cfg.replicas)])
        except ActorError as exc:
            from regent.jobs.base import JobError

            if not isinstance(exc.exception, JobError):
                raise
            # No host for a replica (PENDING past --job.allocation-timeout, sbatch refused, ...): the job
            # layer's message names the cause and the fix; nothing more to add from the traceback.
            self.fail_run(f"a replica could not get its first allocation from the {cfg.job} job layer: "
                          f"{exc.exception}")
        self._record_attach(address=addr, dashboard=dashboard)
        return replicas

    async def _introduce(self, replicas: ReplicaSet) -> None:
        """Give every replica all the others (a ReplicaSet pickles to its handles): while no controller is attached,
        a replica that fails tells its peers itself, so their collectives with it fail now rather than after the
        timeout."""
        await asyncio.gather(*[replicas.slice(replicas=r).know_peers.call_one(replicas)
                               for r in range(self.cfg.replicas) if r in replicas])

    def _spawn_replicas(self, host: Any, addr: str, port: Any, first_generation: int) -> ReplicaSet:
        from regent.orchestrate.replica import ReplicaActor

        rep_procs = host.spawn_procs(per_host={"replicas": self.cfg.replicas}, **self._detach_options())
        actors = rep_procs.spawn("replica", ReplicaActor, self.cfg, addr, port,
                                 str((self.run_dir / "journal").resolve()), first_generation)
        self._replicas = ReplicaSet.spawned(rep_procs, actors, self.cfg.replicas)
        return self._replicas

    # -- a successor's record, and taking over (orchestrate/resume.py) ------------------------------------
    def _attach_record(self, marker: str) -> dict[str, Any]:
        """What a successor needs that does not change: who controls, the job secret (its fingerprint and
        where it is), the run marker. A fresh run's secret is written to controller/secret (0600) unless it
        came from the environment, where a successor must find it too."""
        from regent.actor._process import get_runtime
        from regent.actor._runtime import machine_id
        from regent.auth import fingerprint

        rt = get_runtime()
        if self.resume is not None:
            secret = self.resume.attach.get("secret")
        elif settings.REGENT_JOB_SECRET.is_set() or settings.REGENT_JOB_SECRET_FILE.is_set():
            secret = "env"
        else:
            write_secret(self.run_dir, rt.secret)
            secret = "file"
        return {"version": 1, "marker": marker, "job": fingerprint(rt.secret), "secret": secret,
                "controller": {"pid": os.getpid(), "host": socket.gethostname(), "machine": machine_id(),
                               "started": time.time()},
                "previous": (self.resume.attach.get("controller") if self.resume is not None else None)}

    def _record_attach(self, **lighthouse: Any) -> None:
        """Rewrite controller/attach.json with where the Lighthouse and the replicas are now (after the start,
        a Lighthouse restart, a resume)."""
        lh = dict(self._attach.get("lighthouse") or {})
        lh.update({k: v for k, v in lighthouse.items() if v is not None})
        lh.update({"bind": self._lh_bind, "address": self._lh_address or lh.get("address")})
        if self._lh_procs and self._lighthouse is not None and self._lh_actors:
            try:
                lh["procs"] = self._lh_procs[-1].reference()
                lh["actor"] = self._lighthouse.reference()
            except Exception as exc:  # noqa: BLE001 - reported; a successor then starts a new Lighthouse
                logger.warning("recording the Lighthouse for a successor: %r", exc)
        self._attach["lighthouse"] = lh
        if self._replicas is not None and self._replicas.segments:
            self._attach["replicas"] = self._replicas.reference()
        write_json_atomic(controller_dir(self.run_dir) / ATTACH_FILE, self._attach)

    def _replay_history(self) -> None:
        """A resuming controller learns the run so far from its files, without acting on any of it: the view,
        the top step, the replicas' Lighthouse ids, the heals the votes must know, when training started."""
        events = sorted(read_jsonl(self.run_dir / "events.jsonl"), key=lambda e: e.get("time", 0))
        for e in events:
            self.view.on_event(e)
            r = e.get("replica")
            if e.get("kind") == "run_started":
                self.t_start = float(e["time"])
            if r is not None and e.get("replica_id") and e.get("generation") is not None:
                self._replica_ids.setdefault(r, {})[e["replica_id"]] = e["generation"]
            self._note_heal(e)
            if e.get("kind") == "state_lost" and e.get("restored_step") is not None:
                self.votes.forget_after(int(e["restored_step"]))
            if e.get("kind") in ("failure_detected", "gave_up", "restart_started") and r is not None:
                self.healthy_since[r] = None
            if e.get("kind") == "lighthouse_restarted":
                self._lh_address = e.get("address") or self._lh_address
        for m in read_jsonl(self.run_dir / "metrics.jsonl"):
            self.view.on_metric(m)
            self.max_step = max(self.max_step, m.get("step", 0))
            self.committed_seen = highest_commit(self.committed_seen, m)
            if self.t_train is None or m.get("time", self.t_train) < self.t_train:
                self.t_train = m.get("time", self.t_train)
            r = m.get("replica")
            if r is not None and self.healthy_since.get(r) is None:
                self.healthy_since[r] = time.time()
        self._generations_seen = max([int(e.get("generation") or 0) for e in events] or [0])

    async def _resume_run(self, host: Any, port: Any) -> ReplicaSet:
        """Take over a run whose controller was lost: adopt its live Lighthouse and replicas (which trained on
        meanwhile), have each replica resend what it journaled after the run's files end, respawn a replica whose
        own process died meanwhile (it heals from a live peer), restart what failed while nobody supervised, and
        go on. With no replica alive: a new Lighthouse from its state file and new replicas, which restore the
        newest backstop (a counted `state_lost`)."""
        from regent.actor import AdoptError, adopt_proc_mesh, attach_actor_mesh

        assert self.resume is not None
        previous = self.resume.attach
        lh = previous.get("lighthouse") or {}
        self._lh_bind, self._lh_address = lh.get("bind"), lh.get("address") or self._lh_address
        down_since = max([_mtime(self.run_dir / n) for n in ("events.jsonl", "metrics.jsonl")] or [time.time()])
        grace = float(self.cfg.controller_grace or 0) or None
        mode, adopted_lh = "reattached", False
        replicas: ReplicaSet | None = None
        lost: dict[int, str] = {}
        if self.resume.alive or self.resume.remote:  # the replicas first: without any of them the run goes back to its backstop anyway
            try:
                replicas, lost = await self._adopt_replicas(previous.get("replicas") or {}, grace)
            except (AdoptError, KeyError) as exc:
                logger.warning("the replicas of the run are gone (%s)", exc)
            if replicas is not None and not replicas.handles:
                logger.warning("no replica of the run is alive: %s", lost)
                replicas, lost = None, {}
        if replicas is not None and lh.get("procs") and lh.get("actor"):
            try:
                procs = await asyncio.to_thread(adopt_proc_mesh, lh["procs"], detach_grace=grace)
                actor = attach_actor_mesh(lh["actor"], procs)
                self._lh_procs.append(procs)
                self._lh_actors.append(actor)
                self._lighthouse = actor
                adopted_lh = True
            except AdoptError as exc:
                logger.warning("the Lighthouse of the run is gone (%s); starting a new one", exc)
        imported: dict[str, int] = {}
        if replicas is None:
            mode = "backstop"
            self._kill_leftovers()
            imported = self._import_journal_tails(range(self.cfg.replicas))
            await self._release_lost_allocations()
        if not adopted_lh and not self.cfg.lighthouse.address:
            await self._start_lighthouse(self._lh_bind, bind_retry_s=30.0)
        elif not adopted_lh:
            await self._start_lighthouse(None)
        addr = self.cfg.lighthouse.address or self._lh_address
        self.view.dashboard = lh.get("dashboard", "")
        print(f"[regent] resuming run {self.run_dir}; Lighthouse {addr} "
              f"({'adopted' if adopted_lh else 'started anew'})", flush=True)
        attached: list[dict[str, Any]] = []
        if replicas is not None:
            self._replicas = replicas
            after = last_rseqs(self.run_dir)
            attached = list(await asyncio.gather(*[
                replicas.slice(replicas=r).attach.call_one(port, after.get(r, 0)) for r in sorted(replicas.handles)]))
            if lost:
                imported = await self._replace_lost(host, addr, port, lost)
                await self._introduce(replicas)  # the survivors learn the respawned replicas' new handles
        else:
            replicas = self._spawn_replicas(host, addr, port, first_generation=self._generations_seen + 1)
            await self._introduce(replicas)
            await asyncio.gather(*[replicas.slice(replicas=r).start.call_one(replicas.slice(replicas=r))
                                   for r in range(self.cfg.replicas)])
        down = [a["replica"] for a in attached if a.get("down_while_detached")]
        self.record_event(_event(
            "controller_restarted", mode=mode, down_s=round(time.time() - down_since, 3),
            previous_pid=(previous.get("controller") or {}).get("pid"),
            previous_host=(previous.get("controller") or {}).get("host"), host=socket.gethostname(),
            lighthouse="adopted" if adopted_lh else "restarted", resent={str(a["replica"]): a["resent"] for a in attached},
            stayed_down=down, respawned=sorted(lost), imported=imported, step=self.max_step))
        what = (", ".join(f"replica {a['replica']} resent {a['resent']} journaled item(s)" for a in attached)
                or "nothing of it was alive: new replicas restore the newest backstop")
        if down:
            what += f"; restarting replica(s) {down}, which failed while no controller was there"
        if lost:
            what += f"; respawning replica(s) {sorted(lost)}, whose replica process died while no controller was there"
        print(f"[regent] controller took over ({mode}): {what}", flush=True)
        for r in down:
            await replicas.slice(replicas=r).restart_after_detach.call_one()
        await asyncio.gather(*[replicas.slice(replicas=r).respawn.call_one(replicas.slice(replicas=r))
                               for r in sorted(lost)])
        self._record_attach()
        return replicas

    async def _adopt_replicas(self, record: dict[str, Any], grace: float | None) -> tuple[ReplicaSet, dict[int, str]]:
        """Adopt every recorded replica mesh (the run's first and each respawned one), taking the live procs of a
        mesh one of whose procs died (`lost_ok`). Returns the live replicas and the lost ones (replica -> why).
        A mesh that refuses (a live controller owns it) raises AdoptError."""
        from regent.actor import AdoptError, adopt_proc_mesh, attach_actor_mesh
        from regent.orchestrate.resume import end_if_ours

        replicas, lost = ReplicaSet({}), {}
        for procs_ref, actor_ref, ranks in adoption_plan(record, self.cfg.replicas):
            try:
                procs = await asyncio.to_thread(adopt_proc_mesh, procs_ref, detach_grace=grace, lost_ok=True)
            except AdoptError as exc:
                if exc.refused or exc.adopted:
                    raise
                lost.update({r: str(exc).splitlines()[-1].strip() for r in ranks})
                gone = ranks.values()
            else:
                actors = attach_actor_mesh(actor_ref, procs)
                replicas.add(procs, actors, {r: k for r, k in ranks.items() if k not in procs.lost_ranks},
                             size=len(procs_ref["rank_procs"]), first=procs_ref is record.get("procs"))
                lost.update({r: procs.lost_ranks[k] for r, k in ranks.items() if k in procs.lost_ranks})
                gone = procs.lost_ranks
            # one that did not answer may be hung, not dead: it must not train on beside its replacement
            marker = settings.REGENT_RUN_MARKER.require()
            for k in gone:
                end_if_ours((procs_ref.get("os_pids") or {}).get(procs_ref["rank_procs"][k]), marker)
        return replicas, lost

    async def _replace_lost(self, host: Any, addr: str, port: Any, lost: dict[int, str],
                            attached: bool = False, spawn: bool = True) -> dict[str, int]:
        """Replicas whose ReplicaActor process died (while no controller was attached, or, `attached`, under this
        one): what their journals hold beyond what the run's files hold is written first, their failure is
        recorded (the peers and the Lighthouse are told, as for any failure), their allocations are released,
        and each gets a new ReplicaActor on a proc mesh of its own, in the next generation (`respawn` starts
        it). Returns the journal items imported."""
        from regent.orchestrate.replica import ReplicaActor

        assert self._replicas is not None
        imported = self._import_journal_tails(sorted(lost), held=self._rseq_held if attached else None)
        generations: dict[int, int] = {}
        if attached:  # this controller saw every event: no need to read the file
            generations = {r: self.view.reps[r].generation for r in lost if r in self.view.reps}
        else:
            for e in read_jsonl(self.run_dir / "events.jsonl"):
                if e.get("replica") in lost and e.get("generation") is not None:
                    generations[e["replica"]] = max(generations.get(e["replica"], 0), int(e["generation"]))
        when = "" if attached else " while no controller was attached"
        for r, why in sorted(lost.items()):
            self.record_event(_event(
                "failure_detected", replica=r, generation=generations.get(r, 0), rank=None, detached=not attached,
                error=f"the replica's own process (its ReplicaActor) died{when}: {why}", traceback=""))
        await self._release_lost_allocations(only=set(lost))
        journal = str((self.run_dir / "journal").resolve())
        for r in sorted(lost) if spawn else ():
            adopted = await self._adopt_standby(r, addr) if attached else None
            if adopted is not None:
                procs, actors = adopted
            else:
                procs = host.spawn_procs(per_host={"replicas": 1}, **self._detach_options())
                actors = procs.spawn("replica", ReplicaActor, self.cfg, addr, port, journal,
                                     self._generations_seen + 1, r)
            self._replicas.add(procs, actors, {r: 0}, size=1)
        return imported

    # -- the standby ReplicaActor ---------------------------------------------------------------------------
    def _standby_wanted(self) -> bool:
        """Local job only: elsewhere a replica's trainers run on hosts of its own allocation, where the
        controller's host has no warm processes to give."""
        cfg = self.cfg
        return (cfg.standby_replica and cfg.warm_spares and cfg.job == "local" and cfg.recovery == "peer"
                and not cfg.no_ft and self.failed_reason is None and not self._standby_closed)

    def _keep_standby(self, delay_s: float) -> None:
        """Start a standby ReplicaActor in `delay_s` (once training runs: its warm processes import torch, seconds
        of CPU that a start or a restart should not share), unless one is there or starting."""
        if self._standby is not None or self._standby_task is not None or not self._standby_wanted():
            return
        self._standby_task = asyncio.get_running_loop().create_task(self._start_standby(delay_s))

    async def _start_standby(self, delay_s: float) -> None:
        from regent.orchestrate.replica import ReplicaActor

        try:
            while self.max_step < 1 and self.failed_reason is None:  # not before the replicas train
                await asyncio.sleep(1.0)
            await asyncio.sleep(delay_s)
            if not self._standby_wanted() or self.stop_requested_at is not None:
                return
            addr = self.cfg.lighthouse.address or self._lh_address
            # no detach grace: a standby dies with this controller (a successor would not know of it); `adopt`
            # gives it the grace of a replica
            procs = self._host.spawn_procs(per_host={"replicas": 1})
            actors = procs.spawn("replica_standby", ReplicaActor, self.cfg, addr, self._report_port,
                                 str((self.run_dir / "journal").resolve()), 0, -1, True)
            self._standbys.append((procs, actors))
            if await asyncio.wait_for(as_awaitable(actors.warm_standby.call_one()), timeout=STANDBY_CALL_TIMEOUT_S):
                self._standby = (procs, actors)
        except Exception as exc:  # noqa: BLE001 - reported; replicas are then replaced cold, as before
            logger.warning("could not start a standby ReplicaActor: %r", exc)
        finally:
            self._standby_task = None

    def _standby_lost(self, standby: tuple[Any, Any]) -> None:
        """A standby's process died (warm or still warming): forget it and start another."""
        self._standbys = [p for p in self._standbys if p is not standby]
        if self._standby is standby:
            self._standby = None
        self._keep_standby(STANDBY_DELAY_S)

    async def _adopt_standby(self, r: int, addr: str) -> tuple[Any, Any] | None:
        """The warm standby as replica `r`'s new ReplicaActor (None: there is none, or it failed: a cold one)."""
        standby, self._standby = self._standby, None
        if standby is None:
            self._keep_standby(STANDBY_DELAY_S)
            return None
        grace = self._detach_options()
        try:
            # bounded: a standby that does not answer (stopped, swapped out) is replaced by a cold ReplicaActor
            await asyncio.wait_for(as_awaitable(standby[1].adopt.call_one(
                r, self._generations_seen + 1, addr, float(grace.get("detach_grace", 0.0)),
                grace.get("detach_log_dir"))), timeout=STANDBY_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - reported; a cold ReplicaActor replaces the replica instead
            logger.warning("the standby ReplicaActor could not become replica %d: %r", r, exc)
            try:
                await asyncio.wait_for(as_awaitable(standby[0].stop()), timeout=30)
            except Exception as stop_exc:  # noqa: BLE001 - reported; the end of the run stops it again
                logger.warning("stopping the failed standby: %r", stop_exc)
            return None
        finally:
            self._standbys = [p for p in self._standbys if p is not standby]
            self._keep_standby(STANDBY_DELAY_S)  # the next one, once this restart has its CPU
        print(f"[regent] replica {r}: its new ReplicaActor is the warm standby", flush=True)
        return standby

    def _import_journal_tails(self, replicas: Any, held: dict[int, int] | None = None) -> dict[str, int]:
        """`replicas` are gone (nothing of the run is alive, or their ReplicaActor process died): what they
        journaled after the run's files end (they trained on for a while, the controller died with items
        unwritten, or a dying ReplicaActor journaled items it never sent) is history all the same; written here,
        in order, before anything new of them. `held`: the rseq each replica's lines hold, when this controller
        knows it (else read from the run's files)."""
        from regent.orchestrate.relay import journal_path, read_journal

        after = dict(held) if held is not None else last_rseqs(self.run_dir)
        imported: dict[str, int] = {}
        for r in replicas:
            n = 0
            for item in read_journal(journal_path(self.run_dir / "journal", r), after.get(r, 0)):
                self._rseq_held[r] = max(self._rseq_held.get(r, 0), int(item["rseq"]))
                payload = {**item["payload"], "rseq": item["rseq"]}
                if item["kind"] == "event" and payload.get("kind") not in BALLOT_KINDS:
                    self.record_event(payload)
                elif item["kind"] == "metric":
                    self.record_metric(payload)
                if payload.get("generation") is not None:
                    self._generations_seen = max(self._generations_seen, int(payload["generation"]))
                n += 1
            imported[str(r)] = n
        return imported

    async def _release_lost_allocations(self, only: set[int] | None = None) -> None:
        """Nothing of the run answered, so no replica process is left to release its scheduler allocation (a
        SIGKILL runs no cleanup): free each one the run recorded (SLURM, Kubernetes, SkyPilot) before new
        replicas allocate their own, so a lost controller does not hold nodes until the time limit."""
        from regent.jobs.base import release_recorded
        from regent.orchestrate.resume import allocations_to_release

        for r, ref in allocations_to_release(read_jsonl(self.run_dir / "events.jsonl")):
            if only is not None and r not in only:
                continue
            try:
                how = await asyncio.to_thread(release_recorded, ref)
            except Exception as exc:  # noqa: BLE001 - reported (event and log): the allocation may still be held
                how = f"failed: {exc!r}"
                logger.error("replica %d: releasing %s failed, it may be held until its time limit: %r", r,
                             ref.get("describe"), exc)
            self.record_event(_event("allocation_released", replica=r, job=ref.get("describe"), how=how))
            print(f"[regent] replica {r}: its allocation outlived it; {how}", flush=True)

    def _kill_leftovers(self) -> None:
        """Nothing of the run answered: whatever still carries its marker (a hung proc) must not heartbeat next
        to the new replicas."""
        marker = settings.REGENT_RUN_MARKER.require()
        for pid in leaked_processes(marker, grace_s=0.0):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    async def _unless_failed(self, coro: Any) -> None:
        """Run `coro`, cut short the moment the run fails (`fail_run`), whatever it is waiting for."""
        assert self._failed is not None
        supervise = asyncio.get_running_loop().create_task(coro)
        failed = asyncio.get_running_loop().create_task(self._failed.wait())
        try:
            await asyncio.wait({supervise, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (supervise, failed):
                task.cancel()
        if supervise.done() and not supervise.cancelled() and supervise.exception() is not None:
            raise supervise.exception()

    # -- the Lighthouse -------------------------------------------------------------------------------
    async def _start_lighthouse(self, bind: str | None, bind_retry_s: float = 0.0) -> dict[str, str]:
        """A Lighthouse process (and actor); with `bind`, serving there. The first one's port is kept for the
        ones started after it (a bind to port 0 is turned into a bind to the port it got)."""
        from regent.orchestrate.lighthouse_actor import LighthouseActor

        cfg, lc = self.cfg, self.cfg.lighthouse
        # rpc_env: the Lighthouse checks the job secret (which every spawned process has) and serves TLS as
        # --ft.rpc-auth / --ft.tls-* say (regent.ft.rpc_security).
        procs = this_host().spawn_procs(per_host={"lighthouse": 1}, env=cfg.ft.rpc_env(), **self._detach_options())
        self._lh_procs.append(procs)
        actor = procs.spawn("lighthouse", LighthouseActor)
        self._lh_actors.append(actor)
        info: dict[str, str] = {}
        if bind is not None:
            info = await actor.start_lighthouse.call_one(
                bind, min(lc.min_replicas, cfg.replicas), lc.join_timeout_ms, lc.quorum_tick_ms,
                lc.heartbeat_timeout_ms, str(self.run_dir / "lighthouse.state"), bind_retry_s,
                # a fresh run's first quorum waits for every replica (bounded by the join timeout); a restarted
                # Lighthouse waits for the last quorum's groups instead (its state file names them)
                [f"replica_{r}" for r in range(cfg.replicas)] if self._lh_address is None else None,
                lc.join_timeout_ms / 1000.0,
                # what the replicas committed while no Lighthouse heard it (regent.ft.quorum.seed_watermark)
                seed_committed=self.committed_seen if self.committed_seen[0] else None,
                holder_grace_ms=lc.holder_grace_ms, late_member_ms=lc.late_member_ms)
            if self._lh_address is not None and info["address"] != self._lh_address:
                raise RuntimeError(f"the new Lighthouse serves at {info['address']}, not {self._lh_address}")
            self._lh_address = info["address"]
            self._lh_bind = fixed_bind(bind, info["address"])
        self._lighthouse = actor
        return info

    def _fault_hook(self, previous: Any) -> Any:
        """The runtime's hook for failures nobody supervises (on the controller: the Lighthouse and replica
        meshes). A dead Lighthouse is restarted; anything else goes to the previous hook (which ends the run)."""

        def hook(failure: Any) -> None:  # runs on a thread of the actor runtime
            mesh = getattr(failure, "mesh", None)
            lost = (self._replicas.replicas_of(mesh, list(getattr(failure, "crashed_ranks", [])))
                    if self._replicas is not None and mesh is not None else [])
            if lost and self._loop is not None:
                why = failure.report() if hasattr(failure, "report") else str(failure)
                self._loop.call_soon_threadsafe(self._replica_process_died, lost, why)
                return
            standby = next((p for p in list(self._standbys) if any(mesh is m for m in p)), None)
            if standby is not None and self._loop is not None:
                logger.warning("a standby ReplicaActor failed (%s); starting another", failure)
                self._loop.call_soon_threadsafe(self._standby_lost, standby)
                return
            if not any(mesh is a for a in self._lh_actors):
                previous(failure)
                return
            if any(mesh is a for a in self._lh_killed):
                return  # the `lighthouse` fault: its restart is already scheduled
            logger.error("the Lighthouse process failed: %s", failure)
            if self._loop is not None and mesh is self._lighthouse:
                self._loop.call_soon_threadsafe(self._lighthouse_crashed)

        return hook

    def _replica_process_died(self, lost: list[int], why: str) -> None:
        """A ReplicaActor's process died (killed, OOM, a bug) while this controller supervises: its trainers go
        with it (they exit when their parent does, or their allocation is released), and the replica gets a new
        ReplicaActor whose trainers heal from a live peer, as `--resume` does for one that died while no
        controller was attached. The run goes on. A replica whose ReplicaActor dies `crash_loop_starts` times in a
        row without training a step in between gives up."""
        if self.failed_reason is not None or self._replicas is None:
            return
        for r in lost:
            if r in self._respawns or r not in self._replicas:
                continue  # a second report of the same death
            step = self.view.reps[r].step if r in self.view.reps else 0
            streak, at = self._respawn_streak.get(r, (0, None))
            again, streak = supervisor_respawn(streak, step, at, self.cfg.crash_loop_starts)
            self._respawn_streak[r] = (streak, step)
            last = why.strip().splitlines()[-1].strip() if why.strip() else "no report"
            self._replicas.drop(r)
            if again:
                print(f"[regent] replica {r}: its replica process (ReplicaActor) died ({last}); starting a new "
                      "one, whose trainers heal from a live peer", flush=True)
            self._respawns[r] = task = asyncio.get_running_loop().create_task(
                self._respawn_replica(r, last, None if again else streak))
            task.add_done_callback(lambda _t, r=r: self._respawns.pop(r, None))

    async def _respawn_replica(self, r: int, why: str, gave_up_after: int | None) -> None:
        """`_replica_process_died`'s work: the failure recorded and told, the journal's tail written, then a new
        ReplicaActor (or, `gave_up_after` deaths in a row, none: the replica gives up)."""
        assert self._replicas is not None
        addr = self.cfg.lighthouse.address or self._lh_address
        try:
            await self._replace_lost(self._host, addr, self._report_port, {r: why}, attached=True,
                                     spawn=gave_up_after is None)
            if gave_up_after is not None:
                reason = (f"its replica process (ReplicaActor) died {gave_up_after} times in a row without training "
                          f"a step (crash_loop_starts={self.cfg.crash_loop_starts})")
                print(f"[regent] replica {r} gave up: {reason}; last: {why}", flush=True)
                self.record_event(_event("gave_up", replica=r, attempts=gave_up_after, failed_starts=gave_up_after,
                                         reason=reason, last_error=why))
                self._record_attach()
                return
            await self._introduce(self._replicas)
            await self._replicas.slice(replicas=r).respawn.call_one(self._replicas.slice(replicas=r))
            self._record_attach()
        except Exception as exc:  # noqa: BLE001 - the run cannot go on without a supervisor for this replica
            self.fail_run(f"replica {r}'s replica process died and a new one could not be started: {exc!r}")

    def _lighthouse_crashed(self) -> None:
        if self._lh_task is None and self._lh_bind is not None and self.failed_reason is None:
            print("[regent] the Lighthouse process died; starting a new one on the same address", flush=True)
            self._lh_task = asyncio.get_running_loop().create_task(self._restart_lighthouse(0.0, "crashed"))

    async def _kill_lighthouse(self) -> bool:
        """The `lighthouse` fault: SIGKILL the Lighthouse process; a new one starts after `lighthouse_down_s`."""
        if self.cfg.lighthouse.address or self._lh_bind is None or self._lh_task is not None:
            return False  # an external Lighthouse is not ours to kill; one restart at a time
        actor = self._lighthouse
        try:
            pid = await actor.pid.call_one()
        except Exception as exc:  # noqa: BLE001 - reported; a fault that cannot be delivered is skipped
            logger.warning("the lighthouse fault could not reach the Lighthouse: %r", exc)
            return False
        self._lh_killed.append(actor)
        os.kill(pid, signal.SIGKILL)
        down = float(self.cfg.faults.lighthouse_down_s)
        self._lh_task = asyncio.get_running_loop().create_task(self._restart_lighthouse(down, "injected"))
        return True

    async def _restart_lighthouse(self, down_s: float, cause: str) -> None:
        await asyncio.sleep(down_s)
        t0 = time.time()
        try:
            info = await self._start_lighthouse(self._lh_bind, bind_retry_s=30.0)
        except Exception as exc:  # noqa: BLE001 - reported: the run fails with it
            self.fail_run(f"the Lighthouse could not be started again on {self._lh_bind}: {exc!r}")
            return
        finally:
            self._lh_task = None
        # committed_step: the watermark it starts from (its state file's, or what the replicas committed while it
        # was down, if higher: `seed_committed`)
        self.record_event(_event("lighthouse_restarted", address=info["address"], cause=cause, down_s=down_s,
                                 seconds=time.time() - t0, step=self.max_step,
                                 committed_step=info.get("committed_step"),
                                 committed_lineage=info.get("committed_lineage")))
        self._record_attach()
        print(f"[regent] Lighthouse started again at {info['address']} ({cause})", flush=True)

    def _schedule(self) -> Any:
        f = self.cfg.faults
        if not f.enabled:
            return None
        if f.file:
            return ReplayFaultSchedule.from_file(f.file)
        return RandomFaultSchedule(f.kinds, f.every, f.warmup, f.holdoff, self.cfg.procs_per_replica,
                                   seed=self.cfg.seed, correlated_size=f.correlated_size,
                                   correlated_window=f.correlated_window_s)

    def _done(self, schedule: Any = None) -> bool:
        cfg = self.cfg
        if self.full_restart_pending:
            return False  # the checkpoint-restart baseline restarts everyone before the run may end
        if cfg.steps is not None:
            return self.max_step >= cfg.steps
        if time.time() - self.t_start < (cfg.duration or 0):
            return False
        return not self._replay_unfinished(schedule)

    def _replay_unfinished(self, schedule: Any) -> bool:
        """A replayed fault file is played to its end: past --duration the run goes on until its last fault has
        been injected and every replica trains again (a slow start-up on a busy machine left the last faults
        of a reproduction out). Bounded: REPLAY_OVERRUN_S past the duration at most, then the run ends and
        says what was left out."""
        if not isinstance(schedule, ReplayFaultSchedule):
            return False
        if self.t_train is None and not schedule.pending:
            return False  # nothing left to play (a run whose training has not started is waited for below)
        now = time.time()
        for r, (at, within) in list(self._failure_awaited.items()):
            if now - at > within:  # never reported: the replica may have finished its step first; not waited on
                del self._failure_awaited[r]
                logger.warning("no failure reported for replica %d %.0f s after its fault", r, now - at)
        unhealthy = [r for r, since in self.healthy_since.items()
                     if since is None and self.view.reps[r].status not in ("gave up", "ended failed")]
        unhealthy += [r for r in self._failure_awaited if r not in unhealthy]  # hit, failure not reported yet
        if not schedule.pending and not unhealthy:
            return False
        over = time.time() - self.t_start - (self.cfg.duration or 0)
        if not self._replay_overrun_said:
            self._replay_overrun_said = True
            print(f"[regent] --duration reached with {len(schedule.pending)} replayed fault(s) still to come "
                  f"and {len(unhealthy)} replica(s) recovering: running on until they are done "
                  f"(at most {REPLAY_OVERRUN_S:.0f} s)", flush=True)
        if over < REPLAY_OVERRUN_S:
            return True
        left = ", ".join(f"{f.kind}@{f.at:g}s" for f in schedule.pending) or "none"
        print(f"[regent] replay overrun of {REPLAY_OVERRUN_S:.0f} s spent; ending. Faults not injected: {left}; "
              f"replicas still recovering: {unhealthy or 'none'}", flush=True)
        self.record_event(_event("replay_cut", faults_left=[f.kind for f in schedule.pending],
                                 recovering=unhealthy, step=self.max_step))
        return False

    async def _supervise_run(self, replicas: Any) -> None:
        schedule = self._schedule()
        while not self._done(schedule) and self.failed_reason is None:
            await asyncio.sleep(0.25)
            self.display.refresh()
            self._decide_votes()
            # before the first step too: replicas that all give up in a crash loop before training end the run
            if all(v.status == "gave up" for v in self.view.reps.values()):
                print("[regent] every replica gave up; stopping", flush=True)
                break
            if self.t_train is None:
                continue
            now = time.time() - self.t_train
            if schedule is not None and schedule.due(now) and not self.full_restart_pending:
                fault = schedule.pick(now, since_first_step(self.healthy_since, self.t_train))
                if fault is not None and await self._inject(replicas, fault):
                    self.faults_log.write(json.loads(fault_record(fault)))
                elif fault is not None:  # its replica is restarting: never dropped silently
                    why = schedule.not_delivered(fault)
                    key = (fault.kind, fault.at)
                    if key != self._undelivered_said:
                        self._undelivered_said = key
                        print(f"[regent] {fault.kind} fault for replica {fault.replica} not delivered: the replica "
                              f"is restarting; {why}", flush=True)
            if self.full_restart_pending:
                await self._full_restart(replicas)

    async def _inject(self, replicas: Any, fault: PlannedFault) -> bool:
        """Deliver one fault and record `fault_injected` with the replicas it hit (`replica` for a single-replica
        kind, `replicas` for every kind; neither for `lighthouse`). False: not delivered (replica restarting)."""
        if fault.kind == "lighthouse":
            if await self._kill_lighthouse():
                self.record_event(make_event("fault_injected", replica=None, replicas=[], fault_kind=fault.kind,
                                             rank=None, step=self.max_step,
                                             down_s=self.cfg.faults.lighthouse_down_s))
            return True
        if fault.kind == "correlated":
            self._spawn(self._inject_correlated(replicas, fault))  # its kills are spread over a window
            return True
        if fault.kind == "supervisor":
            return await self._kill_supervisor(replicas, fault)
        t_inject = time.time()
        try:
            delivered = await replicas.slice(replicas=fault.replica).inject_fault.call_one(fault.kind, fault.rank)
        except Exception as exc:  # noqa: BLE001 - reported; that replica is failing itself, its supervisor handles it
            logger.warning("injecting %s into replica %s: %r", fault.kind, fault.replica, exc)
            return False
        if delivered:
            self._await_failure(fault.kind, [fault.replica], t_inject)
            extra = {"seconds": self.cfg.faults.straggler_s} if fault.kind == "straggler" else {}
            self.record_event(make_event("fault_injected", replica=fault.replica, replicas=[fault.replica],
                                         fault_kind=fault.kind, rank=fault.rank, step=self.max_step, **extra))
        return bool(delivered)

    async def _kill_supervisor(self, replicas: Any, fault: PlannedFault) -> bool:
        """The `supervisor` fault: SIGKILL the replica's own process (its ReplicaActor, on this host), as an OOM
        kill or a bug in it would; `_replica_process_died` starts a new one. False while it is being replaced."""
        if fault.replica in self._respawns:
            return False
        t_inject = time.time()
        try:
            pid = await replicas.slice(replicas=fault.replica).pid.call_one()
        except Exception as exc:  # noqa: BLE001 - reported; counted as not delivered (it is dying or replaced)
            logger.warning("the supervisor fault could not reach replica %s: %r", fault.replica, exc)
            return False
        self.record_event(make_event("fault_injected", replica=fault.replica, replicas=[fault.replica],
                                     fault_kind=fault.kind, rank=None, step=self.max_step))
        self._await_failure(fault.kind, [fault.replica], t_inject)
        os.kill(pid, signal.SIGKILL)
        return True

    def _await_failure(self, kind: str, hit: list[int], injected_at: float) -> None:
        """Replicas `hit` by a fault at `injected_at` count as recovering until their failure is reported."""
        within = failure_expected_within(kind, self.cfg.faults.hang_timeout)
        if within is None:
            return
        for r in hit:
            if self._failure_seen_at.get(r, 0.0) < injected_at:  # not reported already, during the injection
                self._failure_awaited[r] = (injected_at, within)

    async def _inject_correlated(self, replicas: Any, fault: PlannedFault) -> None:
        """Kill every replica of `fault.replicas`, each at its offset: one event, timed at the first kill."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        offsets = fault.offsets or (0.0,) * len(fault.replicas)
        hit: list[int] = []
        at: list[float] = []
        first: float | None = None
        t_inject = time.time()
        for r, offset in zip(fault.replicas, offsets):
            await asyncio.sleep(max(0.0, t0 + offset - loop.time()))
            try:
                delivered = await replicas.slice(replicas=r).inject_fault.call_one(fault.kind, 0)
            except Exception as exc:  # noqa: BLE001 - reported; counted as not delivered
                logger.warning("injecting %s into replica %s: %r", fault.kind, r, exc)
                delivered = False
            if delivered:
                now = time.time()
                first = now if first is None else first
                hit.append(r)
                at.append(round(now - first, 3))
        if hit:
            self._await_failure(fault.kind, hit, t_inject)
            self.record_event(make_event("fault_injected", replica=None, replicas=hit, fault_kind=fault.kind,
                                         rank=None, step=self.max_step, offsets=at, t=first,
                                         window_s=self.cfg.faults.correlated_window_s))

    async def _full_restart(self, replicas: Any) -> None:
        """The checkpoint-restart baseline: every replica stops and reloads the last checkpoint."""
        await asyncio.sleep(0.5)  # let the other replicas' failure reports of the same fault arrive
        self.full_restart_pending = False
        ckpt = str(self.run_dir / "checkpoints")
        await replicas.call_all("full_restart", ckpt)
        self.full_restart_pending = False

    async def _finish(self, replicas: Any) -> None:
        """Stop at a common sync boundary so the replicas can be compared bit for bit."""
        cfg = self.cfg
        h = cfg.ft.sync_every if cfg.ft.mode == "diloco" else 1
        # Two steps past the last one reported, not one: a replica may have committed max_step + 1 and started
        # the step after it before its report (or this stop) arrived, and a replica that overshoots the stop step
        # waits for a quorum the others never join (soak of session 20: the last step took 60 s, a join timeout).
        if self._respawns:  # a replica whose ReplicaActor died gets its new one before the stop is asked for
            _, pending = await asyncio.wait(set(self._respawns.values()), timeout=120)
            if pending:  # said, not silent: those replicas are then left out of the final comparison (checked)
                print(f"[regent] replica(s) {sorted(self._respawns)} still getting a new ReplicaActor after 120 s; "
                      "stopping without them", flush=True)
        target = cfg.steps if cfg.steps is not None else self.max_step + 2
        target = int(math.ceil(max(target, 1) / h) * h)
        self.stop_requested_at = target
        # long enough for the slowest replica to reach the boundary at the pace seen so far
        rate = healthy_step_rate(list(read_jsonl(self.run_dir / "metrics.jsonl")),
                                 list(read_jsonl(self.run_dir / "events.jsonl"))) or 0.1
        wait = max(120.0, 3 * h / rate + 60)
        try:
            await replicas.call_all("request_stop", target)
            # Every replica's final state first, and only then are trainers stopped: a replica that reaches the
            # stop step early keeps serving its committed state to one still healing towards it. (Stopping each
            # replica as soon as it was done left a replica that was mid-heal on a GPU with no live donor: it
            # restored an old backstop, trained alone to the stop step and ended different.)
            self.final_states = await asyncio.wait_for(self._collect_final_states(replicas, wait), timeout=wait + 60)
        except Exception as exc:  # noqa: BLE001 - reported (and the checker flags the replicas left uncompared)
            logger.warning("finishing replicas: %r", exc)
        await self._final_vote(replicas, wait)
        for check in self.votes.checks_due(final=True):  # ended with the run: reported as they stand
            self.record_event(_event("copy_checked", **check))
        # the end of training: every figure runs to here (summary.training_end), not to the last metric record
        self.record_event(_event("training_stopped", stop_step=target, step=self.max_step))
        try:
            await asyncio.wait_for(replicas.call_all("release"), timeout=90)
        except Exception as exc:  # noqa: BLE001 - reported; run.py's teardown stops the meshes next either way
            logger.warning("releasing replicas: %r", exc)

    async def _collect_final_states(self, replicas: Any, wait: float) -> list[dict[str, Any]]:
        """Every replica's final state (`ReplicaActor.finish`, one call each, in parallel). A replica still without
        one `LEFT_BEHIND_GRACE_S` after another reported, and silent for as long (no restart, heal or commit of its
        own: a slow restart that ends in a heal to the stop step is not stuck), missed the run's last sync and is
        caught up: restarted,
        it pulls the final committed state from a finished peer (`catch_up_at_end`; recorded `left_behind`).
        Without this, a replica that joined the last round late waited out `wait` and was left uncompared."""
        loop = asyncio.get_running_loop()
        tasks = {r: asyncio.ensure_future(as_awaitable(replicas.slice(replicas=r).finish.call_one(wait)))
                 for r in range(self.cfg.replicas) if r in replicas}
        # a replica without a ReplicaActor (it gave up in a crash loop of its own process) has no final state
        results: dict[int, dict[str, Any]] = {r: {"replica": r, "step": None, "digest": None}
                                              for r in range(self.cfg.replicas) if r not in tasks}
        final_at: dict[int, float] = {}
        caught_up: set[int] = set()
        while len(results) < self.cfg.replicas:
            await asyncio.wait([t for r, t in tasks.items() if r not in results], timeout=1.0,
                               return_when=asyncio.FIRST_COMPLETED)
            for r, t in tasks.items():
                if r in results or not t.done():
                    continue
                try:
                    results[r] = t.result()
                except Exception as exc:  # noqa: BLE001 - reported; the replica is left uncompared (the checker says)
                    logger.warning("finishing replica %d: %r", r, exc)
                    results[r] = {"replica": r, "step": None, "digest": None}
                if results[r].get("digest"):
                    final_at[r] = loop.time()
            # a replica that reported anything within the grace (a restart, a heal, a commit) is still on its way
            now_m = time.monotonic()
            pending = [r for r in tasks if r not in results
                       and now_m - self._last_event_at.get(r, 0.0) >= LEFT_BEHIND_GRACE_S]
            for r in left_behind(final_at, pending, loop.time(), LEFT_BEHIND_GRACE_S, caught_up):
                caught_up.add(r)
                why = (f"replica(s) {sorted(final_at)} committed the last sync (step {self.stop_requested_at}) "
                       f"{LEFT_BEHIND_GRACE_S:.0f}s ago without it")
                print(f"[regent] replica {r} was left behind at the stop step: {why}; healing it from a finished "
                      "replica", flush=True)
                try:
                    await replicas.slice(replicas=r).catch_up_at_end.call_one(why)
                except Exception as exc:  # noqa: BLE001 - reported; its finish call still ends at its deadline
                    logger.warning("catching up replica %d at the end: %r", r, exc)
        return [results[r] for r in sorted(results)]

    def write_summary(self) -> dict[str, Any]:
        events = list(read_jsonl(self.run_dir / "events.jsonl"))
        metrics = list(read_jsonl(self.run_dir / "metrics.jsonl"))
        from regent.orchestrate.invariants import check_final_states

        finals = [s for s in self.final_states if s and s.get("digest")]
        # consistent: every replica that did not give up was compared, at one step, and all hold one state
        consistent = (not check_final_states({"final_states": self.final_states, "replicas": self.cfg.replicas},
                                             events)) if finals else None
        baseline_rate = None
        if self.cfg.baseline:
            b = Path(self.cfg.baseline)
            baseline_rate = healthy_step_rate(list(read_jsonl(b / "metrics.jsonl")), list(read_jsonl(b / "events.jsonl")))
        summary = compute_summary(events, metrics, replicas=self.cfg.replicas, replicas_consistent=consistent,
                                  baseline_rate=baseline_rate, recovery_mode=self.cfg.recovery,
                                  baseline_dir=self.cfg.baseline, hang_bound_s=self.cfg.faults.hang_timeout,
                                  final_states=self.final_states)
        from regent.orchestrate.invariants import LEDGER_FILE, ledger_totals

        # the sample ledger: samples in committed steps (DiLoCo: rounds), and those recorded as skipped
        summary["samples"] = ledger_totals(list(read_jsonl(self.run_dir / LEDGER_FILE)), events)
        summary["final_states"] = self.final_states
        summary["final_states_diverged"] = self.final_diverged
        summary["baseline"] = self.cfg.baseline
        summary["run_failed"] = self.failed_reason
        summary["leaked_pids"] = self.leaked_pids
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        from regent.orchestrate.invariants import check_run

        # The invariants (no uncounted lineage reset, no committed step going backwards unexplained, equal
        # replicas equal, no leaked processes, bounded memory), checked on what was written, every run.
        summary["invariant_violations"] = self.violations = violations = check_run(self.run_dir, events, metrics)
        summary["check"] = {"holds": not violations, "violations": violations}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        for v in violations:
            print(f"[regent] INVARIANT VIOLATED: {v}", flush=True)
        try:
            from regent.orchestrate.report import write_report

            write_report(self.run_dir, baseline=self.cfg.baseline, events=events, metrics=metrics,
                         violations=violations)
        except Exception as exc:  # noqa: BLE001 - reported; the report is a convenience, the data is already on disk
            logger.warning("report generation failed: %r", exc)
        s = summary
        print(
            f"[regent] done: {s['steps_committed']} steps, faults {s['faults_injected']}, recoveries "
            f"{s['recoveries']}, max quorum id {s['max_quorum_id']}, loss {s['initial_loss']} -> {s['final_loss']}, "
            f"replicas compared {s['replicas_compared']}/{self.cfg.replicas} at step {s['final_step']}, "
            f"consistent={s['replicas_consistent']}, {goodput_text(s)}, state votes {s['state_votes']} "
            f"(divergences {s['divergences']}, healed {s['divergences_healed']})",
            flush=True,
        )
        print(
            f"[regent] accounting: steps lost {s.get('steps_lost')}, lineage resets {s.get('lineage_resets')} "
            f"(undetected {s.get('lineage_resets_undetected')}), full restarts {s.get('full_restarts')}, "
            f"gave up {s.get('gave_up')}, longest stall of the committed step {s.get('max_stall_seconds')} s, "
            f"below {self.cfg.replicas} replicas for {s.get('time_below_n_seconds')} s; goodput basis: "
            f"{s.get('goodput_basis')}",
            flush=True,
        )
        print(f"[regent] report: {self.run_dir / 'report.html'}", flush=True)
        return summary


def donor_replica(donor: Any) -> int | None:
    """The replica index in a donor's replica id ("replica_2:uuid" -> 2); None when it is not one of ours."""
    head = str(donor or "").partition(":")[0]
    return int(head[8:]) if head.startswith("replica_") and head[8:].isdigit() else None


def goodput_text(s: dict[str, Any]) -> str:
    """goodput for the done line: measured against a baseline, or plainly marked as an estimate."""
    if s.get("goodput") is not None:
        return f"goodput {s['goodput']:.3f} (vs baseline)"
    if s.get("goodput_estimate") is not None:
        return f"goodput ESTIMATE {s['goodput_estimate']:.3f} (this run's own pre-fault pace; pass --baseline)"
    return "goodput n/a (no fault-free pace)"


REPLAY_OVERRUN_S = 180.0  # how far a replayed schedule may run past --duration to play its last faults


def since_first_step(healthy_since: dict[int, float | None], t_train: float) -> dict[int, float | None]:
    """`healthy_since` (wall-clock times) on the fault schedule's clock, which starts at the first step.

    Passing wall-clock times to `schedule.pick` made `now - since` hugely negative: no replica was ever
    eligible, and a run injected no faults at all.
    """
    return {r: (since - t_train if since is not None else None) for r, since in healthy_since.items()}


def highest_commit(seen: tuple[int, int], metric: dict[str, Any]) -> tuple[int, int]:
    """`seen`, or the (manager step, lineage) a trainer's step record says its replica holds, whichever is higher.
    Only group rank 0's records carry a lineage; a record of a failed commit holds the last committed one."""
    lineage, step = metric.get("lineage"), metric.get("manager_step")
    if lineage is None or step is None:
        return seen
    return max(seen, (int(step), int(lineage)))


def fixed_bind(bind: str, address: str) -> str:
    """The bind address for a Lighthouse started again: `bind`, with port 0 replaced by the port the first
    Lighthouse got (read from its `address`, e.g. http://127.0.0.1:29510), so clients find it where it was."""
    host, _, port = bind.rpartition(":")
    if port != "0":
        return bind
    return f"{host}:{address.rstrip('/').rpartition(':')[2]}"


def leaked_processes(marker: str, grace_s: float = 5.0, proc: str = "/proc") -> list[int]:
    """Pids of live processes (not this one, not zombies) whose environment holds this run's marker: trainers,
    replicas, Lighthouses or warm spares that outlived the meshes they belonged to. They are given `grace_s`
    to exit first. Empty where there is no /proc."""
    needle = f"{RUN_MARKER_ENV}={marker}".encode()
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for entry in Path(proc).glob("[0-9]*") if Path(proc).is_dir() else []:
            pid = int(entry.name)
            if pid == os.getpid():
                continue
            try:
                if needle not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue  # gone meanwhile, or not ours to read
            if state not in ("Z", "X"):
                found.append(pid)
        if not found or time.monotonic() >= deadline:
            return sorted(found)
        time.sleep(0.25)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _end_torn_lines(run_dir: Path) -> None:
    """A controller killed mid-write may leave a line without its newline: end it, so the next line is whole."""
    from regent.orchestrate.relay import end_torn_line

    for name in ("events.jsonl", "metrics.jsonl", "faults.jsonl"):
        end_torn_line(run_dir / name)


def _replaced(holder: dict[str, Any]) -> None:
    """This controller was stopped and another took the run over (its lease says so): the replicas answer to
    that one now. Exit at once, touching nothing: no stop of meshes, no summary, no lock to keep."""
    print(f"[regent] this controller was replaced by pid {holder.get('pid')} on {holder.get('host')} while it "
          "was stopped; exiting without touching the run", file=sys.stderr, flush=True)
    os._exit(EXIT_REPLACED)


def _event(kind: str, **details: Any) -> dict[str, Any]:
    return make_event(kind, **details)


def run(cfg: RunConfig, resume: ResumePlan | None = None) -> int:
    import faulthandler

    faulthandler.enable()  # a native crash in the controller leaves its Python stacks on stderr
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    actor_config.prefix_python_logs_with_actor = False  # the controller's console and logs stay as written
    # A run given no secret makes up its own, which a successor reads from the run dir (`_attach_record`): the
    # user's long-lived default secret (regent.auth.user_secret) is not copied into run directories.
    if not settings.REGENT_USER_SECRET_FILE.is_set():
        os.environ[settings.REGENT_USER_SECRET_FILE.name] = "off"
    try:
        return asyncio.run(OrchestrationManager(cfg, resume).run())
    except KeyboardInterrupt:
        return 130
