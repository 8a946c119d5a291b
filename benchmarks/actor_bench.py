"""Actor-runtime benchmark: Regent against Monarch and Ray, in one run, on this machine.

    .venv/bin/python benchmarks/actor_bench.py [--quick] [--runtimes regent,monarch,ray]

Regent runs in this process (the .venv). Monarch and Ray run as subprocesses under the benchmark venv
(`.venv-bench`, never installed into .venv), each printing one JSON object. Monarch and Regent execute the
very same measure code (benchmarks/anchors/mesh_api_measures.py) because their APIs are the same; Ray's
idiom is in benchmarks/anchors/ray_bench.py. The anchors run first, one at a time, so the three runtimes
never compete for the 2 cores.

The table goes to the terminal; everything (all rounds, machine, versions, load) goes to
benchmarks/results/actor_bench.json. Targets come from issue 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR / "anchors"))

from mesh_api_measures import log, run_measures  # noqa: E402

BENCH_VENV_PYTHON = REPO_DIR / ".venv-bench" / "bin" / "python"
BENCH_VENV_HOWTO = ("python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 torchmonarch ray "
                    "torchft-nightly")
ANCHOR_TIMEOUT_S = 900
RUNTIMES = ("monarch", "ray", "regent")


@dataclass(frozen=True)
class Row:
    """One line of the table: where its number sits in a runtime's results and what counts as good."""

    label: str
    key: str
    field: str
    unit: str
    target: float | None = None
    higher_is_better: bool = False

    def value(self, results: dict[str, Any] | None) -> float | str | None:
        if results is None:
            return None
        entry = results.get(self.key)
        if entry is None:
            return None
        if "error" in entry:
            return "error"
        return entry.get(self.field)

    def met(self, value: float | str | None) -> bool | None:
        if self.target is None or not isinstance(value, (int, float)):
            return None
        return value >= self.target if self.higher_is_better else value <= self.target


ROWS = (
    Row("call_one round trip, median", "call_one", "median_ms", "ms", target=0.25),
    Row("call_one round trip, p99", "call_one", "p99_ms", "ms"),
    Row("call to 2 procs, median", "call_2procs", "median_ms", "ms", target=0.4),
    Row("call to 2 procs, p99", "call_2procs", "p99_ms", "ms"),
    Row("pipelined calls (1000 in flight)", "pipelined", "median", "calls/s", target=20_000,
        higher_is_better=True),
    Row("broadcast (fire-and-forget)", "broadcast", "median", "msg/s", target=50_000, higher_is_better=True),
    Row("100 MB torch tensor argument", "tensor_100mb", "median", "GB/s", target=1.0, higher_is_better=True),
    Row("100 MB numpy array argument", "ndarray_100mb", "median", "GB/s"),
    Row("8-proc mesh: spawn to first reply (cold)", "spawn8_first_reply", "median_s", "s"),
)
# Ray has no meshes; these rows are measured with the nearest Ray idiom (see anchors/ray_bench.py).
RAY_ANALOGUES = {"call_2procs", "broadcast", "spawn8_first_reply"}


def fmt(value: float | str | None, unit: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if unit in ("calls/s", "msg/s"):
        return f"{value / 1000:.3g}k {unit}" if value >= 1000 else f"{value:.0f} {unit}"
    if unit == "ms":
        return f"{value:.3f} ms" if value < 1 else f"{value:.2f} ms"
    return f"{value:.2f} {unit}"


def fmt_target(row: Row) -> str:
    if row.target is None:
        return "–"
    if row.unit == "ms":
        return ("≥ " if row.higher_is_better else "≤ ") + f"{row.target:g} ms"
    return ("≥ " if row.higher_is_better else "≤ ") + fmt(row.target, row.unit)


def run_anchor(name: str, quick: bool) -> dict[str, Any]:
    """Run benchmarks/anchors/<name>_bench.py under the benchmark venv and parse its JSON line."""
    if not BENCH_VENV_PYTHON.exists():
        msg = f"{BENCH_VENV_PYTHON} is missing; create it with: {BENCH_VENV_HOWTO}"
        log(msg)
        return {"runtime": name, "error": msg}
    script = BENCH_DIR / "anchors" / f"{name}_bench.py"
    cmd = [str(BENCH_VENV_PYTHON), str(script)] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    log(f"{name}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=None, text=True,
                              timeout=ANCHOR_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"runtime": name, "error": f"timed out after {ANCHOR_TIMEOUT_S} s"}
    log(f"{name}: finished in {time.perf_counter() - t0:.0f} s (exit {proc.returncode})")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"runtime": name, "error": f"no JSON on stdout (exit code {proc.returncode}); see stderr above"}
    return json.loads(lines[-1])


def run_regent(quick: bool) -> dict[str, Any]:
    """Regent in this process, through the same measure code Monarch ran."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    try:
        import regent.actor as api
    except ImportError as exc:
        return {"runtime": "regent", "error": f"regent.actor is not importable: {exc}; run "
                                              "`.venv/bin/pip install -e . --no-deps`"}
    missing = [n for n in ("this_host", "Actor", "endpoint") if not hasattr(api, n)]
    if missing:
        return {"runtime": "regent", "error": f"regent.actor lacks {', '.join(missing)} (runtime not landed yet)"}
    log("regent: in-process")
    results = run_measures(api, quick=quick)
    return {"runtime": "regent", "version": git_commit(), "results": results}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_DIR, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    return {"uname": " ".join(platform.uname()), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "loadavg": os.getloadavg()}


def print_table(runs: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Actor runtime: Monarch vs Ray vs Regent (median of rounds)")
    for col in ("measure", "Monarch", "Ray", "Regent", "target", "met?"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    for row in ROWS:
        cells = [row.label]
        for name in RUNTIMES:
            value = row.value(runs.get(name, {}).get("results"))
            text = fmt(value, row.unit)
            if name == "ray" and row.key in RAY_ANALOGUES and value is not None:
                text += "*"
            cells.append(text)
        met = row.met(row.value(runs.get("regent", {}).get("results")))
        cells += [fmt_target(row), {True: "[green]yes[/]", False: "[red]no[/]", None: "–"}[met]]
        table.add_row(*cells)
    console = Console(width=max(130, Console().width))  # wrapped cells are unreadable in a narrow terminal
    console.print(table)
    console.print("* Ray analogue (no meshes): see benchmarks/anchors/ray_bench.py")
    for name in RUNTIMES:
        if "error" in runs.get(name, {}):
            console.print(f"[red]{name} not measured:[/] {runs[name]['error']}")


def summary_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in ROWS:
        values = {name: row.value(runs.get(name, {}).get("results")) for name in RUNTIMES}
        out.append({"measure": row.label, "unit": row.unit, **values, "target": row.target,
                    "higher_is_better": row.higher_is_better, "met": row.met(values["regent"])})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter rounds (a smoke run, not for the record)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES),
                        help="comma-separated subset of monarch,ray,regent (default: all three)")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "actor_bench.json"),
                        help="where to write the JSON results")
    args = parser.parse_args(argv)
    chosen = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    unknown = sorted(set(chosen) - set(RUNTIMES))
    if unknown:
        parser.error(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "monarch": lambda: run_anchor("monarch", args.quick),
        "ray": lambda: run_anchor("ray", args.quick),
        "regent": lambda: run_regent(args.quick),
    }
    runs: dict[str, dict[str, Any]] = {}
    for name in RUNTIMES:  # anchors first: Regent's runtime lives in this process until exit
        if name in chosen:
            runs[name] = runners[name]()
            runs[name]["loadavg_after"] = os.getloadavg()

    print_table(runs)
    record = {
        "bench": "actor",
        "date_utc": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([".venv/bin/python", "benchmarks/actor_bench.py", *(argv or sys.argv[1:])]),
        "quick": args.quick,
        "machine": {**machine(), "loadavg_before": load_before},
        "regent_commit": git_commit(),
        "table": summary_rows(runs),
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    log(f"wrote {out}")
    sys.stdout.flush()
    sys.stderr.flush()
    # Regent's runtime thread and its procs are torn down by its own atexit hooks; leave promptly.


if __name__ == "__main__":
    main()
