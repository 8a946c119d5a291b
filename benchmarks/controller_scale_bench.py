"""The controller at 100k GPUs (issue 37, item 4): the orchestrator's own code paths fed what 12,800 replica
groups of 8 processes send it, without launching them.

    PYTHONPATH=src .venv/bin/python benchmarks/controller_scale_bench.py                      # 1,280 and 12,800
    PYTHONPATH=src .venv/bin/python benchmarks/controller_scale_bench.py --groups 12800 --steps 20

What a group sends the controller (`trainer_actor._event`, `OrchestrationManager.drain`): per step one metric
record and one "commit" event (rank 0 of the group); per fault `failure_detected`, `restart_started`,
`restart_done`, `heal_started`, `heal_done`, and every group's "quorum" event for the new membership (compact
answers: a member count, no names). Those go through the real `OrchestrationManager.record_metric` /
`record_event` (events.jsonl and metrics.jsonl written, the live view's state, metric sinks, vote bookkeeping).
Every 0.25 s of simulated time the supervision loop's own work runs as `_supervise_run` does it
(`display.refresh`, `_decide_votes`), and the terminal view (`RunView.render`, printed by rich into a null
console) is timed once per step. At the end, `write_summary` (summary, invariants, report), which reads the
files back.

Reported: controller CPU per metric record and per event, per supervision tick and per render, the end-of-run
summary's CPU and the process's peak RSS growth, and the rates 12,800 groups need (records/s at the given
steps/s) against what one core does at the measured cost. Writes benchmarks/results/controller_scale_bench.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def _cpu() -> float:
    return time.thread_time()


def run_controller_load(groups: int, steps: int, faults_per_step: float = 0.5, render: bool = True,
                        summary: bool = True, run_dir: str | None = None) -> dict[str, Any]:
    """Feed one `OrchestrationManager` `steps` steps of `groups` groups; returns counts and CPU figures."""
    from rich.console import Console

    from regent.orchestrate.config import RunConfig
    from regent.orchestrate.events import make_event
    from regent.orchestrate.run import OrchestrationManager

    tmp = None
    if run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="regent-ctl-bench-")
        run_dir = tmp.name
    cfg = RunConfig(replicas=groups, procs_per_replica=8, run_dir=str(Path(run_dir) / "run"), live=False)
    mgr = OrchestrationManager(cfg)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    null = Console(file=io.StringIO(), width=160, force_terminal=False)
    t0 = 1_800_000_000.0
    gen = [0] * groups
    quorum_id = 1
    fault_debt = 0.0
    out: dict[str, Any] = {"groups": groups, "steps": steps, "faults_per_step": faults_per_step}
    cpu = {"metric": 0.0, "event_commit": 0.0, "event_fault": 0.0, "event_quorum": 0.0, "tick": 0.0,
           "render": 0.0}
    counts = {"metric": 0, "event_commit": 0, "event_fault": 0, "event_quorum": 0, "tick": 0, "render": 0}
    stdout = sys.stdout
    sys.stdout = io.StringIO()  # the plain view prints a line every 10 s: measured, not shown
    try:
        for step in range(1, steps + 1):
            t = t0 + step
            c = _cpu()
            for r in range(groups):
                mgr.record_metric({"time": t, "replica": r, "rank": 0, "generation": gen[r], "step": step,
                                   "manager_step": step, "quorum_id": quorum_id, "committed": True,
                                   "loss": 2.0 + 1.0 / step, "tokens_per_s": 12345.0, "step_s": 0.9})
            cpu["metric"] += _cpu() - c
            counts["metric"] += groups
            c = _cpu()
            for r in range(groups):
                mgr.record_event(make_event("commit", replica=r, generation=gen[r], quorum_id=quorum_id, step=step,
                                            t=t, rank=0, manager_step=step, committed=True))
            cpu["event_commit"] += _cpu() - c
            counts["event_commit"] += groups
            fault_debt += faults_per_step
            while fault_debt >= 1.0:
                fault_debt -= 1.0
                r = (step * 7919 + int(fault_debt * 1000)) % groups
                c = _cpu()
                mgr.record_event(make_event("failure_detected", replica=r, generation=gen[r], t=t,
                                            error="process exited with code -9"))
                mgr.record_event(make_event("restart_started", replica=r, generation=gen[r], t=t, action="restart"))
                gen[r] += 1
                mgr.record_event(make_event("restart_done", replica=r, generation=gen[r], t=t, seconds=3.0))
                mgr.record_event(make_event("heal_started", replica=r, generation=gen[r], t=t,
                                            donor=(r + 1) % groups))
                mgr.record_event(make_event("heal_done", replica=r, generation=gen[r], t=t, donor=(r + 1) % groups,
                                            manager_step=step, bytes=1 << 30, seconds=2.0))
                cpu["event_fault"] += _cpu() - c
                counts["event_fault"] += 5
                quorum_id += 1
                c = _cpu()
                for q in range(groups):
                    mgr.record_event(make_event("quorum", replica=q, generation=gen[q], quorum_id=quorum_id, t=t,
                                                rank=0, members=groups, manager_step=step))
                cpu["event_quorum"] += _cpu() - c
                counts["event_quorum"] += groups
            for _ in range(4):  # the supervision loop wakes every 0.25 s
                c = _cpu()
                mgr.display.refresh()
                mgr._decide_votes()
                cpu["tick"] += _cpu() - c
                counts["tick"] += 1
            if render:
                c = _cpu()
                null.print(mgr.view.render())
                cpu["render"] += _cpu() - c
                counts["render"] += 1
                null.file = io.StringIO()
    finally:
        sys.stdout = stdout
    mgr.events.close()
    mgr.metrics.close()
    out["lines"] = {name: (Path(cfg.run_dir) / name).read_bytes().count(b"\n")
                    for name in ("events.jsonl", "metrics.jsonl")}
    out["counts"] = counts
    out["cpu_s"] = cpu
    out["us_per"] = {k: 1e6 * cpu[k] / counts[k] for k in cpu if counts[k]}
    if summary:
        sys.stdout = io.StringIO()
        try:
            c = _cpu()
            s = mgr.write_summary()
            out["summary_cpu_s"] = _cpu() - c
        finally:
            sys.stdout = stdout
        out["summary_steps_committed"] = s.get("steps_committed")
    out["peak_rss_growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    mgr.sinks.close()
    if tmp is not None:
        tmp.cleanup()
    return out


def per_second_needs(row: dict[str, Any], steps_per_s: float) -> dict[str, float]:
    """The controller's share of one core at `steps_per_s` for `row`'s size, from its measured costs: a metric
    record and a commit event per group and step, plus the supervision loop's 4 ticks a second and, on a
    terminal, the live view's 4 renders a second (faults left out: they depend on the fault rate)."""
    us = row["us_per"]
    intake = steps_per_s * row["groups"] * (us["metric"] + us["event_commit"])
    return {"steps_per_s": steps_per_s, "records_per_s": 2 * row["groups"] * steps_per_s,
            "core_share": (intake + 4 * us["tick"] + 4 * us.get("render", 0.0)) / 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[1280, 12800])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--faults-per-step", type=float, default=0.5)
    parser.add_argument("--no-render", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results" / "controller_scale_bench.json"))
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    rows = []
    for g in args.groups:
        row = run_controller_load(g, args.steps, args.faults_per_step, render=not args.no_render)
        row["load_avg"] = os.getloadavg()[0]
        row["needs"] = [per_second_needs(row, s) for s in (0.5, 1.0, 2.0)]
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; rows in {args.out}")
    print("| groups | metric us | commit event us | fault event us | quorum event us | tick ms | render ms | "
          "summary s | RSS growth MB | core share at 1 step/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        us = r["us_per"]
        print(f"| {r['groups']:,} | {us['metric']:.1f} | {us['event_commit']:.1f} | {us.get('event_fault', 0):.1f} | "
              f"{us.get('event_quorum', 0):.1f} | {us['tick'] / 1e3:.2f} | {us.get('render', 0) / 1e3:.1f} | "
              f"{r.get('summary_cpu_s', 0):.1f} | {r['peak_rss_growth_mb']:.0f} | "
              f"{r['needs'][1]['core_share']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
