"""The convergence benchmark (issue 36 item 4): does a run with faults follow the fault-free loss curve?

    .venv/bin/python benchmarks/convergence_bench.py --duration 330s --parallel    # 16-core host, ~7 min
    .venv/bin/python benchmarks/convergence_bench.py --duration 150s               # 2-core box, one by one, ~12 min
    .venv/bin/python benchmarks/convergence_bench.py --duration 45s --fault-every 8s \
        --faults.warmup 5s --faults.holdoff 5s                                     # smoke (the long test), ~3 min

Method:
1. Four runs of one config (`regent train`, per-step mode, `--ft.constant-batch`, 3 replicas of 1 process, the
   debug Llama 3 on the built-in corpus, torch threads 1, trainers on CPU unless `--device auto`), each for
   `--duration`: fault-free with seed A, fault-free with seed B, and with seed A a fault every 30 s and every
   15 s (`--fault-every`, the default fault kinds: kill, exception, comm, hang). `--parallel` runs them at once
   (a many-core host: 12 busy trainers).
2. Loss against samples consumed: the loss of each committed step (the mean over its global batch) at the
   samples the sample ledger says were consumed up to it, smoothed by a trailing mean over `--window` samples.
3. The yardstick: at each sample count, the largest gap between the two fault-free seeds' smoothed curves within
   one window around it (the noise band). A faulted run is within noise where its gap to the seed-A run is no
   larger (`regent.orchestrate.convergence`).
4. Exactly-once: `regent check` on every run (the sample ledger check included) must hold.
Writes OUT/convergence.{json,md,png}, small copies of each run (summary, check, report) under OUT/runs/, and the
figure and table into each faulted run's directory, where `regent report` shows them. Exit 1 when a run failed,
ran past `--duration` + `--grace`, or `regent check` did not hold on it. Other flags go to every `regent train`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from regent.orchestrate import convergence as conv  # noqa: E402 (after the path: runs from a checkout)
from regent.orchestrate.config import parse_duration  # noqa: E402
from regent.orchestrate.events import read_jsonl  # noqa: E402

SMALL_FILES = ("summary.json", "config.json", "report.html", "loss.png", "progress.png", "active_replicas.png",
               "recovery.png", conv.FIGURE, conv.TABLE)


def plan(args: argparse.Namespace) -> list[tuple[str, int, str | None]]:
    """(name, seed, fault interval or None) of each run: the two fault-free seeds first, then the faulted ones."""
    runs: list[tuple[str, int, str | None]] = [("fault-free seed A", args.seed_a, None),
                                               ("fault-free seed B", args.seed_b, None)]
    for every in [e for e in args.fault_every.split(",") if e]:
        runs.append((f"faults every {every}", args.seed_a, every))
    return runs


def slug(name: str) -> str:
    return name.replace("fault-free seed ", "free-").replace("faults every ", "faults-").replace(" ", "-")


def train_command(run_dir: Path, args: argparse.Namespace, seed: int, every: str | None) -> list[str]:
    cmd = [args.python, "-m", "regent.cli", "train", "--replicas", str(args.replicas), "--procs-per-replica",
           str(args.procs_per_replica), "--model", args.model, "--duration", args.duration, "--seed", str(seed),
           "--no-live", "--run-dir", str(run_dir), "--ft.mode", "ddp", "--ft.constant-batch",
           "--train.max-steps", str(args.max_steps)]
    cmd += ["--fault-every", every] if every else ["--no-faults"]
    return cmd + args.extra


def launch(runs: list[tuple[str, int, str | None]], runs_dir: Path, args: argparse.Namespace) -> dict[str, int]:
    """Start the runs (all at once with --parallel, else one after another); name -> exit code."""
    env = dict(os.environ, OMP_NUM_THREADS="1", REGENT_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
    if args.device == "cpu":  # a GPU machine's host CPUs: keep the trainers off its GPU (regent.platform)
        env.update(GPU_PLATFORM="cpu", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    codes: dict[str, int] = {}
    running: list[tuple[str, subprocess.Popen, Any]] = []
    for name, seed, every in runs:
        run_dir = runs_dir / slug(name)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        cmd = train_command(run_dir, args, seed, every)
        print("$", " ".join(cmd), flush=True)
        log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed when the run ends, below
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        running.append((name, proc, log))
        if not args.parallel:
            codes[name] = bounded_wait(proc, time.time() + parse_duration(args.duration) + args.grace)
            log.close()
            print(f"  {name}: exit {codes[name]}", flush=True)
    deadline = time.time() + parse_duration(args.duration) + args.grace
    for name, proc, log in running:
        if name not in codes:
            codes[name] = bounded_wait(proc, deadline)
            log.close()
            print(f"  {name}: exit {codes[name]}", flush=True)
    return codes


def bounded_wait(proc: subprocess.Popen, deadline: float) -> int:
    """The run's exit code; past `deadline`, SIGINT (regent train's orderly stop: replicas stopped, summary
    written), and SIGKILL a minute later. A run stopped so reads as failed (its code, or 124)."""
    try:
        return proc.wait(timeout=max(deadline - time.time(), 1.0))
    except subprocess.TimeoutExpired:
        print(f"  pid {proc.pid} still running past its duration + grace: SIGINT", flush=True)
        proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return code or 124


def check(run_dir: Path, python: str) -> tuple[bool, str]:
    """`regent check RUN_DIR` as a user runs it: (holds, its output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                      if p))
    proc = subprocess.run([python, "-m", "regent.cli", "check", str(run_dir)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def load(run_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    return (list(read_jsonl(run_dir / "metrics.jsonl")), list(read_jsonl(run_dir / "ledger.jsonl")),
            list(read_jsonl(run_dir / "events.jsonl")))


def auto_window(curves: list[conv.Curve], fraction: float, global_batch: int) -> float:
    """The smoothing window: `fraction` of the range every run covers, and at least 10 global batches."""
    upto = min(c[-1][0] for c in curves)
    return max(10.0 * global_batch, fraction * upto)


def run_row(name: str, run_dir: Path, code: int, holds: bool, check_out: str, incomplete: int) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    samples = summary.get("samples") or {}
    return {"run": name, "exit": code, "steps_committed": summary.get("steps_committed"),
            "samples_committed": samples.get("samples_committed"), "samples_skipped": samples.get("samples_skipped"),
            "faults_injected": summary.get("faults_injected"), "recoveries": summary.get("recoveries"),
            "steps_lost": summary.get("steps_lost"), "lineage_resets": summary.get("lineage_resets"),
            "extra_micro_batches": summary.get("extra_micro_batches"), "final_loss": summary.get("final_loss"),
            "steps_without_full_loss": incomplete,
            "check": "holds" if holds else "VIOLATED", "check_output": check_out[-4000:]}


def runs_table(rows: list[dict[str, Any]]) -> str:
    keys = ["run", "steps_committed", "samples_committed", "samples_skipped", "faults_injected", "recoveries",
            "steps_lost", "lineage_resets", "extra_micro_batches", "steps_without_full_loss", "check"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("-" if r.get(k) is None else str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def verdict_lines(result: dict[str, Any]) -> str:
    out = []
    for name, s in result["faulted"].items():
        share, worst = s["within_share"], s["worst_gap_over_noise"]
        out.append(f"- {name}: within noise at {100 * share:.0f}% of {result['dense_points']} sample counts up to "
                   f"{result['upto_samples']:.0f}; worst gap / noise {worst:.2g} (mean {s['mean_gap_over_noise']:.2g}); "
                   f"largest gap {s['max_gap']:.2g}"
                   if share is not None else f"- {name}: no common sample range")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", default="6m", help="wall time of every run")
    ap.add_argument("--fault-every", default="30s,15s", help="one faulted run (seed A) per interval, comma list")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--procs-per-replica", type=int, default=1)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seed-a", type=int, default=1)
    ap.add_argument("--seed-b", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=100_000,
                    help="the cosine schedule's length: far past the run, so the learning rate at a sample count is "
                         "the same in every run whatever its pace")
    ap.add_argument("--device", choices=["cpu", "auto"], default="cpu",
                    help="cpu: trainers on CPU even where a GPU is (GPU_PLATFORM=cpu); auto: regent's detection")
    ap.add_argument("--parallel", action="store_true", help="run the four at once (a host with 16+ cores)")
    ap.add_argument("--grace", type=float, default=120.0,
                    help="seconds past --duration before a run still going is stopped (and counted as failed)")
    ap.add_argument("--window", type=float, default=0.0,
                    help="smoothing window in samples (0: --window-fraction of the common range)")
    ap.add_argument("--window-fraction", type=float, default=0.04)
    ap.add_argument("--rows", type=int, default=8, help="sample counts in the table")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/convergence"))
    ap.add_argument("--runs-dir", default="", help="where the run directories go (default OUT/runs-full)")
    ap.add_argument("--reuse", action="store_true", help="analyse the run directories already in --runs-dir")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--label", default="", help="what machine this is, for the table's heading")
    args, args.extra = ap.parse_known_args()  # any other flag (--faults.warmup 6s) goes to every regent train
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs_dir) if args.runs_dir else out / "runs-full"
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs = plan(args)
    t0 = time.time()
    codes = {name: 0 for name, _, _ in runs} if args.reuse else launch(runs, runs_dir, args)
    wall = time.time() - t0
    if args.reuse and (out / "convergence.json").exists():  # keep the wall time of the runs analysed again
        wall = json.loads((out / "convergence.json").read_text()).get("wall_s", wall)

    rows, curves, faults, failed = [], {}, {}, False
    global_batch = 0
    for name, _, every in runs:
        run_dir = runs_dir / slug(name)
        holds, check_out = check(run_dir, args.python)
        metrics, ledger, events = load(run_dir)
        rows.append(run_row(name, run_dir, codes[name], holds, check_out, conv.incomplete_steps(metrics, ledger)))
        failed |= not holds or codes[name] != 0
        curves[name] = conv.loss_curve(metrics, ledger)
        if every:
            faults[name] = conv.fault_samples(events, metrics, ledger)
        if ledger:
            first = ledger[0]
            global_batch = int(first["replicas"]) * int(first["ranks"]) * int(first["batch_size"])
        print(f"  {name}: {len(curves[name])} committed steps, check {'holds' if holds else 'VIOLATED'}", flush=True)
    names = [n for n, _, e in runs if e]
    ref, other = runs[0][0], runs[1][0]
    cfg_file = runs_dir / slug(ref) / "config.json"
    seq_len = json.loads(cfg_file.read_text())["train"]["seq_len"] if cfg_file.exists() else None
    title = (f"{args.replicas} replicas x {args.procs_per_replica}, {args.model}, constant global batch "
             f"{global_batch} x {seq_len} tokens, {args.duration} each{' (' + args.label + ')' if args.label else ''}")
    result: dict[str, Any] | None = None
    (out / conv.FIGURE).unlink(missing_ok=True)  # never a figure of an earlier invocation
    try:
        empty = [n for n, c in curves.items() if not c]
        if empty:
            raise ValueError(f"no committed step with both a loss and a ledger line in {empty}")
        window = args.window or auto_window(list(curves.values()), args.window_fraction, global_batch)
        dense = 200
        result = conv.compare(curves[ref], curves[other], {n: curves[n] for n in names}, window=window,
                              rows=args.rows, dense=dense)
        result["dense_points"] = dense
        conv.plot_convergence(curves, faults, out / conv.FIGURE, window=window, reference=ref, other_seed=other,
                              title=title)
        md = (f"### Convergence: {title}\n\nLoss (trailing mean over {window:.0f} samples) at equal samples "
              f"consumed; noise band = the largest |seed A - seed B| within one window; gap = |faulted - seed A|.\n\n"
              + conv.markdown_table(result, names) + "\n" + verdict_lines(result) + "\n" + runs_table(rows))
    except (ValueError, IndexError) as exc:  # a run with no committed step: the runs' table still says which
        failed = True
        md = f"### Convergence: {title}\n\nNo comparison: {exc!r}\n\n" + runs_table(rows)
    (out / conv.TABLE).write_text(md)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(), "cpus": os.cpu_count(),
              "label": args.label, "python": sys.version.split()[0], "command": " ".join(sys.argv),
              "wall_s": wall, "global_batch": global_batch, "seq_len": seq_len, "comparison": result, "runs": rows,
              "curves": {n: c for n, c in curves.items()}, "faults": faults}
    (out / "convergence.json").write_text(json.dumps(record, default=str))
    for name, _, every in runs:
        run_dir = runs_dir / slug(name)
        if every and (out / conv.FIGURE).exists():  # the faulted run's report shows it (report.py picks it up)
            shutil.copy(out / conv.FIGURE, run_dir / conv.FIGURE)
            (run_dir / conv.TABLE).write_text(md)
        try:
            from regent.orchestrate.report import write_report

            write_report(run_dir, baseline=runs_dir / slug(ref) if every else None)
        except Exception as exc:  # noqa: BLE001 - the table above stands without the page; say why it is missing
            print(f"  {name}: report not regenerated: {exc!r}", flush=True)
        keep = out / "runs" / slug(name)
        keep.mkdir(parents=True, exist_ok=True)
        for f in SMALL_FILES:
            if (run_dir / f).exists():
                shutil.copy(run_dir / f, keep / f)
        (keep / "check.txt").write_text(next(r["check_output"] for r in rows if r["run"] == name) + "\n")
        log = run_dir.with_suffix(".log")
        if log.exists():
            (keep / "train.log.tail").write_text("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    print()
    print(md)
    print(f"wall {wall:.0f} s; written in {out}: {', '.join(sorted(p.name for p in out.iterdir() if p.is_file()))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
