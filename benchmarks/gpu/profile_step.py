"""Where one training step's time goes: device busy vs idle, and the top kernels, under torch.profiler.

    python benchmarks/gpu/profile_step.py --model 1b --gpus 1 --batch-size 8
    python benchmarks/gpu/profile_step.py --model 1b --gpus 2 --batch-size 4

Runs `--warmup` untimed steps of Regent's Trainer, then profiles `--steps` steps. Prints, for rank 0: wall time
per step, the time the device was busy (the union of kernel and memcpy intervals, so overlapping streams count
once), the idle remainder, and the kernels with the most total device time grouped by name. The same figures
go to $OUT/results.jsonl and a Chrome trace of rank 0 to $OUT/trace_<config>.json.gz (open in Perfetto).
Works on CUDA and ROCm (and CPU with `--model debug`, where only the CPU side is recorded).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b", help="debug | 150m | 1b | 8b")
    parser.add_argument("--gpus", type=int, default=1, help="processes (one GPU each); > 1 shards with FSDP2")
    parser.add_argument("--batch-size", type=int, default=4, help="local batch size")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--timeout", type=float, default=600)
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.steps < 1:
        parser.error("--gpus and --steps must be >= 1")
    return args


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (device activity on several streams counts once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def worker(args: argparse.Namespace) -> int:
    from torch.profiler import ProfilerActivity, profile

    from regent.train.config import TrainConfig
    from regent.train.trainer import Trainer

    rank, world = args.worker_rank, args.gpus
    _common.setup_logging(f"profile_step {rank}")
    device = _common.init_default_group(rank, world, args.rendezvous)
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, lr=3e-4,
                      warmup_steps=10, max_steps=10_000)
    trainer = Trainer(cfg, rank=rank, world_size=world, device=device)
    for _ in range(args.warmup):
        trainer.train_step()
    _common.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        wall = (time.perf_counter() - start) / args.steps
    trainer.close()
    if rank == 0:
        device_events = [e for e in prof.events() if e.device_type.name in ("CUDA", "PrivateUse1")]
        intervals = [(e.time_range.start, e.time_range.end) for e in device_events]
        busy = busy_seconds(intervals) / 1e6 / args.steps
        by_name: dict[str, list[float]] = {}
        for e in device_events:
            entry = by_name.setdefault(e.name, [0.0, 0])
            entry[0] += (e.time_range.end - e.time_range.start) / 1e6 / args.steps
            entry[1] += 1
        top = sorted(by_name.items(), key=lambda item: -item[1][0])[: args.top]
        name = f"{args.model}_g{world}_b{args.batch_size}"
        record = {"bench": "profile_step", "model": args.model, "gpus": world, "batch_size": args.batch_size,
                  "seq_len": args.seq_len, "steps": args.steps, "wall_s_per_step": wall,
                  "device_busy_s_per_step": busy, "device_idle_s_per_step": wall - busy,
                  "top_kernels": [{"name": n[:160], "s_per_step": s, "calls_per_step": c / args.steps}
                                  for n, (s, c) in top], **_common.machine_info()}
        _common.append_result(args.out, record)
        print(f"{name}: wall {1000 * wall:.1f} ms/step, device busy {1000 * busy:.1f} ms, "
              f"idle {1000 * (wall - busy):.1f} ms")
        for n, (s, c) in top:
            print(f"  {1000 * s:8.2f} ms  {c / args.steps:6.0f}x  {n[:110]}")
        trace = Path(args.out) / f"trace_{name}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        print(json.dumps({"trace": f"{trace}.gz"}))
    return _common.end_worker()


def main(argv: list[str] | None = None) -> int:
    return _common.worker_or_launcher(__file__, parse_args(argv), argv, worker)


if __name__ == "__main__":
    sys.exit(main())
