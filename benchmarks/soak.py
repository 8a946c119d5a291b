"""The sustained-faults soak: a long run with a fault every few seconds, against a fault-free run of the same
config, and the table that says whether committed progress survived.

    .venv/bin/python benchmarks/soak.py --mode diloco --duration 60m --fault-every 15s
    .venv/bin/python benchmarks/soak.py --mode ddp --duration 60m --fault-every 15s
    .venv/bin/python benchmarks/soak.py --mode diloco --duration 5m --baseline-duration 2m   # a smoke run
    .venv/bin/python benchmarks/soak.py --mode diloco --duration 60m --controller-every 10m  # + controller kills

Method:
1. A fault-free run of the same config (`--baseline-duration`, default 10 minutes) gives the fault-free pace
   (the anchor of goodput: useful committed progress of the soak / the baseline's progress in the same time).
   `--baseline DIR` reuses a recorded one.
2. The soak: `regent train ... --chaos --fault-every F` (every fault kind: exception, segfault, kill, exit,
   comm, hang, node, straggler, correlated, lighthouse, bitflip), seeded.
   With `--controller-every 10m` the controller itself is a fault too: `regent train` is SIGKILLed every 10
   minutes of the soak, the run goes on without it for `--controller-down` (20 s), and `regent train --resume`
   takes over (issue 33). Its rows: kills / resumes and the seconds without a controller.
3. The figures come from the soak's own summary.json (`regent.orchestrate.summary`) and the invariant checker
   (`regent.orchestrate.invariants`), which reads events.jsonl and metrics.jsonl.
Prints a table and writes benchmarks/results/soak_<mode>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from regent.orchestrate.config import parse_duration  # noqa: E402 (after the path: runs from a checkout)


def proc_pids(root_pid: int) -> list[int]:
    """The Regent procs (`regent.actor._proc_main`) among the descendants of `root_pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended while we looked
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                if b"regent.actor._proc_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
    return found


def run_procs(run_dir: Path, root_pid: int) -> list[int]:
    """The run's procs: by its marker (controller/attach.json) when it has one, since procs adopted by a resumed
    controller are not its descendants; else the descendants of `root_pid`."""
    try:
        marker = json.loads((run_dir / "controller" / "attach.json").read_text())["marker"]
    except (OSError, ValueError, KeyError):
        return proc_pids(root_pid)
    from regent.orchestrate.run import leaked_processes  # every live process carrying the run's marker

    found = []
    for pid in leaked_processes(marker, grace_s=0.0):
        with contextlib.suppress(OSError):  # ended meanwhile
            if b"regent.actor._proc_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


CONTROLLER_DOWN = threading.Event()  # set while the controller fault has no controller running


def watch_stalls(current: list[subprocess.Popen], done: threading.Event, run_dir: Path, after_s: float,
                 log) -> None:
    """While the run goes: when no replica has committed for `after_s` seconds, or for 3x the run's median
    interval between commits if that is longer (DiLoCo commits once per sync), send SIGUSR1 to every proc once
    per stall, so each prints its threads' stacks into the run's log."""
    events = run_dir / "events.jsonl"
    last_commit: float | None = None
    intervals: list[float] = []
    dumped_for, offset = None, 0
    while not done.is_set():
        time.sleep(1.0)
        try:
            with open(events) as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:  # not written yet
            continue
        complete = chunk[:chunk.rfind("\n") + 1]
        offset += len(complete.encode())
        for line in complete.splitlines():
            if '"kind":"commit"' in line.replace(" ", ""):
                now = time.time()
                if last_commit is not None and now - last_commit > 0.05:  # one commit of several replicas
                    intervals.append(now - last_commit)
                last_commit = now
        if CONTROLLER_DOWN.is_set() and last_commit is not None:
            # nobody writes events.jsonl while no controller runs (the replicas journal their commits): not a
            # stall; the clock starts again when the next controller writes
            last_commit = dumped_for = time.time()
            continue
        if last_commit is None or dumped_for == last_commit:
            continue
        limit = max(after_s, 3 * sorted(intervals)[len(intervals) // 2]) if intervals else after_s
        if time.time() - last_commit < limit:
            continue
        dumped_for = last_commit
        pids = run_procs(run_dir, current[0].pid)
        log.write(f"[soak] no commit for {time.time() - last_commit:.0f} s: stacks of procs {pids} follow\n")
        log.flush()
        for pid in pids:
            if catches(pid, signal.SIGUSR1):  # a proc still starting has no handler yet: the signal would end it
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, signal.SIGUSR1)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` now (the SigCgt mask in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError):  # it ended meanwhile
        pass
    return False


def regent_command() -> list[str]:
    """`regent` of the checkout's .venv, else this interpreter's (a GPU machine's host has no .venv: there the
    package comes from PYTHONPATH)."""
    exe = ROOT / ".venv/bin/regent"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "regent.cli"]


def regent_train(run_dir: Path, args: argparse.Namespace, duration: str, faults: bool,
                 baseline: Path | None = None) -> int:
    cmd = [*regent_command(), "train", "--replicas", str(args.replicas), "--procs-per-replica",
           str(args.procs_per_replica), "--model", "debug", "--duration", duration, "--seed", str(args.seed),
           "--no-live", "--run-dir", str(run_dir), "--ft.mode", args.mode]
    cmd += ["--chaos", "--fault-every", args.fault_every] if faults else ["--no-faults"]
    if baseline is not None:
        cmd += ["--baseline", str(baseline)]
    cmd += args.extra
    print("$", " ".join(cmd), flush=True)
    with open(run_dir.with_suffix(".log"), "w") as log:
        current = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)]
        done = threading.Event()
        if args.stack_dump_after > 0:
            threading.Thread(target=watch_stalls, args=(current, done, run_dir, args.stack_dump_after, log),
                             daemon=True).start()
        try:
            if faults and parse_duration(args.controller_every) > 0:
                return kill_and_resume_controller(current, run_dir, args, log)
            return current[0].wait()
        finally:
            done.set()


def kill_and_resume_controller(current: list[subprocess.Popen], run_dir: Path, args: argparse.Namespace,
                               log) -> int:
    """The `controller` fault: every `--controller-every` of training, SIGKILL `regent train`, leave the run
    without a controller for `--controller-down`, then `regent train --resume RUN_DIR` (appending to the same
    log). Not once the run has begun to stop (`training_stopped`): the soak's own end is not a fault.
    Returns the exit code of the last controller."""
    every, down = parse_duration(args.controller_every), parse_duration(args.controller_down)
    while current[0].poll() is None and not (run_dir / "metrics.jsonl").exists():
        time.sleep(1.0)
    kills = 0
    while True:
        proc = current[0]
        try:
            return proc.wait(timeout=every)
        except subprocess.TimeoutExpired:
            pass
        if '"training_stopped"' in (run_dir / "events.jsonl").read_text():
            return proc.wait()
        CONTROLLER_DOWN.set()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        log.write(f"\n[soak] controller fault {kills}: regent train (pid {proc.pid}) SIGKILLed; resuming in "
                  f"{down:g} s\n")
        log.flush()
        time.sleep(down)
        cmd = [*regent_command(), "train", "--resume", str(run_dir), "--no-live"]
        print("$", " ".join(cmd), flush=True)
        current[0] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        time.sleep(5.0)  # let it re-attach and write the resent commits before the stall clock runs again
        CONTROLLER_DOWN.clear()


def _controller_row(summary: dict) -> str:
    modes = summary.get("controller_restart_modes") or []
    return (f"{summary.get('controller_restarts') or 0} ({modes.count('reattached')} / {modes.count('backstop')}), "
            f"{summary.get('controller_down_seconds') or 0:.0f} s")


def fault_counts(run_dir: Path) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "fault_injected":
            kinds[e.get("fault_kind") or "?"] += 1
    return dict(sorted(kinds.items()))


def by_kind(recoveries: list[dict]) -> str:
    """Recovery p50 per fault kind, slowest first: which kinds set the run's p50 (fault to the first commit; in
    DiLoCo that commit closes the round the new incarnation joined, so a fast kind still waits for it)."""
    from regent.orchestrate.summary import percentile

    kinds: dict[str, list[float]] = {}
    for r in recoveries:
        kinds.setdefault(r.get("fault_kind") or "?", []).append(r["total"])
    med = {k: percentile(v, 0.5) or 0.0 for k, v in kinds.items()}
    return ", ".join(f"{k} {med[k]:.1f} s ({len(kinds[k])})" for k in sorted(kinds, key=lambda k: -med[k]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["diloco", "ddp"], default="diloco")
    ap.add_argument("--duration", default="60m")
    ap.add_argument("--fault-every", default="15s")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--procs-per-replica", type=int, default=1)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--controller-every", default="0",
                    help="the `controller` fault: SIGKILL regent train this often and resume it (e.g. 10m; 0: off)")
    ap.add_argument("--controller-down", default="20s", help="how long the run goes without a controller each time")
    ap.add_argument("--baseline-duration", default="10m")
    ap.add_argument("--baseline", help="a recorded fault-free run of the same config (skips step 1)")
    ap.add_argument("--baseline-beside", action="store_true",
                    help="run the fault-free run at the same time as the soak, for as long, on a host with a core "
                         "per trainer: both see the same machine. The soak reads the baseline's pace at its own end "
                         "(`healthy_step_rate` over the baseline's records so far: all but its last few seconds)")
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--stack-dump-after", type=float, default=10.0,
                    help="seconds without a commit (at least 3x the median interval between commits) after which "
                         "every proc prints its stacks to the log (0: never)")
    ap.add_argument("extra", nargs="*", help="more `regent train` flags (after --)")
    args = ap.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    baseline = Path(args.baseline) if args.baseline else out / f"{args.mode}-baseline-{stamp}"
    beside = None
    if args.baseline_beside and not args.baseline:
        # started first and as long: when the soak reads its pace, it has trained for as long as the soak
        beside = threading.Thread(target=regent_train, args=(baseline, args, args.duration, False), daemon=True)
        beside.start()
        # `regent train --baseline` refuses a directory without metrics.jsonl: a fixed 5 s sleep lost a 15-minute
        # soak on a fresh host whose baseline took longer to start (the soak died at once, the baseline ran alone)
        deadline = time.time() + 600.0
        while not (baseline / "metrics.jsonl").exists():
            if not beside.is_alive() or time.time() > deadline:
                print(f"[soak] the fault-free run beside ({baseline}) wrote no metrics.jsonl: see its log", flush=True)
                return 1
            time.sleep(1.0)
    elif not args.baseline:
        regent_train(baseline, args, args.baseline_duration, faults=False)
    soak = out / f"{args.mode}-soak-{stamp}"
    t0 = time.time()
    code = regent_train(soak, args, args.duration, faults=True, baseline=baseline)
    wall = time.time() - t0
    if beside is not None:
        beside.join()
    summary = json.loads((soak / "summary.json").read_text())
    from regent.orchestrate.invariants import check_run

    violations = check_run(soak)
    base = json.loads((baseline / "summary.json").read_text())
    vw = summary.get("vulnerability_window_seconds") or {}
    causes = Counter(c.get("cause") for c in summary.get("full_restart_causes") or [])
    def num(value: object, digits: int = 2) -> object:
        """A figure for the table: floats rounded (the JSON keeps them whole), a missing one as `-`."""
        if value is None:
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else value

    rec = summary.get("recovery_seconds") or {}
    back = summary.get("back_to_training_seconds") or {}
    rows = [
        ("mode / config", f"{args.mode}, {args.replicas} x {args.procs_per_replica} debug, --chaos every "
                          f"{args.fault_every}, seed {args.seed}"),
        ("wall time", f"{wall / 60:.1f} min (exit code {code})"),
        ("faults by kind", ", ".join(f"{k} {v}" for k, v in fault_counts(soak).items())),
        ("faults injected", summary.get("faults_injected")),
        ("failures detected", summary.get("failures_detected")),
        ("recoveries finished / still open", f"{summary.get('recoveries')} / {summary.get('recoveries_open')}"),
        ("full restarts (cause)", f"{summary.get('full_restarts')} ({dict(causes) or 'none'})"),
        ("lineage resets (undetected)", f"{summary.get('lineage_resets')} ({summary.get('lineage_resets_undetected')})"),
        ("steps lost (uncommitted / resets)", f"{summary.get('steps_lost')} ({summary.get('steps_lost_uncommitted')}"
                                              f" / {summary.get('steps_lost_reset')})"),
        ("give-ups", summary.get("gave_up")),
        ("max stall of the committed step", f"{summary.get('max_stall_seconds'):.1f} s"
         if summary.get("max_stall_seconds") is not None else None),
        ("time below N replicas", f"{num(summary.get('time_below_n_seconds'), 1)} s"),
        ("vulnerability window p50 / max", f"{num(vw.get('p50'))} / {num(vw.get('max'))} s (n={vw.get('n')}, "
                                           f"open {vw.get('open')})"),
        ("recovery p50 / max", f"{num(rec.get('p50'))} / {num(rec.get('max'))} s (open {rec.get('open')})"),
        ("back to training p50 / max", f"{num(back.get('p50'))} / {num(back.get('max'))} s"),
        ("mid-round joins / that missed the holders' sync", f"{summary.get('rounds_joined')} / "
                                                            f"{summary.get('rounds_joined_missed_sync')}"),
        ("copies at steps with no vote: checked / verified", "{checked} / {verified}".format(
            **(summary.get("copies_checked") or {"checked": None, "verified": None}))),
        ("rounds given up, left out of a sync late (inner steps)", "{rounds} ({inner_steps})".format(
            **(summary.get("rounds_abandoned") or {"rounds": None, "inner_steps": None}))),
        ("recovery p50 by fault kind (n)", by_kind(summary.get("recovery_breakdown") or [])),
        ("Lighthouse restarts / steps committed without it", f"{summary.get('lighthouse_restarts')} / "
                                                              f"{summary.get('steps_without_lighthouse')}"),
        ("steps committed (soak / baseline)", f"{summary.get('steps_committed')} / {base.get('steps_committed')}"),
        ("goodput vs fault-free", f"{num(summary.get('goodput'), 3)} ({summary.get('goodput_basis')})"
         if summary.get("goodput") is not None else
         f"ESTIMATE {num(summary.get('goodput_estimate'), 3)} ({summary.get('goodput_basis')})"),
        ("loss initial -> final (baseline final)", f"{num(summary.get('initial_loss'), 3)} -> "
                                                   f"{num(summary.get('final_loss'), 3)} ({num(base.get('final_loss'), 3)})"),
        ("replicas compared at the end (of N) / at step", f"{summary.get('replicas_compared')} "
                                                          f"({args.replicas}) / {summary.get('final_step')}"),
        ("replicas identical at the end (whole state)", summary.get("replicas_consistent")),
        ("controller kills / resumes (re-attached / backstop), down s", _controller_row(summary)),
        ("state votes (disagreeing)", f"{summary.get('state_votes')} ({summary.get('state_votes_disagreeing')})"),
        ("bitflips injected / divergences found / healed (backstop)", f"{summary.get('bitflips_injected')} / "
                                                                       f"{summary.get('divergences')} / "
                                                                       f"{summary.get('divergences_healed')} "
                                                                       f"({summary.get('divergences_restored')}; "
                                                                       f"ended at the end "
                                                                       f"{summary.get('divergences_ended')})"),
        ("checker verdict (regent check)", "holds" if not violations else f"{len(violations)} violation(s)"),
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"Soak: {soak.name}")
        table.add_column("figure")
        table.add_column("value")
        for k, v in rows:
            table.add_row(k, str(v))
        Console().print(table)
    except ImportError:  # rich is a dependency; keep the plain form for piping anyway
        for k, v in rows:
            print(f"{k:40s} {v}")
    for v in violations:
        print("VIOLATION:", v)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "python": sys.version.split()[0],
              "command": " ".join(sys.argv), "soak": str(soak), "baseline": str(baseline),
              "rows": dict(rows), "violations": violations}
    res_dir = ROOT / "benchmarks/results"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"soak_{args.mode}.json").write_text(json.dumps(result, indent=2, default=str))
    return 1 if violations or code else 0


if __name__ == "__main__":
    sys.exit(main())
