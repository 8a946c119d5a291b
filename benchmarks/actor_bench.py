"""Actor-runtime benchmark: Regent against Monarch and Ray, in one run, on this machine.

    .venv/bin/python benchmarks/actor_bench.py [--quick] [--runtimes regent,monarch,ray] [--only call_one,...]
    .venv/bin/python benchmarks/actor_bench.py --profile benchmarks/results/profile   # where Regent's time goes

Regent runs in this process (the .venv). Monarch and Ray run as subprocesses under the benchmark venv
(`.venv-bench`, never installed into .venv), each printing one JSON object. Monarch and Regent execute the
very same measure code (benchmarks/anchors/mesh_api_measures.py) because their APIs are the same; Ray's
idiom is in benchmarks/anchors/ray_bench.py. The anchors run first, one at a time, so the three runtimes
never compete for the 2 cores.

The table goes to the terminal; everything (all rounds, machine, versions, load) goes to
benchmarks/results/actor_bench.json. Targets come from issue 2.

--stages prints where one Regent `call_one` spends its time, hop by hop (caller, controller loop, proc,
actor, back), for a sync and an async actor. It wraps two runtime internals (`Runtime.run_on_loop`,
`Gather.deliver`), so it names them when they have moved.

--profile DIR runs each Regent measure on its own under py-spy (`pip install py-spy`), sampling the
controller and every proc it spawns, and writes DIR/<measure>.txt (raw collapsed stacks, loadable in
speedscope or flamegraph.pl) and DIR/<measure>_top.txt (the top frames per process, self and inclusive).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import statistics
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

from mesh_api_measures import MEASURES, log, run_measures  # noqa: E402

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
    Row("call_one, async endpoint, median", "call_one_async", "median_ms", "ms"),
    Row("call_one awaited from an asyncio client, median", "call_one_awaited", "median_ms", "ms"),
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


def run_anchor(name: str, quick: bool, only: set[str] | None) -> dict[str, Any]:
    """Run benchmarks/anchors/<name>_bench.py under the benchmark venv and parse its JSON line."""
    if not BENCH_VENV_PYTHON.exists():
        msg = f"{BENCH_VENV_PYTHON} is missing; create it with: {BENCH_VENV_HOWTO}"
        log(msg)
        return {"runtime": name, "error": msg}
    script = BENCH_DIR / "anchors" / f"{name}_bench.py"
    cmd = [str(BENCH_VENV_PYTHON), str(script)] + (["--quick"] if quick else [])
    if only:
        cmd += ["--only", ",".join(sorted(only))]
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


def run_regent(quick: bool, only: set[str] | None) -> dict[str, Any]:
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
    results = run_measures(api, quick=quick, only=only)
    return {"runtime": "regent", "version": git_commit(), "results": results}


def command_output(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    """HEAD, marked '+dirty' when src/regent/actor has uncommitted changes (then HEAD is not what ran)."""
    head = command_output(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = command_output(["git", "status", "--porcelain", "--", "src/regent/actor"])
    return head + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    return {"uname": command_output(["uname", "-a"]), "cpus": os.cpu_count(), "python": sys.version.split()[0],
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
        run = runs.get(name, {})
        if "error" in run:
            console.print(f"[red]{name} not measured:[/] {run['error']}")
        for key, entry in (run.get("results") or {}).items():
            if isinstance(entry, dict) and "error" in entry:
                console.print(f"[red]{name} {key} failed:[/] {entry['error'][:300]}")


def markdown_table(runs: dict[str, dict[str, Any]]) -> str:
    """The same table as the terminal's, in Markdown, for RESULTS.md."""
    lines = ["| measure | Monarch | Ray | Regent | target | met? |", "|---|---:|---:|---:|---:|:---:|"]
    for row in ROWS:
        cells = [row.label]
        for name in RUNTIMES:
            value = row.value(runs.get(name, {}).get("results"))
            text = fmt(value, row.unit)
            if name == "ray" and row.key in RAY_ANALOGUES and value is not None:
                text += "*"
            cells.append(text)
        met = row.met(row.value(runs.get("regent", {}).get("results")))
        cells += [fmt_target(row), {True: "yes", False: "**no**", None: "–"}[met]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in ROWS:
        values = {name: row.value(runs.get(name, {}).get("results")) for name in RUNTIMES}
        out.append({"measure": row.label, "unit": row.unit, **values, "target": row.target,
                    "higher_is_better": row.higher_is_better, "met": row.met(values["regent"])})
    return out


STAGES = (
    ("caller thread: checks, pickling, bookkeeping (until call_one returns)", "t0", "t1"),
    ("caller thread -> controller loop thread wake-up", "t1", "loop_start"),
    ("controller loop: envelope + socket write", "loop_start", "sent"),
    ("socket -> proc loop -> (actor thread) -> endpoint starts", "sent", "actor"),
    ("endpoint returns -> reply -> proc loop -> socket -> controller loop", "actor", "reply_on_loop"),
    ("controller loop -> caller thread wakes in Future.get", "reply_on_loop", "t2"),
    ("total", "t0", "t2"),
)


def stage_breakdown(n: int = 3000, warmup: int = 300) -> dict[str, dict[str, float]]:
    """Median microseconds per hop of one call_one, for a sync and an async endpoint (see --stages)."""
    import regent.actor as api
    from regent.actor import _mesh, _runtime

    for owner, name in ((_runtime.Runtime, "run_on_loop"), (_mesh.Gather, "deliver")):
        if not hasattr(owner, name):
            raise SystemExit(f"--stages wraps {owner.__module__}.{owner.__name__}.{name}, which no longer exists; "
                             "update stage_breakdown() in benchmarks/actor_bench.py")
    marks: dict[str, float] = {}
    original_run_on_loop, original_deliver = _runtime.Runtime.run_on_loop, _mesh.Gather.deliver

    def run_on_loop(self: Any, fn: Callable, *args: Any) -> None:
        if getattr(fn, "__name__", "") != "on_loop":  # the closure Endpoint._send hands to the loop
            return original_run_on_loop(self, fn, *args)

        def timed(*inner: Any) -> None:
            marks["loop_start"] = time.perf_counter()
            fn(*inner)
            marks["sent"] = time.perf_counter()

        return original_run_on_loop(self, timed, *args)

    def deliver(self: Any, *args: Any) -> None:
        marks["reply_on_loop"] = time.perf_counter()
        return original_deliver(self, *args)

    class SyncStamp(api.Actor):
        @api.endpoint
        def stamp(self, payload: Any) -> float:
            return time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes on one machine

    class AsyncStamp(api.Actor):
        @api.endpoint
        async def stamp(self, payload: Any) -> float:
            return time.perf_counter()

    _runtime.Runtime.run_on_loop, _mesh.Gather.deliver = run_on_loop, deliver
    out: dict[str, dict[str, float]] = {}
    try:
        procs = api.this_host().spawn_procs(per_host={"gpus": 1})
        for label, cls in (("sync", SyncStamp), ("async", AsyncStamp)):
            mesh = procs.spawn(f"stamp_{label}", cls)
            mesh.stamp.call_one(0).get(timeout=120)
            samples: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
            for i in range(warmup + n):
                marks.clear()
                marks["t0"] = time.perf_counter()
                fut = mesh.stamp.call_one(b"x" * 64)
                marks["t1"] = time.perf_counter()
                marks["actor"] = fut.get(timeout=120)
                marks["t2"] = time.perf_counter()
                if i >= warmup and len(marks) == 7:
                    for name, start, end in STAGES:
                        samples[name].append(max(0.0, marks[end] - marks[start]))
            out[label] = {name: statistics.median(v) * 1e6 for name, v in samples.items() if v}
        procs.stop().get(timeout=120)
    finally:
        _runtime.Runtime.run_on_loop, _mesh.Gather.deliver = original_run_on_loop, original_deliver
    return out


def summarize_collapsed(text: str, top: int = 15) -> dict[str, dict[str, Any]]:
    """Top frames per process from py-spy's raw collapsed stacks (`--format raw --subprocesses`).

    Each line is `frame;frame;... count`; with --subprocesses a child's stack is nested under its parent's,
    each process marked by a `process PID:"cmdline"` frame, so a sample belongs to the innermost one.
    Import frames are dropped (start-up, not the hot path). Line numbers are folded away so a function's
    samples add up. Returns {process: {"samples", "self": [(pct, frame)], "inclusive": [(pct, frame)]}}.
    """
    procs: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        marks = [i for i, f in enumerate(frames) if f.startswith("process ")]
        start = marks[-1] if marks else 0
        proc = frames[start].split(":", 1)[-1] if marks else "?"
        body = [re.sub(r":\d+\)$", ")", f) for f in frames[start + 1 :]]
        if not body or any(f.startswith("_find_and_load") for f in body):
            continue
        entry = procs.setdefault(proc, {"samples": 0, "self": collections.Counter(),
                                        "inclusive": collections.Counter()})
        count = int(count_text)
        entry["samples"] += count
        entry["self"][body[-1]] += count
        for frame in set(body):
            entry["inclusive"][frame] += count
    out = {}
    for proc, entry in procs.items():
        total = entry["samples"]
        out[proc] = {"samples": total,
                     "self": [(round(100 * c / total, 1), f) for f, c in entry["self"].most_common(top)],
                     "inclusive": [(round(100 * c / total, 1), f) for f, c in entry["inclusive"].most_common(top)]}
    return out


def format_summary(summary: dict[str, dict[str, Any]]) -> str:
    lines = []
    for proc, entry in sorted(summary.items(), key=lambda kv: -kv[1]["samples"]):
        lines.append(f"== {proc}  ({entry['samples']} samples)")
        for kind in ("self", "inclusive"):
            lines.append(f"  {kind}:")
            lines += [f"    {pct:5.1f}%  {frame}" for pct, frame in entry[kind]]
    return "\n".join(lines) + "\n"


def profile_regent(out_dir: Path, quick: bool, measures: list[str]) -> None:
    """Run each Regent measure alone under py-spy (controller and procs) and summarise the top frames."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed; run `.venv/bin/pip install py-spy` (Linux needs ptrace "
                         "permission: run as root or set kernel.yama.ptrace_scope=0)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for measure in measures:
        raw = out_dir / f"{measure}.txt"
        cmd = [py_spy, "record", "--subprocesses", "--format", "raw", "--rate", "250", "--output", str(raw),
               "--", sys.executable, str(Path(__file__).resolve()), "--runtimes", "regent", "--only", measure,
               "--out", str(out_dir / f"{measure}.json")] + (["--quick"] if quick else [])
        log(f"profiling {measure}: {' '.join(cmd)}")
        subprocess.run(cmd, cwd=REPO_DIR, check=False, stdout=subprocess.DEVNULL)
        if not raw.exists():
            log(f"{measure}: py-spy wrote no profile")
            continue
        text = format_summary(summarize_collapsed(raw.read_text()))
        (out_dir / f"{measure}_top.txt").write_text(text)
        print(f"######## {measure}\n{text}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter rounds (a smoke run, not for the record)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES),
                        help="comma-separated subset of monarch,ray,regent (default: all three)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(MEASURES)}")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "actor_bench.json"),
                        help="where to write the JSON results")
    parser.add_argument("--stages", action="store_true",
                        help="print where one Regent call_one spends its time, hop by hop, and exit")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="profile each Regent measure with py-spy into DIR instead of benchmarking")
    args = parser.parse_args(argv)
    chosen = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    unknown = sorted(set(chosen) - set(RUNTIMES))
    if unknown:
        parser.error(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")
    only = {m.strip() for m in args.only.split(",") if m.strip()} or None
    if only and only - set(MEASURES):
        parser.error(f"unknown measure(s) {sorted(only - set(MEASURES))}; choose from {', '.join(MEASURES)}")
    if args.stages:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        result = stage_breakdown(n=500 if args.quick else 3000)
        print(f"{'stage':72s} {'sync µs':>9s} {'async µs':>9s}   (load {os.getloadavg()[0]:.1f})")
        for name, _, _ in STAGES:
            print(f"{name:72s} {result['sync'].get(name, float('nan')):9.1f} {result['async'].get(name, float('nan')):9.1f}")
        return
    if args.profile:
        profile_regent(Path(args.profile), args.quick, sorted(only) if only else list(MEASURES))
        return

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "monarch": lambda: run_anchor("monarch", args.quick, only),
        "ray": lambda: run_anchor("ray", args.quick, only),
        "regent": lambda: run_regent(args.quick, only),
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
    out.with_suffix(".md").write_text(markdown_table(runs))
    log(f"wrote {out} and {out.with_suffix('.md')}")
    sys.stdout.flush()
    sys.stderr.flush()
    # Regent's runtime thread and its procs are torn down by its own atexit hooks; leave promptly.


if __name__ == "__main__":
    main()
