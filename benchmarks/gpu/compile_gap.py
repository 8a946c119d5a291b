"""Regent's built-in trainer against TorchTitan, eager and compiled, in one run: speed, profile, compile counters.

    python3 benchmarks/gpu/compile_gap.py --out $OUT                       # this checkout's src/ only
    python3 benchmarks/gpu/compile_gap.py --src after=.benchsrc/src --src before=.benchsrc/base/src \\
        --stages after,titan0,titan1,before --out $OUT

Stages run one after the other on the same GPU, each in its own process with its own time limit:
- a label given with `--src LABEL=PATH` runs Regent's Trainer from that source tree (PYTHONPATH), for every
  `--compile` mode: `--warmup` untimed steps (compile and autotuning happen there), `--steps` timed ones (the
  Trainer synchronizes at the end of each step), then `--profile-steps` steps under torch.profiler whose trace
  is summarized by `_trace.summarize_trace`; plus torch._dynamo's counters (graph breaks, unique graphs,
  recompiles) and the loss of every step, to compare numerics between source trees;
- `titan0` / `titan1`: TorchTitan's own Trainer eager / compiled (`titan_speed.py`, same model shape, batch and
  sequence length, `--profile` so its last steps are traced and summarized the same way).

Every record goes to <out>/results.jsonl; a side-by-side table ends the output. Data: Regent trains on its
built-in corpus, TorchTitan on random token ids (speed only). One GPU; NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _trace  # noqa: E402 - after the path insert

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONUNBUFFERED": "1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per Regent configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed Regent steps first")
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled steps after the timed ones (0: none)")
    parser.add_argument("--compile", default="0,1", help="Regent modes, comma list of 0/1")
    parser.add_argument("--src", action="append", default=[],
                        help="LABEL=PATH of a Regent source tree (repeatable); default: now=<repo>/src")
    parser.add_argument("--stages", default=None,
                        help="comma list of --src labels and titan0/titan1 (default: every label, then both)")
    parser.add_argument("--titan-steps", type=int, default=20)
    parser.add_argument("--titan-warmup", type=int, default=5)
    parser.add_argument("--stage-timeout", type=float, default=240, help="seconds per stage before it is stopped")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-bench")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the label this process measures
    return parser.parse_args(argv)


def sources(args: argparse.Namespace) -> dict[str, str]:
    pairs = args.src or [f"now={HERE.parent.parent / 'src'}"]
    out = {}
    for pair in pairs:
        label, sep, path = pair.partition("=")
        if not sep or not label or label.startswith("titan"):
            raise SystemExit(f"--src {pair!r}: use LABEL=PATH (labels other than titan*)")
        out[label] = str(Path(path).resolve())
    return out


# ---------------------------------------------------------------------------------------------------------
# Parent: the stages, then the table.
# ---------------------------------------------------------------------------------------------------------

def run_stage(command: list[str], env: dict[str, str], timeout: float) -> int:
    print(f"=== {time.strftime('%H:%M:%S')} " + " ".join(command), flush=True)
    start = time.monotonic()
    try:
        code = subprocess.run(command, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = 124
    print(f"=== rc={code} in {time.monotonic() - start:.0f} s", flush=True)
    return code


def parent(args: argparse.Namespace) -> int:
    srcs = sources(args)
    stages = (args.stages.split(",") if args.stages else [*srcs, "titan0", "titan1"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ, **SAFE_ENV)
    extra_path = [p for p in base_env.get("PYTHONPATH", "").split(":") if p and not p.endswith("src")]
    codes = []
    for stage in stages:
        if stage in ("titan0", "titan1"):
            command = [sys.executable, str(HERE / "titan_speed.py"), "--gpus", "1", "--batch-size",
                       str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.titan_steps),
                       "--warmup", str(args.titan_warmup), "--compile", stage[-1], "--loss", "ce", "--profile",
                       "--out", args.out, "--timeout", str(args.stage_timeout - 10)]
            env = dict(base_env, PYTHONPATH=":".join([next(iter(srcs.values())), *extra_path]))
        elif stage in srcs:
            command = [sys.executable, __file__, "--worker", stage, "--model", args.model, "--batch-size",
                       str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
                       "--compile", args.compile, "--out", args.out]
            env = dict(base_env, PYTHONPATH=":".join([srcs[stage], *extra_path]))
        else:
            raise SystemExit(f"unknown stage {stage!r}: use a --src label or titan0/titan1")
        codes.append(run_stage(command, env, args.stage_timeout))
    print_table(Path(args.out) / "results.jsonl")
    return 0 if all(code == 0 for code in codes) else 1


def print_table(path: Path) -> None:
    if not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"\n{'trainer':>22} {'mode':>8} {'tok/s/GPU':>10} {'step ms':>8} {'busy ms':>8} {'peak GiB':>9}")
    for r in rows:
        if r.get("bench") == "compile_gap":
            who, tps, mem = f"regent[{r['label']}]", r.get("tokens_per_s"), r.get("peak_mem_gib")
        elif r.get("bench") == "titan_speed":
            who, tps, mem = "torchtitan", r.get("tokens_per_s_per_gpu"), r.get("peak_mem_gib")
        else:
            continue
        mode = "compiled" if r.get("compile") else "eager"
        busy = (r.get("profile") or {}).get("device_busy_ms_per_step")
        step = 1000 * r["batch_size"] * r["seq_len"] / tps if tps else None
        cells = [f"{tps:,.0f}" if tps else r.get("status", "?"), f"{step:.1f}" if step else "-",
                 f"{busy:.1f}" if busy else "-", f"{mem:.1f}" if mem else "-"]
        print(f"{who:>22} {mode:>8} {cells[0]:>10} {cells[1]:>8} {cells[2]:>8} {cells[3]:>9}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Worker: Regent's Trainer from the source tree on PYTHONPATH.
# ---------------------------------------------------------------------------------------------------------

def dynamo_counters() -> dict:
    """torch._dynamo's counters as plain dicts, plus the totals that matter here."""
    from torch._dynamo.utils import counters

    table = {group: {str(k): v for k, v in values.items()} for group, values in counters.items() if values}
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"].get("unique_graphs", 0),
            "recompiles": sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else 0,
            "counters": table}


def measure(args: argparse.Namespace, compiled: bool, device) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import regent
    from regent.train.config import TrainConfig
    from regent.train.trainer import Trainer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.cuda.reset_peak_memory_stats(device)
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, lr=3e-4, warmup_steps=10,
                      max_steps=10_000, compile=compiled)
    record: dict = {"bench": "compile_gap", "label": args.worker, "regent_src": str(Path(regent.__file__).parent),
                    "model": args.model, "gpus": 1, "batch_size": args.batch_size, "seq_len": args.seq_len,
                    "compile": compiled, "steps": args.steps, "warmup": args.warmup}
    trainer = None
    try:
        built = time.perf_counter()
        trainer = Trainer(cfg, rank=0, world_size=1, device=device)
        record["build_s"] = time.perf_counter() - built
        warm = time.perf_counter()
        warm_losses = [trainer.train_step()["loss"] for _ in range(args.warmup)]
        record["warmup_s"] = time.perf_counter() - warm
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        steps = [trainer.train_step() for _ in range(args.steps)]
        elapsed = time.perf_counter() - start
        tps = args.batch_size * args.seq_len * args.steps / elapsed
        record.update(status="ok", seconds=elapsed, tokens_per_s=tps, step_ms=[1000 * s["step_time_s"] for s in steps],
                      mfu=trainer.flops_per_token * tps / trainer.peak_flops if trainer.peak_flops else None,
                      flops_per_token=trainer.flops_per_token, losses=warm_losses + [s["loss"] for s in steps],
                      peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                      loss_fn=type(getattr(trainer, "loss_fn", None)).__name__)
        if args.profile_steps > 0:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.profile_steps):
                    trainer.train_step()
            with tempfile.TemporaryDirectory() as tmp:
                trace = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(trace))
                record["profile"] = _trace.summarize_trace(trace, args.profile_steps)
        record["dynamo"] = dynamo_counters()
    except torch.cuda.OutOfMemoryError as err:
        record.update(status="oom", error=str(err).splitlines()[0])
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    return record


def worker(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, str(HERE))
    import _common

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    info = _common.machine_info()
    for compiled in [bool(int(c)) for c in args.compile.split(",") if c.strip()]:
        record = measure(args, compiled, device)
        record.update(info)
        _common.append_result(args.out, record)
        mode = "compiled" if compiled else "eager"
        if record["status"] == "ok":
            print(f"regent[{args.worker}] {mode}: {record['tokens_per_s']:,.0f} tok/s, MFU "
                  f"{100 * (record['mfu'] or 0):.1f}%, peak {record['peak_mem_gib']:.1f} GiB, "
                  f"graph breaks {record['dynamo']['graph_breaks']}, unique graphs "
                  f"{record['dynamo']['unique_graphs']}, losses {[round(x, 4) for x in record['losses']]}",
                  flush=True)
            if "profile" in record:
                _trace.print_summary(f"regent[{args.worker}] {mode} profile", record["profile"])
        else:
            print(f"regent[{args.worker}] {mode}: {record['status']}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    sys.exit(main())
