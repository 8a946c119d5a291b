"""ReplicaActor: supervises one replica group and restarts it in place when a trainer process fails.

The supervision rules, in order of what happens on a failure:
1. A trainer reports its exception with the full traceback (`report_training_error`) just before its actor
   dies; a process that dies without a word (SIGKILL, segfault, os._exit) is seen through `__supervise__`.
   A process that stops answering (SIGSTOP, a thread holding the GIL) is seen by the liveness watchdog.
2. The first report of a generation wins; reports from older generations are ignored (RestartPolicy).
3. `_stop_and_restart` stops the old process mesh and spawns a new one on the same host (from a warm spare
   when one is ready). After K consecutive starts that failed before making progress it asks the job layer
   for a fresh allocation instead (the host may be bad).
4. There is no lifetime cap on restarts. Consecutive starts that fail before making progress back off
   exponentially, and after `crash_loop_starts` of them the replica gives up with `gave_up` and the reason
   (a crash loop); the other replicas keep training without it (orchestrate/policy.py).
With `--recovery restart` the replica does not restart itself: it reports the failure and the
OrchestrationManager stops and restarts every replica from the last checkpoint (the classic baseline).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
import traceback
from typing import Any

from regent import settings
from regent.actor import (
    Actor,
    Channel,
    MeshFailure,
    Port,
    concurrent_endpoint,
    config,
    current_rank,
    endpoint,
    on_owner_lost,
    this_host,
)
from regent.orchestrate.events import make_event
from regent.orchestrate.policy import Action, RestartPolicy, allocation_checked, at_the_end
from regent.orchestrate.relay import ReportRelay, journal_path
from regent.ports import free_port

logger = logging.getLogger(__name__)

# What a warm spare imports before it is needed. torch._dynamo is imported lazily by the optimizer's constructor
# (about 1 s here); the rest is the trainer's own code.
PRELOAD = ["torch", "torch._dynamo", "regent.train.trainer", "regent.ft.manager", "regent.ft.local_sgd",
           "regent.orchestrate.session", "regent.orchestrate.trainer_actor", "regent.orchestrate.warm"]
# A claimed spare is replaced this much later: importing torch takes seconds of CPU, which would otherwise be
# taken from the restarted trainer while it builds and heals (the vulnerability window). Faults on one replica
# seconds apart then start cold, which `restart_done` phases show.
SPARE_REFILL_DELAY_S = 3.0


class ReplicaActor(Actor):
    # set in __init__; class defaults for the decision logic tested without a runtime (tests build the actor
    # with __new__)
    relay: ReportRelay | None = None
    down_while_detached: dict[str, Any] | None = None

    def __init__(self, cfg: Any, lighthouse_addr: str, report: Port, journal_dir: str | None = None,
                 first_generation: int = 0, index: int | None = None, standby: bool = False) -> None:
        self.cfg = cfg
        # the rank in the run's replica mesh; `index` for a replica respawned on a mesh of its own (`respawn`)
        self.index = current_rank().rank if index is None else index
        # A standby is no replica yet: it keeps warm trainer processes until the controller makes it the
        # replacement of a replica whose own process died (`adopt`), see `warm_standby`.
        self.standby = standby
        self.journal_dir = journal_dir
        # With a journal (`regent train` gives one), everything this replica and its trainers report is journaled
        # before it is forwarded, and the replica keeps training when the controller is gone (orchestrate/relay.py).
        self.relay: ReportRelay | None = None
        self.trainer_port: Port = report  # where the trainers report: the relay's port once started
        self.down_while_detached: dict[str, Any] | None = None  # a failure while no controller was there
        if journal_dir is not None and not standby:
            self.relay = ReportRelay(journal_path(journal_dir, self.index), report)
            on_owner_lost(self.relay.detach)
        # A failed trainer mesh is replaced, not drained: do not wait long for a hung process to exit.
        config.stop_timeout = 2.0
        self.lighthouse_addr = lighthouse_addr
        self.report = report
        self.policy = RestartPolicy(in_place_restarts=cfg.in_place_restarts,
                                    crash_loop_starts=cfg.crash_loop_starts, backoff_s=cfg.restart_backoff_s)
        # a replica started by a resumed controller goes on from the generations its predecessor had
        self.policy.generation = first_generation
        self.last_error = ""
        self.autorestart = cfg.recovery == "peer"
        self.lock = asyncio.Lock()
        self.self_ref: Any = None
        self.host: Any = None
        self.job: Any = None
        self.procs: Any = None
        self.trainers: Any = None
        self.errors: dict[int, dict[str, Any]] = {}
        self.resume_from: str | None = None
        self.finished = False
        self.stop_target: int | None = None  # the step the run stops at, once it has decided to stop
        self._healing_at_end = False  # heal_at_end restarted it after the stop step (a late bitflip)
        self.peers: Any = None  # the whole replica mesh (know_peers): the fan-out of a failure while detached
        self.ended_failed = False
        self._watchdog: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self.last_restart_seconds = 0.0
        self._spares_started = False

    # -- events ---------------------------------------------------------------------------------------
    def emit(self, kind: str, **details: Any) -> None:
        details.setdefault("generation", self.policy.generation)
        event = make_event(kind, replica=self.index, **details)
        if self.relay is not None:
            self.relay.put("event", event)
        else:
            self.report.send(("event", event))

    async def _relay_trainers(self, receiver: Any) -> None:
        """The trainers' reports, through this replica's journal (see `ReportRelay`)."""
        assert self.relay is not None
        while True:
            kind, payload = await receiver.recv()
            self.relay.put(kind, payload)

    @property
    def detached(self) -> bool:
        """No controller is attached: failures are not restarted (nobody tells the peers or the Lighthouse)."""
        return self.relay is not None and not self.relay.attached

    @endpoint
    async def attach(self, report: Port, after: int) -> dict[str, Any]:
        """A (new) controller takes over this replica's reports: it holds everything up to `after` (this
        replica's `rseq`); the journal's items after it are resent, then every new one. Returns what the
        controller needs to go on supervising this replica."""
        assert self.relay is not None, "attach needs a journal"
        self.report = report
        resent = self.relay.attach(report, after)
        return {"replica": self.index, "generation": self.policy.generation, "resent": resent,
                "rseq": self.relay.rseq, "down_while_detached": self.down_while_detached,
                "finished": self.finished, "stop_target": self.stop_target, "gave_up": self.policy.gave_up,
                "ended_failed": self.ended_failed}

    @endpoint
    async def restart_after_detach(self) -> bool:
        """A failure that happened while no controller was there is restarted now (the controller that adopted
        this replica has told the peers and the Lighthouse). False when there was none."""
        down, self.down_while_detached = self.down_while_detached, None
        if down is None or self.detached:
            self.down_while_detached = down
            return False
        self._on_failure(down["generation"], down["error"], down.get("traceback", ""), rank=down.get("rank"),
                         reported=True)
        return True

    # -- lifecycle ------------------------------------------------------------------------------------
    @endpoint
    async def start(self, self_ref: Any) -> int:
        """Spawn the first generation of trainers and start them training; returns the generation."""
        return await self._start(self_ref)

    async def _start(self, self_ref: Any) -> int:
        self.self_ref = self_ref
        if self.relay is not None:
            self.trainer_port, receiver = Channel.open()
            self._relay_task = asyncio.get_running_loop().create_task(self._relay_trainers(receiver))
        if self.cfg.job == "local":
            self.host = this_host()
            # Several replicas share this host: this replica's trainers must not land on another's GPUs.
            os.environ.update(replica_gpu_env(self.index, self.cfg.procs_per_replica, dict(os.environ)))
        else:  # a real cluster: this replica's first host comes from the job layer too, one host each
            await self._allocate()
        await self._start_attempt()
        self._watchdog = asyncio.get_running_loop().create_task(self._liveness_watchdog())
        return self.policy.generation

    @endpoint
    async def warm_standby(self) -> bool:
        """A standby (the controller's spare ReplicaActor, local job): start this process's warm trainer processes
        now. The warm spares of a replica are children of its ReplicaActor and die with it, so a replica whose
        own process died used to get a new ReplicaActor that started its trainers cold (12.9 s p50 on a
        16-core host, against ~1 s from a warm spare). False when warm spares are off."""
        if not self.standby:
            raise RuntimeError(f"replica {self.index} is not a standby")
        if not self.cfg.warm_spares:
            return False
        self.host = this_host()
        self._start_spares()
        return True

    @endpoint
    async def adopt(self, index: int, first_generation: int, lighthouse_addr: str, detach_grace: float,
                    detach_log_dir: str | None) -> None:
        """This standby becomes replica `index` (whose ReplicaActor died) in `first_generation`; `respawn` then
        starts its trainers, from the warm spares. From here on it outlives a lost controller like any replica
        (it was spawned to die with the controller: a standby nobody knows of must not linger)."""
        from regent.actor._process import get_runtime

        if not self.standby:
            raise RuntimeError(f"replica {self.index} is not a standby")
        self.standby = False
        self.index = index
        self.policy.generation = first_generation
        self.lighthouse_addr = lighthouse_addr
        if self.journal_dir is not None:
            self.relay = ReportRelay(journal_path(self.journal_dir, index), self.report)
            on_owner_lost(self.relay.detach)
        rt = get_runtime()
        if detach_grace > 0:
            rt.detach_grace = float(detach_grace)
            if detach_log_dir:
                rt.detach_log = os.path.join(detach_log_dir, f"detached-{rt.proc_id}.log")

    @endpoint
    async def pid(self) -> int:
        """This ReplicaActor's process (the `supervisor` fault kills it)."""
        return os.getpid()

    @endpoint
    async def respawn(self, self_ref: Any) -> int:
        """This replica's previous process died (while no controller was attached, or under the controller, which
        recorded its `failure_detected`): start its trainers as a restart (`restart_started`, then `restart_done`
        once they are up), which heal from a live peer. Returns the generation."""
        t0 = time.time()
        self.emit("restart_started", action="respawn", backoff_s=0.0, failed_starts=0)
        gen = await self._start(self_ref)
        self._respawn_task = asyncio.get_running_loop().create_task(self._respawned(gen, t0))
        return gen

    async def _respawned(self, gen: int, t0: float) -> None:
        await self._wait_ready(gen)
        if gen == self.policy.generation:  # not failed again meanwhile (that failure reports itself)
            self.last_restart_seconds = time.time() - t0
            # a standby (`adopt`) started its trainers from its warm spares; a new cold ReplicaActor had none
            claimed = await self._spares_claimed()
            self.emit("restart_done", generation=gen, seconds=self.last_restart_seconds,
                      warm_spare=claimed is not None and claimed == self.cfg.procs_per_replica,
                      spares_claimed=claimed, warm_spares_enabled=bool(self.cfg.warm_spares), action="respawn")

    async def _start_attempt(self) -> None:
        gen = self.policy.generation
        cfg = self.cfg
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            settings.REGENT_FT_STORE_PORT.name: str(free_port()),
            "WORLD_SIZE": str(cfg.procs_per_replica),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            settings.REGENT_REPLICA.name: str(self.index),
            settings.REGENT_GENERATION.name: str(gen),
            **cfg.ft.rpc_env(),  # the control plane's secret check and TLS files (regent.ft.rpc_security)
        }
        from regent.orchestrate.trainer_actor import TrainerActor

        self.procs = self.host.spawn_procs(per_host={"gpus": cfg.procs_per_replica}, env=env)
        # a restart after the run decided to stop (heal_at_end) knows the stop step before it recovers: it must not
        # wait for a sync round its finished peers never start
        self.trainers = self.procs.spawn(
            f"trainer_r{self.index}_g{gen}", TrainerActor, cfg, self.index, gen, self.lighthouse_addr,
            self.trainer_port, self.self_ref, self.resume_from, self.stop_target,
        )
        self.trainers.train.broadcast()

    @endpoint
    async def report_training_error(self, generation: int, rank: int, error: str, tb: str) -> None:
        """A trainer's last words: the exception and its full stack trace, sent before its actor dies."""
        self.errors.setdefault(generation, {"rank": rank, "error": error, "traceback": tb})
        self._on_failure(generation, f"rank {rank} raised {error}", tb, rank=rank)

    @endpoint
    async def made_progress(self, generation: int) -> None:
        """A trainer of `generation` committed a step or healed: that start was not part of a crash loop."""
        self.policy.on_progress(generation)

    @endpoint
    async def training_finished(self, generation: int, rank: int) -> None:
        if rank == 0 and generation == self.policy.generation:
            self.finished = True

    async def __supervise__(self, failure: MeshFailure) -> bool:
        gen = self._generation_of(failure)
        known = self.errors.get(gen)
        tb = known["traceback"] if known else failure.report()
        self._on_failure(gen, str(failure), tb)
        return True  # handled here: the other replicas must not notice

    def _generation_of(self, failure: MeshFailure) -> int:
        m = re.search(r"_g(\d+)", str(getattr(failure, "mesh_name", "")) or str(failure))
        return int(m.group(1)) if m else self.policy.generation

    def _on_failure(self, generation: int, error: str, tb: str, rank: int | None = None,
                    reported: bool = False) -> None:
        """`reported`: its `failure_detected` was emitted already (a failure while detached, restarted now)."""
        if self.finished or self.ended_failed:
            return
        if self.detached and self.autorestart:
            # No controller: a restart would go on without anyone telling the peers and the Lighthouse, and
            # nobody would decide the votes it takes part in. This replica stays down (its trainers stopped, so
            # it holds no stale quorum membership); the others train on. A controller that adopts it restarts it.
            if self.down_while_detached is not None or generation != self.policy.generation:
                return
            self.down_while_detached = {"generation": generation, "error": error, "traceback": tb, "rank": rank}
            self.last_error = error
            self.emit("failure_detected", error=error, traceback=tb, rank=rank, generation=generation,
                      detached=True)
            logger.warning("replica %d failed while no controller is attached; it stays down until one adopts "
                           "it: %s", self.index, error)
            self._restart_task = asyncio.get_running_loop().create_task(self._stop_trainers())
            self._tell_peers_directly()
            return
        if self.stop_target is not None and self.autorestart:
            if self._healing_at_end and (self.policy.restarting or generation != self.policy.generation):
                return  # the finished, differing mesh that heal_at_end is replacing: its end means nothing
            # The run has decided to stop. A restart now would look for its state in peers that are finishing
            # and stop serving it, fall back to an old backstop and train alone up to the stop step (seen at the
            # end of a soak: ~2 minutes alone, counted as a full restart). The peers hold the committed state;
            # this replica ends here, reported, and is left out of the final comparison.
            self.ended_failed = True
            self.last_error = error
            self.emit("failure_detected", error=error, traceback=tb, rank=rank, generation=generation)
            self.emit("ended_failed", error=error, stop_step=self.stop_target, generation=generation)
            logger.warning("replica %d failed after the run decided to stop (at step %d); not restarted: %s",
                           self.index, self.stop_target, error)
            self._restart_task = asyncio.get_running_loop().create_task(self._stop_trainers())
            return
        if not self.autorestart:
            # checkpoint-restart baseline: report once per generation, the manager restarts everyone
            if generation == self.policy.generation and not self.policy.restarting:
                self.policy.restarting = True
                self.emit("failure_detected", error=error, traceback=tb, rank=rank, generation=generation)
            return
        action = self.policy.on_failure(generation)
        if action is Action.IGNORE:
            return
        self.last_error = error
        if not reported:
            self.emit("failure_detected", error=error, traceback=tb, rank=rank, generation=generation)
        if action is Action.GIVE_UP:
            reason = self.policy.give_up_reason()
            logger.error("replica %d gives up: %s; last error: %s", self.index, reason, error)
            self.emit("gave_up", attempts=self.policy.attempts, failed_starts=self.policy.failed_starts,
                      reason=reason, last_error=error)
            self._restart_task = asyncio.get_running_loop().create_task(self._stop_trainers())
            return
        self._restart_task = asyncio.get_running_loop().create_task(self._stop_and_restart(action))

    def _start_spares(self) -> None:
        """Keep warm processes (torch imported) for the next restart. Started only once the first trainers
        are up, so that the spares do not compete with them for the CPU at start-up."""
        self._spares_started = True
        if self.cfg.warm_spares and hasattr(self.host, "keep_warm"):
            self.host.keep_warm(self.cfg.procs_per_replica, preload=PRELOAD, refill_delay_s=SPARE_REFILL_DELAY_S)

    async def _stop_trainers(self, graceful: bool = False) -> None:
        """Stop the trainer mesh. `graceful` (the end of the run): actors clean up, processes that do not exit
        within the short stop timeout set in __init__ are killed. Otherwise the generation has failed: its
        processes are killed at once. A hung trainer never answers a stop, and waiting out the stop timeout for
        it cost every `hang` restart 2 s (soak of session 7: ~3.2 s restarts against ~1 s for other kinds);
        what a failed generation would clean up is either replaced by its successor or guarded on disk
        (the backstop's .done markers)."""
        procs, self.procs, self.trainers = self.procs, None, None
        if procs is None:
            return
        try:
            stop = procs.stop() if graceful else procs.stop(timeout=0)
            await asyncio.wait_for(as_awaitable(stop), timeout=30)
        except Exception as exc:  # noqa: BLE001 - reported; a dead mesh may fail to stop cleanly, its processes are gone either way
            logger.warning("replica %d: stopping old mesh: %r", self.index, exc)

    async def _stop_and_restart(self, action: Action) -> None:
        async with self.lock:
            t0 = time.time()
            if action is Action.RESTART_IN_PLACE:
                action = await self._check_allocation(action)
            backoff = self.policy.backoff()
            self.emit("restart_started", action=action.value, backoff_s=backoff,
                      failed_starts=self.policy.failed_starts)
            await self._stop_trainers()
            t_stopped = time.time()
            if backoff > 0:  # the last start failed before making progress too: do not spin
                await asyncio.sleep(backoff)
            if action is Action.REALLOCATE:
                try:
                    await self._reallocate()
                except Exception as exc:  # noqa: BLE001 - reported: a failed allocation is a failed start of the next generation
                    gen = self.policy.restart_finished()
                    logger.error("replica %d: no fresh allocation: %s", self.index, exc)
                    self._on_failure(gen, f"allocation failed: {exc}", traceback.format_exc())
                    return
            gen = self.policy.restart_finished()
            t_spawn = time.time()
            try:
                await self._start_attempt()
            except Exception as exc:  # noqa: BLE001 - reported: could not even spawn, counted as another failure of this generation
                self._on_failure(gen, f"restart failed: {exc!r}", traceback.format_exc())
                return
            t_spawned = time.time()
            await self._wait_ready(gen)
            self.last_restart_seconds = time.time() - t0
            # where the restart's time went: stopping the failed mesh, spawning the new one, building the models
            phases = {"stop": t_stopped - t0, "spawn": t_spawned - t_spawn, "build": time.time() - t_spawned}
            # warm_spare: every new proc really was a claimed spare (the pool may have been empty or still
            # starting); not whether spares were configured, which would read true for a cold restart
            claimed = await self._spares_claimed()
            self.emit("restart_done", generation=gen, seconds=self.last_restart_seconds,
                      warm_spare=claimed is not None and claimed == self.cfg.procs_per_replica,
                      spares_claimed=claimed, warm_spares_enabled=bool(self.cfg.warm_spares),
                      action=action.value, phases={k: round(v, 3) for k, v in phases.items()})

    async def _spares_claimed(self) -> int | None:
        """How many of the new trainer procs were claimed warm spares; None when that is not known."""
        procs = self.procs
        if procs is None:
            return None
        try:
            await asyncio.wait_for(as_awaitable(procs.initialized), timeout=10)
        except Exception:  # noqa: BLE001 - a mesh that failed to start is supervision's to report; here: unknown
            return None
        return procs.spares_claimed

    async def _wait_ready(self, gen: int, timeout: float = 300.0) -> None:
        """Until every new trainer has its model built (processes started, torch imported, CUDA up), so that
        `restart_done` marks the end of the respawn and the wait for the quorum is counted separately."""
        deadline = time.time() + timeout
        while time.time() < deadline and gen == self.policy.generation and self.trainers is not None:
            try:
                steps = await asyncio.wait_for(as_awaitable(self.trainers.ping.call()), timeout=10)
            except asyncio.TimeoutError:
                continue
            except Exception:  # noqa: BLE001 - the new mesh failed already: its failure reaches __supervise__ on its own
                return  # the new mesh failed already: supervision takes over
            if all(v >= 0 for _, v in steps.items()):
                return
            await asyncio.sleep(0.1)

    async def _check_allocation(self, action: Action) -> Action:
        """Before an in-place restart: is this replica's allocation still there? A cancelled, preempted,
        timed-out or failed allocation (or one whose node went down) cannot host a restart, so go to a fresh
        one now instead of after K failed in-place starts."""
        job = self.job
        if job is None or not hasattr(job, "problem"):
            return action
        try:
            problem = await asyncio.to_thread(job.problem)
        except Exception as exc:  # noqa: BLE001 - reported; the scheduler did not answer: try in place, a failed start still leads to reallocation
            logger.warning("replica %d: cannot ask the scheduler about %s: %r", self.index, job.describe(), exc)
            return action
        new_action = allocation_checked(action, problem)
        if new_action is not action:
            logger.warning("replica %d: %s; asking for a fresh allocation", self.index, problem)
            self.emit("allocation_lost", job=job.describe(), job_id=getattr(job, "job_id", None), reason=problem)
        return new_action

    async def _reallocate(self) -> None:
        """Ask the job layer for a fresh single-host allocation for this replica."""
        await self._allocate()

    async def _allocate(self) -> None:
        from regent.jobs import make_job
        from regent.orchestrate.allocation import plan_allocation

        old = self.job
        t0 = time.time()
        plan = await asyncio.to_thread(plan_allocation, self.cfg.job, self.cfg.procs_per_replica,
                                       self.cfg.job_options)
        job = make_job(self.cfg.job, 1, name=f"regent-replica-{self.index}", **plan.options)
        logger.info("replica %d: asking %s for a host with %s GPU(s) (%s)", self.index, self.cfg.job,
                    plan.gpus_per_host or 0, plan.gpus_reason)
        try:
            await asyncio.to_thread(job.start)
            from regent.jobs.base import Job

            # a scheduler's allocation may wait in a queue (bounded); local worker processes start at once
            host = await asyncio.to_thread(job.host_mesh, plan.timeout_s) if isinstance(job, Job) else \
                await asyncio.to_thread(job.host_mesh)
        except BaseException:
            await asyncio.to_thread(job.kill)  # a pending or half-started allocation must not leak
            raise
        self.job, self.host = job, host
        self._spares_started = False  # started again on the new host once its trainers are up
        if old is not None:
            await asyncio.to_thread(old.kill)
        # `release`: how a resumed controller frees it if this process dies without kill() (orchestrate/resume.py)
        reference = getattr(job, "reference", None)
        self.emit("allocation", backend=self.cfg.job, seconds=time.time() - t0, job=job.describe(),
                  job_id=getattr(job, "job_id", None), gpus_per_host=plan.gpus_per_host,
                  previous=old.describe() if old is not None else None,
                  release=reference() if callable(reference) else None)

    @endpoint
    async def full_restart(self, checkpoint_dir: str | None) -> float:
        """Checkpoint-restart baseline: stop this replica's trainers and start them from the checkpoint."""
        async with self.lock:
            t0 = time.time()
            self.emit("restart_started", action="full_restart")
            await self._stop_trainers()
            self.resume_from = checkpoint_dir
            gen = self.policy.restart_finished()
            await self._start_attempt()
            await self._wait_ready(gen)
            self.emit("restart_done", generation=gen, seconds=time.time() - t0, full_restart=True,
                      action="full_restart")
            return time.time() - t0

    async def _liveness_watchdog(self) -> None:
        """A trainer that stops answering (SIGSTOP, a thread holding the GIL) is a failure too.

        One ping is in flight at a time (answered by every rank), the next `faults.ping_every_s` after an
        answer. How long it may stay unanswered adapts to this replica's own ping latency and step time
        (orchestrate/hang.py): a few seconds on a responsive machine, at most `faults.hang_timeout`, and a long
        start-up allowance until a generation has answered ready (a cold process importing torch can hold the
        GIL for many seconds on a loaded machine). A declared hang goes through `_on_failure` like any failure:
        `failure_detected` makes the orchestrator tell the peers and the Lighthouse at once.
        """
        from regent.orchestrate.hang import HangDetector, HangRule

        detector = HangDetector(HangRule.from_faults(self.cfg.faults))
        every = float(self.cfg.faults.ping_every_s)
        tick = min(0.25, every)  # how often an unanswered ping is checked against the deadline
        inflight: _Ping | None = None
        last_answer = 0.0
        while not self.finished:
            await asyncio.sleep(tick)
            trainers, gen = self.trainers, self.policy.generation
            if inflight is not None and (trainers is None or self.policy.restarting
                                         or inflight.trainers is not trainers):
                inflight.drop()  # its mesh is being replaced: a late answer means nothing
                inflight = None
            if trainers is None or self.policy.restarting:
                continue
            detector.start_generation(gen)
            now = time.monotonic()
            if inflight is None:
                if now - last_answer >= every:
                    inflight = _Ping(trainers, gen)
                continue
            if inflight.task.done():
                ping, inflight = inflight, None
                try:
                    steps, latency = ping.task.result()
                except Exception:  # noqa: BLE001 - a dead mesh: its failure reaches __supervise__ on its own
                    continue  # a dead mesh: __supervise__ handles it
                last_answer = time.monotonic()
                detector.on_answer(ping.generation, latency, [v for _, v in steps.items()], last_answer)
                if not self._spares_started and detector.ready:
                    self._start_spares()
                continue
            silent = now - inflight.sent
            if detector.is_hung(silent) and not self.finished:
                inflight.drop()
                inflight = None
                self._on_failure(gen, f"trainer unresponsive for {silent:.1f}s (hung; {detector.explain()})", "")

    @endpoint
    async def inject_fault(self, kind: str, rank: int) -> bool:
        """Deliver a fault to one trainer (for `node` and `correlated`, to every process of this replica).

        `straggler` pauses the trainer's process (SIGSTOP) for `faults.straggler_s`, then resumes it (SIGCONT):
        from here when the trainer runs on this host, else by a helper process next to the trainer."""
        trainers = self.trainers
        if trainers is None or self.policy.restarting:
            return False
        if kind in ("node", "correlated"):
            trainers.inject.broadcast("kill")
        elif kind == "straggler":
            target = trainers.slice(gpus=rank % self.cfg.procs_per_replica)
            seconds = float(self.cfg.faults.straggler_s)
            try:
                where = await as_awaitable(target.inject.call_one("straggler"))
            except Exception:  # noqa: BLE001 - that trainer is failing already: its failure reaches __supervise__
                return False
            if where["host"] == socket.gethostname():
                _pause_process(where["pid"], seconds)
            else:
                target.inject.broadcast("straggler_self", seconds)
        else:
            trainers.slice(gpus=rank % self.cfg.procs_per_replica).inject.broadcast(kind)
        return True

    @endpoint
    async def know_peers(self, replicas: Any) -> None:
        self.peers = replicas

    def _tell_peers_directly(self) -> None:
        """No controller is attached to fan this failure out: tell the peers (what the controller's `_tell_peers`
        does), so they drop their collectives with this replica at once instead of after `--ft.timeout-s`."""
        peers = self.peers
        if peers is None:
            return
        for q in range(self.cfg.replicas):
            if q == self.index:
                continue
            try:
                peers.slice(replicas=q).peer_failed.broadcast(self.index)
            except Exception as exc:  # noqa: BLE001 - reported; that peer then waits out its collective timeout
                logger.warning("replica %d: telling replica %d about its own failure: %r", self.index, q, exc)
        logger.warning("replica %d: told its peers of its failure itself (no controller attached)", self.index)

    @endpoint
    async def peer_failed(self, replica_index: int, group: str | None = None) -> None:
        """Replica `replica_index` failed (with `group`: that build of its replicated group did): tell this
        replica's trainers (see `Manager.peer_failed`)."""
        trainers = self.trainers
        if trainers is not None and not self.policy.restarting:
            trainers.peer_failed.broadcast(f"replica_{replica_index}:", group)
        else:  # this replica is restarting: its next trainers join a new quorum, no collective to fail
            logger.info("replica %d: notice of replica %d's failure (group %s) not passed on: restarting",
                        self.index, replica_index, group)

    @endpoint
    async def digest_committed(self, step: int) -> bool:
        """Another replica copied the committed state of `step`: have this replica's trainers digest theirs to
        check the copy (`TrainerActor.digest_committed`). False when it is restarting (it holds no state)."""
        trainers = self.trainers
        if trainers is None or self.policy.restarting:
            return False
        trainers.digest_committed.broadcast(step)
        return True

    @endpoint
    async def stop_diverged(self, generation: int, reason: str) -> bool:
        """The state vote found this replica's state different from the majority's: stop its trainers now and
        restart them in place, which heals them from a live majority member (a failure like any other, reported
        as `failure_detected` with the reason). False when that generation is no longer the live one."""
        if generation != self.policy.generation or self.trainers is None or self.policy.restarting:
            return False
        self._on_failure(generation, f"state diverged: {reason}", "", rank=None)
        return True

    @endpoint
    async def heal_at_end(self, reason: str) -> bool:
        """The final comparison found this replica's state different from the majority's (a flip after the last
        vote): restart its trainers now. They know the stop step, pull the committed state from a finished peer
        (peers serve it until `release`) and stop there at once, so `finish` can collect the final state again.
        False when it cannot be restarted (it gave up, ended failed, or is restarting already)."""
        error = f"state diverged: {reason}"
        return await self._restart_at_end(lambda gen: self.emit("failure_detected", error=error, traceback="",
                                                                rank=None, generation=gen, final=True), error)

    @endpoint
    async def catch_up_at_end(self, reason: str) -> bool:
        """The other replicas committed the run's last sync without this one (it reached the boundary after
        their quorum formed: a replica that joined the round late), so it waits for a quorum nobody will join.
        Restart its trainers like `heal_at_end`: they pull the final committed state from a finished peer and
        stop there. Recorded as `left_behind` (no failure: nothing failed). False when it cannot be restarted."""
        return await self._restart_at_end(
            lambda gen: self.emit("left_behind", reason=reason, stop_step=self.stop_target, generation=gen),
            f"left behind at the stop step: {reason}")

    async def _restart_at_end(self, report: Any, error: str) -> bool:
        gen = self.policy.generation
        if self.ended_failed or self.policy.gave_up or self._restart_in_flight() or self.stop_target is None:
            return False
        action = self.policy.on_failure(gen)
        if action not in (Action.RESTART_IN_PLACE, Action.REALLOCATE):
            return False
        self._healing_at_end = True
        self.finished = False  # set again by the new generation's `training_finished`
        self.last_error = error
        report(gen)
        self._restart_task = asyncio.get_running_loop().create_task(self._stop_and_restart(action))
        await self._restart_task
        if self._watchdog is None or self._watchdog.done():  # it ended with `finished`: a hang must still be seen
            self._watchdog = asyncio.get_running_loop().create_task(self._liveness_watchdog())
        return self.trainers is not None and not self.ended_failed

    @endpoint
    async def end_diverged(self, reason: str) -> None:
        """The final comparison found this replica's state different from the majority's after training ended
        (a flip after the last vote): it ends here as failed, like a failure while the run stops, and its state
        is left out; the majority holds the committed state."""
        self.ended_failed = True
        self.last_error = reason
        self.emit("failure_detected", error=f"state diverged: {reason}", traceback="", rank=None)
        self.emit("ended_failed", error=f"state diverged: {reason}", stop_step=self.stop_target)

    @endpoint
    async def request_stop(self, at_step: int) -> None:
        self.stop_target = at_step
        trainers = self.trainers
        if trainers is not None:
            trainers.stop_at.broadcast(at_step)

    # Concurrent: it waits (up to `timeout`) for the stop step, and the messages behind it must not wait with
    # it: a peer's failure notice held there reached the trainers after their collective had timed out.
    @concurrent_endpoint
    async def finish(self, timeout: float) -> dict[str, Any]:
        """Wait for the trainers to reach the stop step and collect the final state hash. The trainers stay
        up, still serving their committed state to replicas that are behind, until `release()`."""
        deadline = time.time() + timeout
        result: dict[str, Any] = {"replica": self.index, "step": None, "digest": None}
        last_error: Exception | None = None
        while time.time() < deadline:
            trainers = self.trainers
            what = at_the_end(gave_up=self.policy.gave_up, ended_failed=self.ended_failed,
                              restarting=self._restart_in_flight(), trainers_up=trainers is not None)
            if what == "done":
                break
            if what == "wait" or trainers is None:  # ("ask" only with trainers: this narrows the type)
                await asyncio.sleep(0.5)
                continue
            try:
                vm = await asyncio.wait_for(as_awaitable(trainers.final_state.call()), timeout=5)
            except Exception as exc:  # noqa: BLE001 - retried until the deadline; the last error is reported below
                last_error = exc
                await asyncio.sleep(0.5)
                continue
            states = [v for _, v in vm.items()]
            if all(s is not None for s in states):
                result.update(final_of_ranks(states))
                break
            await asyncio.sleep(0.5)
        if result["digest"] is None and last_error is not None:
            logger.warning("replica %d: no final state (waited up to %.0fs); last error: %r", self.index, timeout,
                           last_error)
        return result

    def _restart_in_flight(self) -> bool:
        """A restart has been decided and has not yet brought up its trainers (the policy's flag clears just
        before the respawn, the task's end marks it done)."""
        task = self._restart_task
        return self.policy.restarting or (task is not None and not task.done())

    @endpoint
    async def release(self) -> None:
        """The run is over: stop the trainers (gracefully) and the watchdog, and cut short a restart that
        `finish` gave up waiting for (it would otherwise spawn trainers after this)."""
        self.finished = True
        if self._watchdog:
            self._watchdog.cancel()
        task = self._restart_task
        if task is not None and not task.done():
            logger.warning("replica %d: the run is over while it was still restarting; restart cancelled", self.index)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception) as exc:  # noqa: BLE001 - reported just above; stopping anyway
                logger.debug("replica %d: cancelled restart ended with %r", self.index, exc)
        await self._stop_trainers(graceful=True)

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.job is not None:
            try:
                await asyncio.to_thread(self.job.kill)
            except Exception as err:  # noqa: BLE001 - reported; the actor is stopping either way
                logger.error("replica %d: releasing %s failed, the allocation may leak: %r",
                             self.index, self.job.describe(), err)


def final_of_ranks(states: list[dict[str, Any]]) -> dict[str, Any]:
    """A replica's final state from its ranks' (in rank order): one digest over every rank's, the common step
    (None, with `steps`, when the ranks disagree on it)."""
    from regent.ft.digest import combine_rank_digests

    states = sorted(states, key=lambda s: s.get("rank", 0))
    steps = sorted({s.get("step") for s in states}, key=str)
    digests = [s.get("digest") for s in states]
    return {"step": steps[0] if len(steps) == 1 else None, "steps": steps,
            "manager_step": states[0].get("manager_step"), "ranks": len(states),
            "digest": combine_rank_digests(digests) if all(digests) else None, "rank_digests": digests,
            "rank_parts": [s.get("parts") for s in states]}


async def as_awaitable(x: Any) -> Any:
    """Await a regent Future (or anything awaitable); plain values pass through. One helper for the replica
    supervisor and the controller (`regent.orchestrate.run`), which both await what actor calls return."""
    if hasattr(x, "__await__"):
        return await x
    return x


def replica_gpu_env(replica_index: int, procs_per_replica: int, environ: dict[str, str],
                    device_count: int | None = None) -> dict[str, str]:
    """The visibility list that gives replica i of a shared host GPUs [i*G, (i+1)*G) of the host's GPUs.

    The process spawner pins trainer g to entry g of its own process's visibility list
    (`regent.platform.child_visibility_env`), so setting this list in the replica's process before spawning
    is enough, for warm spares too. Without it every replica's rank g would use GPU g, and two replicas on
    one GPU cannot build an NCCL group ("duplicate GPU"). Entries wrap around when replicas x G exceeds the
    GPUs. Empty on CPU. ROCm builds honour CUDA_VISIBLE_DEVICES as HIP does.
    """
    from regent import platform

    forced = settings.GPU_PLATFORM.get(environ) or ""
    if (forced or platform.torch_build_platform()) == "cpu":
        return {}
    names = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    name = next((n for n in names if environ.get(n, "").strip()), "CUDA_VISIBLE_DEVICES")
    if environ.get(name, "").strip():
        visible = [v.strip() for v in environ[name].split(",") if v.strip()]
    else:
        if device_count is None:
            import torch

            device_count = torch.cuda.device_count()
        visible = [str(i) for i in range(device_count)]
    if not visible:
        return {}
    chosen = [visible[(replica_index * procs_per_replica + g) % len(visible)] for g in range(procs_per_replica)]
    return {name: ",".join(chosen)}


class _Ping:
    """One liveness ping in flight to every rank of a trainer mesh, timed from when it was sent."""

    def __init__(self, trainers: Any, generation: int) -> None:
        self.trainers = trainers
        self.generation = generation
        self.sent = time.monotonic()
        self.task = asyncio.get_running_loop().create_task(_timed_ping(trainers))

    def drop(self) -> None:
        """Stop waiting for the answer (the mesh is being replaced, or was declared hung)."""
        self.task.cancel()


async def _timed_ping(trainers: Any) -> tuple[Any, float]:
    """Every rank's step and the round-trip time, measured when the answer arrives (not at the next tick)."""
    t0 = time.monotonic()
    steps = await as_awaitable(trainers.ping.call())
    return steps, time.monotonic() - t0


def _pause_process(pid: int, seconds: float) -> None:
    """A straggler: stop process `pid` now and let it go on after `seconds` (a timer on this loop)."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    asyncio.get_running_loop().call_later(seconds, _resume_process, pid)


def _resume_process(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # it was stopped for good in the meantime (a restart or the end of the run): nothing to resume
