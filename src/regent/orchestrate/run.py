"""OrchestrationManager: the controller of the case study.

It starts a LighthouseActor and N ReplicaActors, runs the fault injector, writes the run directory, and stops
everything cleanly at the end or on Ctrl-C. Events and metrics flow back to it through one port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from regent.actor import Channel, this_host
from regent.orchestrate.config import RunConfig
from regent.orchestrate.events import JsonlWriter, make_event, read_jsonl
from regent.orchestrate.faults import RandomFaultSchedule, ReplayFaultSchedule, fault_record
from regent.orchestrate.live import LiveDisplay, RunView
from regent.orchestrate.summary import compute_summary, healthy_step_rate

logger = logging.getLogger(__name__)


class OrchestrationManager:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        if (self.run_dir / "events.jsonl").exists():
            # A run directory holds one run: keep the previous one next to it rather than appending to it.
            kept = self.run_dir.with_name(f"{self.run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
            self.run_dir.rename(kept)
            print(f"[regent] {self.run_dir} held an earlier run; moved it to {kept}", flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = JsonlWriter(self.run_dir / "events.jsonl")
        self.metrics = JsonlWriter(self.run_dir / "metrics.jsonl")
        self.faults_log = JsonlWriter(self.run_dir / "faults.jsonl")
        self.view = RunView(cfg.replicas)
        self.display = LiveDisplay(self.view, cfg.live)
        self.max_step = 0
        self.t_start = time.time()
        self.t_train: float | None = None  # the first step: the fault clock starts here, after start-up
        self.healthy_since: dict[int, float | None] = {r: None for r in range(cfg.replicas)}
        self.full_restart_pending = False
        self.stop_requested_at: int | None = None
        self.final_states: list[dict[str, Any]] = []
        self.finished_replicas: set[int] = set()
        self._replicas: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._told_group_failed: set[tuple[int, str | None]] = set()
        self._lighthouse: Any = None
        self._replica_ids: dict[int, dict[str, int]] = {}  # replica -> {Lighthouse id seen: its generation}

    # -- event intake ---------------------------------------------------------------------------------
    def record_event(self, e: dict[str, Any]) -> None:
        self.events.write(e)
        line = self.view.on_event(e)
        self.display.feed_line(line)
        r = e.get("replica")
        if r is not None and e.get("replica_id") and e.get("generation") is not None:
            self._replica_ids.setdefault(r, {})[e["replica_id"]] = e["generation"]
        if e["kind"] in ("failure_detected", "gave_up", "restart_started") and r is not None:
            self.healthy_since[r] = None
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
        except Exception as exc:  # the Lighthouse still times them out; slower, not wrong
            logger.warning("telling the Lighthouse that replica %d failed: %r", failed, exc)

    async def _tell_peers(self, failed: int, group: str | None = None) -> None:
        for q in range(self.cfg.replicas):
            if q != failed:
                try:
                    await self._replicas.slice(replicas=q).peer_failed.call_one(failed, group)
                except Exception as exc:  # that replica may be failing too; its own supervisor handles it
                    logger.debug("telling replica %d about replica %d: %r", q, failed, exc)

    def record_metric(self, m: dict[str, Any]) -> None:
        self.metrics.write(m)
        self.view.on_metric(m)
        r = m.get("replica")
        if r is not None and self.healthy_since.get(r) is None:
            self.healthy_since[r] = time.time()
        self.max_step = max(self.max_step, m.get("step", 0))
        if self.t_train is None:
            self.t_train = time.time()

    async def drain(self, receiver: Any) -> None:
        while True:
            kind, payload = await receiver.recv()
            if kind == "event":
                self.record_event(payload)
            elif kind == "metric":
                self.record_metric(payload)

    # -- main -----------------------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.cfg
        (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
        port, receiver = Channel.open()
        drain = asyncio.get_running_loop().create_task(self.drain(receiver))
        self.record_event(make_event("run_started", replicas=cfg.replicas, procs_per_replica=cfg.procs_per_replica,
                                     mode=cfg.ft.mode, recovery=cfg.recovery))
        host = this_host()
        lh_procs = host.spawn_procs(per_host={"lighthouse": 1})
        from regent.orchestrate.lighthouse_actor import LighthouseActor

        lighthouse = lh_procs.spawn("lighthouse", LighthouseActor)
        self._lighthouse = lighthouse
        lc = cfg.lighthouse
        if lc.address:
            addr, dashboard = lc.address, ""
        else:
            info = await lighthouse.start_lighthouse.call_one(lc.bind, min(lc.min_replicas, cfg.replicas), lc.join_timeout_ms,
                                                   lc.quorum_tick_ms, lc.heartbeat_timeout_ms,
                                                   str(self.run_dir / "lighthouse.state"))
            addr, dashboard = info["address"], info["dashboard"]
        self.view.dashboard = dashboard
        print(f"[regent] run directory {self.run_dir}", flush=True)
        print(f"[regent] Lighthouse {addr}  dashboard {dashboard}", flush=True)

        from regent.orchestrate.replica import ReplicaActor

        rep_procs = host.spawn_procs(per_host={"replicas": cfg.replicas})
        replicas = rep_procs.spawn("replica", ReplicaActor, cfg, addr, port)
        self._replicas = replicas
        await asyncio.gather(*[replicas.slice(replicas=r).start.call_one(replicas.slice(replicas=r))
                               for r in range(cfg.replicas)])
        self.t_start = time.time()
        code = 0
        try:
            with self.display:
                await self._supervise_run(replicas)
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("[regent] interrupted: stopping every replica now", flush=True)
            code = 130
        finally:
            if code == 0:
                await self._finish(replicas)  # stop at a common sync boundary and compare the replicas
            drain.cancel()
            for mesh in (rep_procs, lh_procs):
                try:
                    await asyncio.wait_for(_aw(mesh.stop()), timeout=30)
                except Exception as exc:
                    logger.warning("stopping %s: %r", mesh, exc)
            self.record_event(make_event("run_finished"))
            self.write_summary()
        return code

    def _schedule(self) -> Any:
        f = self.cfg.faults
        if not f.enabled:
            return None
        if f.file:
            return ReplayFaultSchedule.from_file(f.file)
        return RandomFaultSchedule(f.kinds, f.every, f.warmup, f.holdoff, self.cfg.procs_per_replica,
                                   seed=self.cfg.seed)

    def _done(self) -> bool:
        cfg = self.cfg
        if cfg.steps is not None:
            return self.max_step >= cfg.steps
        return time.time() - self.t_start >= (cfg.duration or 0)

    async def _supervise_run(self, replicas: Any) -> None:
        schedule = self._schedule()
        while not self._done():
            await asyncio.sleep(0.25)
            self.display.refresh()
            if self.t_train is None:
                continue
            now = time.time() - self.t_train
            if schedule is not None and schedule.due(now) and not self.full_restart_pending:
                fault = schedule.pick(now, since_first_step(self.healthy_since, self.t_train))
                if fault is not None:
                    self.faults_log.write(json.loads(fault_record(fault)))
                    target = replicas.slice(replicas=fault.replica)
                    delivered = await target.inject_fault.call_one(fault.kind, fault.rank)
                    if delivered:
                        self.record_event(make_event("fault_injected", replica=fault.replica,
                                                     fault_kind=fault.kind, rank=fault.rank, step=self.max_step))
            if self.full_restart_pending:
                await self._full_restart(replicas)
            if all(v.status == "gave up" for v in self.view.reps.values()):
                print("[regent] every replica gave up; stopping", flush=True)
                break

    async def _full_restart(self, replicas: Any) -> None:
        """The checkpoint-restart baseline: every replica stops and reloads the last checkpoint."""
        await asyncio.sleep(0.5)  # let the other replicas' failure reports of the same fault arrive
        self.full_restart_pending = False
        ckpt = str(self.run_dir / "checkpoints")
        await replicas.full_restart.call(ckpt)
        self.full_restart_pending = False

    async def _finish(self, replicas: Any) -> None:
        """Stop at a common sync boundary so the replicas can be compared bit for bit."""
        cfg = self.cfg
        h = cfg.ft.sync_every if cfg.ft.mode == "diloco" else 1
        target = cfg.steps if cfg.steps is not None else self.max_step + 1
        target = int(math.ceil(max(target, 1) / h) * h)
        self.stop_requested_at = target
        # long enough for the slowest replica to reach the boundary at the pace seen so far
        rate = healthy_step_rate(list(read_jsonl(self.run_dir / "metrics.jsonl")),
                                 list(read_jsonl(self.run_dir / "events.jsonl"))) or 0.1
        wait = max(120.0, 3 * h / rate + 60)
        try:
            await replicas.request_stop.call(target)
            vm = await asyncio.wait_for(_aw(replicas.finish.call(wait)), timeout=wait + 60)
            self.final_states = [v for _, v in vm.items()]
        except Exception as exc:
            logger.warning("finishing replicas: %r", exc)

    def write_summary(self) -> dict[str, Any]:
        events = list(read_jsonl(self.run_dir / "events.jsonl"))
        metrics = list(read_jsonl(self.run_dir / "metrics.jsonl"))
        finals = [s for s in self.final_states if s and s.get("hash")]
        consistent = None
        if finals:
            top = max(s["step"] for s in finals)
            hashes = {s["hash"] for s in finals if s["step"] == top}
            consistent = len(hashes) == 1
        baseline_rate = None
        if self.cfg.baseline:
            b = Path(self.cfg.baseline)
            baseline_rate = healthy_step_rate(list(read_jsonl(b / "metrics.jsonl")), list(read_jsonl(b / "events.jsonl")))
        summary = compute_summary(events, metrics, replicas=self.cfg.replicas, replicas_consistent=consistent,
                                  baseline_rate=baseline_rate, recovery_mode=self.cfg.recovery)
        summary["final_states"] = self.final_states
        summary["baseline"] = self.cfg.baseline
        summary["full_restarts"] = summary["full_restarts"] if self.cfg.recovery == "restart" else 0
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        try:
            from regent.orchestrate.report import write_report

            write_report(self.run_dir, baseline=self.cfg.baseline)
        except Exception as exc:  # the report is a convenience; the data is already on disk
            logger.warning("report generation failed: %r", exc)
        s = summary
        print(
            f"[regent] done: {s['steps_committed']} steps, faults {s['faults_injected']}, recoveries "
            f"{s['recoveries']}, max quorum id {s['max_quorum_id']}, loss {s['initial_loss']} -> {s['final_loss']}, "
            f"consistent={s['replicas_consistent']}, goodput={s['goodput']}",
            flush=True,
        )
        print(f"[regent] report: {self.run_dir / 'report.html'}", flush=True)
        return summary


def since_first_step(healthy_since: dict[int, float | None], t_train: float) -> dict[int, float | None]:
    """`healthy_since` (wall-clock times) on the fault schedule's clock, which starts at the first step.

    Passing wall-clock times to `schedule.pick` made `now - since` hugely negative: no replica was ever
    eligible, and a run injected no faults at all.
    """
    return {r: (since - t_train if since is not None else None) for r, since in healthy_since.items()}


async def _aw(x: Any) -> Any:
    if hasattr(x, "__await__"):
        return await x
    return x


def run(cfg: RunConfig) -> int:
    import faulthandler

    faulthandler.enable()  # a native crash in the controller leaves its Python stacks on stderr
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(OrchestrationManager(cfg).run())
    except KeyboardInterrupt:
        return 130
