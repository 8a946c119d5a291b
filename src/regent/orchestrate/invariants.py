"""Invariants a finished run directory must satisfy; `python -m regent.orchestrate.invariants RUN_DIR`.

A run can finish, print a goodput and still be wrong: training silently thrown away, replicas that disagree,
processes left behind, memory that only grows. These checks read only the run directory, so they apply to
any run, old or new, and to runs on machines we cannot log into.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from regent.orchestrate.events import read_jsonl
from regent.orchestrate.summary import (
    RESET_MATCH_S,
    checkpoint_restarts,
    progress_drops,
    progress_key,
    state_lost_groups,
    sync_round,
)

RSS_GROWTH_FACTOR = 2.0
RSS_GROWTH_MB = 200.0


def check_run(run_dir: str | Path) -> list[str]:
    """Every violation found in `run_dir` (events.jsonl, metrics.jsonl, summary.json); empty when fine."""
    run = Path(run_dir)
    events = list(read_jsonl(run / "events.jsonl"))
    metrics = list(read_jsonl(run / "metrics.jsonl"))
    summary: dict[str, Any] = {}
    if (run / "summary.json").exists():
        try:
            summary = json.loads((run / "summary.json").read_text())
        except json.JSONDecodeError as exc:
            return [f"summary.json is not valid JSON: {exc}"]
    return (check_progress(events, metrics) + check_reset_counts(events, summary)
            + check_final_states(summary) + check_processes(summary) + check_memory(metrics))


def check_progress(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[str]:
    """The global committed progress never goes backwards unless a state_lost (or a checkpoint-restart
    baseline's full restart) says so: otherwise training was thrown away without anyone counting it.

    Only the maximum over replicas matters (one replica restarting from 0 and healing is fine), and the
    progress is the committed sync count when metrics carry it (DiLoCo's trainer step keeps counting through
    a failed sync). Commit events are checked too, in case metrics were not written."""
    explained = [g["time"] for g in state_lost_groups(events)] + [c["time"] for c in checkpoint_restarts(events)]
    key = progress_key(metrics)
    tol = 1 if key == "manager_step" else sync_round(events)
    drops = [(d, "metrics") for d in progress_drops(metrics, key=key, tolerance=tol)]
    # commit events: manager_step after each committed sync
    commits = [{"time": e["time"], "replica": e.get("replica"), "committed": True, "manager_step": e["manager_step"]}
               for e in events if e["kind"] == "commit" and e.get("committed", True)
               and e.get("manager_step") is not None]
    for d in progress_drops(commits, key="manager_step", tolerance=1):
        if not any(abs(d["time"] - o["time"]) <= RESET_MATCH_S for o, _ in drops):
            drops.append((d, "commit events"))
    t0 = min((m["time"] for m in metrics), default=min((e["time"] for e in events), default=0.0))
    return [
        f"lineage reset not counted: global committed {d['key']} went back from {d['from']} to {d['to']} "
        f"{d['time'] - t0:.1f}s after the first step ({source}), with no state_lost event within "
        f"{RESET_MATCH_S:.0f}s"
        for d, source in drops
        if not any(abs(d["time"] - t) <= RESET_MATCH_S for t in explained)
    ]


def check_reset_counts(events: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """summary.json counts every lineage reset the events record, also as a full restart."""
    if not summary:
        return []
    out = []
    n = len(state_lost_groups(events))
    if "lineage_resets" in summary and summary["lineage_resets"] != n:
        out.append(f"summary.json counts {summary['lineage_resets']} lineage resets; events.jsonl records {n}")
    if n and "full_restarts" in summary and (summary["full_restarts"] or 0) < n:
        out.append(f"summary.json counts {summary['full_restarts']} full restarts, fewer than the {n} lineage "
                   "resets (each is one)")
    return out


def check_final_states(summary: dict[str, Any]) -> list[str]:
    """Replicas that finished at the same step must hold bit-identical parameters."""
    by_step: dict[Any, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for s in summary.get("final_states") or []:
        if isinstance(s, dict) and s.get("hash") and s.get("step") is not None:
            by_step[s["step"]][s["hash"]].append(s.get("replica"))
    return [
        f"replicas at final step {step} differ: " + "; ".join(f"{h[:12]} on replicas {reps}" for h, reps in hashes.items())
        for step, hashes in sorted(by_step.items(), key=lambda kv: str(kv[0]))
        if len(hashes) > 1
    ]


def check_processes(summary: dict[str, Any]) -> list[str]:
    """No process of the run outlives it."""
    out = []
    leaked = summary.get("leaked_pids")
    if leaked:
        out.append(f"leaked processes after the run: pids {leaked}")
    at_end = summary.get("processes_at_end")
    if at_end and (not isinstance(at_end, (list, tuple, dict)) or len(at_end) > 0):
        out.append(f"processes still running at the end of the run: {at_end}")
    return out


def check_memory(metrics: list[dict[str, Any]]) -> list[str]:
    """Resident memory that keeps growing over the run (per replica, from metrics' `rss_mb` when present):
    the median of the last quarter is more than twice, and 200 MB above, that of the second quarter."""
    by_rep: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for m in metrics:
        if m.get("rss_mb") is not None and m.get("time") is not None:
            by_rep[m.get("replica")].append((m["time"], float(m["rss_mb"])))
    out = []
    for r, pts in sorted(by_rep.items(), key=lambda kv: str(kv[0])):
        if len(pts) < 8:
            continue
        pts.sort()
        q = len(pts) // 4
        second = statistics.median(v for _, v in pts[q:2 * q])
        last = statistics.median(v for _, v in pts[len(pts) - q:])
        if last > RSS_GROWTH_FACTOR * second and last - second > RSS_GROWTH_MB:
            out.append(f"memory of replica {r} keeps growing: median RSS {second:.0f} MB in the second quarter "
                       f"of the run, {last:.0f} MB in the last")
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the violations of a run directory; exit status 1 when there are any (for CI)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m regent.orchestrate.invariants RUN_DIR", file=sys.stderr)
        return 2
    run = Path(args[0])
    if not (run / "events.jsonl").exists():
        print(f"{run} has no events.jsonl; is it a regent run directory?", file=sys.stderr)
        return 2
    violations = check_run(run)
    for v in violations:
        print(f"VIOLATION: {v}")
    if not violations:
        print(f"{run}: all invariants hold")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
