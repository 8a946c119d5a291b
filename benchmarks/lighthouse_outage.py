"""What a Lighthouse outage costs a DiLoCo run, with and without `--ft.quorum-reuse` (and a fault-free run).

    .venv/bin/python benchmarks/lighthouse_outage.py                      # 3 x 1, 4 minutes each, ~14 min in all
    .venv/bin/python benchmarks/lighthouse_outage.py --duration 2m --no-fault-free

Method: three `regent train` runs of one config (DiLoCo, `debug` model, same seed): the Lighthouse killed every
`--fault-every` and started again `--faults.lighthouse-down-s` (3 s) later, once with the replicas allowed to
keep their last quorum through the outage (`--ft.quorum-reuse true`, the default) and once made to wait for the
Lighthouse (`false`: what TorchFT does; its Manager has no such path), then once without faults. Only Lighthouse
faults, so no replica fails and the three runs differ only in what the outages cost. Figures, from each run's
events.jsonl and summary.json:
- global step committed by the end of training (the same wall time for all three);
- steps committed without the Lighthouse (distinct `quorum_reused` steps);
- the gap between the last commit before each Lighthouse kill and the first after it (p50, max), next to the
  run's usual gap between two commits (p50): a gap no longer than the usual one means the outage cost nothing;
- process-group rebuilds after each replica's first quorum (`quorum` events): with only Lighthouse faults the
  membership never changes, so each one is a cost of a restart (a restarted Lighthouse that gave the same
  members a new quorum id);
- `regent check`'s verdict on each run.
Prints a table and writes benchmarks/results/lighthouse_outage.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def run(name: str, out: Path, args: argparse.Namespace, extra: list[str]) -> Path:
    run_dir = out / name
    cmd = [sys.executable, "-m", "regent.cli", "train", "--replicas", str(args.replicas), "--procs-per-replica",
           str(args.procs_per_replica), "--model", "debug", "--duration", args.duration, "--seed", str(args.seed),
           "--no-live", "--ft.mode", "diloco", "--ft.sync-every", str(args.sync_every), "--run-dir", str(run_dir),
           *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"{name}: regent train exited {code}; see {out / f'{name}.log'}")
    return run_dir


def figures(run_dir: Path) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    from regent.orchestrate.invariants import check_run

    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    first: dict[int, float] = {}  # each committed step, when its first replica committed it
    for e in events:
        if e["kind"] == "commit" and e.get("committed") and e.get("step") is not None:
            first[e["step"]] = min(first.get(e["step"], e["time"]), e["time"])
    commits = sorted(first.values())
    usual = [b - a for a, b in zip(commits, commits[1:])]
    around = []
    for e in events:
        if e["kind"] == "fault_injected" and e.get("fault_kind") == "lighthouse":
            before = [c for c in commits if c < e["time"]]
            after = [c for c in commits if c > e["time"]]
            if before and after:
                around.append(after[0] - before[-1])
    return {
        "global_step": summary.get("global_committed_step"),
        "lighthouse_faults": sum(e["kind"] == "fault_injected" and e.get("fault_kind") == "lighthouse"
                                 for e in events),
        "steps_without_lighthouse": summary.get("steps_without_lighthouse"),
        "gap_around_fault_p50": statistics.median(around) if around else None,
        "gap_around_fault_max": max(around) if around else None,
        "usual_gap_p50": statistics.median(usual) if usual else None,
        "max_stall_seconds": summary.get("max_stall_seconds"),
        "rebuilds_after_first": rebuilds_after_first(events),
        "violations": check_run(run_dir),
    }


def rebuilds_after_first(events: list[dict[str, Any]]) -> int:
    """`quorum` events (one per process-group build of a group rank) beyond the first of each (replica, generation,
    rank)."""
    seen: dict[tuple[Any, Any, Any], int] = {}
    for e in events:
        if e["kind"] == "quorum":
            key = (e.get("replica"), e.get("generation"), e.get("rank"))
            seen[key] = seen.get(key, 0) + 1
    return sum(n - 1 for n in seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", default="4m")
    p.add_argument("--fault-every", default="15s")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--procs-per-replica", type=int, default=1)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--no-fault-free", action="store_true", help="skip the fault-free run")
    p.add_argument("--out", default=str(ROOT / "runs" / f"lighthouse-outage-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    faults = ["--fault-kinds", "lighthouse", "--fault-every", args.fault_every]
    results: dict[str, dict[str, Any]] = {}
    for name, extra in (("reuse", [*faults, "--ft.quorum-reuse", "true"]),
                        ("wait", [*faults, "--ft.quorum-reuse", "false"]),
                        *(() if args.no_fault_free else (("fault-free", ["--no-faults"]),))):
        results[name] = figures(run(name, out, args, extra))

    def num(v: Any, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    rows = [
        ("global step committed", "global_step"),
        ("Lighthouse kills", "lighthouse_faults"),
        ("steps committed without the Lighthouse", "steps_without_lighthouse"),
        ("gap around a kill p50 (s)", "gap_around_fault_p50"),
        ("gap around a kill max (s)", "gap_around_fault_max"),
        ("usual gap between commits p50 (s)", "usual_gap_p50"),
        ("longest stall of the committed step (s)", "max_stall_seconds"),
        ("process-group rebuilds after the first", "rebuilds_after_first"),
    ]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Lighthouse outages: {args.replicas} x {args.procs_per_replica} debug, DiLoCo "
                        f"sync every {args.sync_every}, a kill every {args.fault_every}, {args.duration} each")
    table.add_column("figure")
    for name in results:
        table.add_column({"reuse": "--ft.quorum-reuse true", "wait": "false (TorchFT's wait)"}.get(name, name))
    for label, key in rows:
        table.add_row(label, *(num(r[key]) for r in results.values()))
    table.add_row("regent check", *("holds" if not r["violations"] else f"{len(r['violations'])} violation(s)"
                                    for r in results.values()))
    Console().print(table)
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "command": " ".join(sys.argv),
              "runs": str(out), "results": results}
    path = ROOT / "benchmarks" / "results" / "lighthouse_outage.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
