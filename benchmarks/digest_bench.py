"""What a state vote's digest costs: `regent.ft.digest.state_digest` over a replica's whole training state,
against one training step, and against the host sha256 that compared replicas before it (issue 32).

    .venv/bin/python benchmarks/digest_bench.py --model debug                       # CPU (no GPU: auto)
    .venv/bin/python benchmarks/digest_bench.py --model 150m --steps 3 --repeats 3  # CPU, a bigger state
    python benchmarks/digest_bench.py --model 1b                                    # one GPU (auto: cuda)
    python benchmarks/digest_bench.py --model 1b --device cpu --threads 16          # force the CPU

Method: one Trainer of Regent's built-in trainer (rank 0 of 1, replica 0 of 1, the same `TrainConfig` as
`train_bench.py`: seq 256 batch 8 on CPU, seq 2048 batch 4 on GPU), `--warmup` untimed steps (at least one,
so the AdamW moments exist), then `--steps` timed steps, each between two device syncs; step time = their
median. On `trainer.state_dict()` (parameters, both AdamW moments and step counts, schedule, data position,
step), after one untimed call, the median of `--repeats` timed calls, each between two device syncs, of:

- Regent on-device digest: `state_digest(state)` (two int64 sums per tensor on its device, 16 bytes per
  tensor to the host, sha256 of those);
- anchor, host sha256, params only: what `Trainer.param_hash` did before the votes: sha256 over every
  parameter's name and bytes copied to the host (`p.detach().contiguous().cpu().view(torch.uint8)`);
- anchor, host sha256, full state: the same over every tensor of the state (and the repr of the other
  leaves), so the anchor covers what the digest covers.

Reported per row: bytes hashed, seconds, GB/s (1e9 bytes/s), the cost as a percent of one step and of K steps
(K = 1, 10, 100: a vote every K commits), and the smallest K that keeps it at or under `--budget` (1%) of step
time. `--json PATH` writes every figure. `--device` forces cpu or cuda (ROCm builds are "cuda" too; on cpu
`GPU_PLATFORM=cpu` is set for the run so Regent's platform helpers agree); `--threads` sets torch's CPU
threads (default: torch's own default).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from typing import Any

from regent.ft.config import VOTE_STEPS

ROWS = ("Regent on-device digest", "anchor host sha256 params-only", "anchor host sha256 full state")
K_VALUES = (1, 10, 100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="debug", help="debug | 150m | 1b | 8b")
    parser.add_argument("--steps", type=int, default=10, help="timed train steps (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed train steps first (>= 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed digests per method (median), after one warm-up")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 256 on CPU, 2048 on GPU")
    parser.add_argument("--batch-size", type=int, default=None, help="default 8 on CPU, 4 on GPU")
    parser.add_argument("--budget", type=float, default=0.01, help="fraction of step time a vote may cost")
    parser.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 1:
        parser.error("--steps, --repeats and --warmup must be >= 1 (a warm-up step creates the AdamW moments)")
    if not 0 < args.budget < 1:
        parser.error("--budget is a fraction in (0, 1), e.g. 0.01")
    return args


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> tuple[list[float], Any]:
    """One untimed call, then `repeats` timed ones, each between device syncs; (seconds, last result)."""
    result = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times, result


def _tensors(tree: Any, path: str, out: list[tuple[str, Any]], others: list[str]) -> None:
    """The tree's tensors in a fixed order (sorted dict keys), and the repr of its other leaves."""
    import torch

    if isinstance(tree, torch.Tensor):
        out.append((path, tree))
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            _tensors(tree[key], f"{path}/{key}", out, others)
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            _tensors(value, f"{path}/{i}", out, others)
    else:
        others.append(f"{path}={tree!r}")


def host_sha256(named: list[tuple[str, Any]], others: tuple[str, ...] | list[str] = ()) -> str:
    """The pre-vote comparison: sha256 over each tensor's name and bytes, copied to the host one by one."""
    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, t in named:
            digest.update(name.encode())
            host = t.detach().contiguous().cpu()
            digest.update((host.reshape(1) if host.dim() == 0 else host).view(torch.uint8).numpy().tobytes())
    for leaf in others:
        digest.update(leaf.encode())
    return digest.hexdigest()


def cost_row(name: str, nbytes: int, times: list[float], step_s: float, budget: float) -> dict[str, Any]:
    seconds = statistics.median(times)
    return {
        "name": name,
        "bytes": nbytes,
        "seconds": seconds,
        "seconds_all": times,
        "step_seconds": step_s,
        "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else None,
        "pct_of_step": 100 * seconds / step_s,
        "pct_of_k_steps": {str(k): 100 * seconds / (k * step_s) for k in K_VALUES},
        "min_k": max(1, math.ceil(seconds / (budget * step_s) - 1e-9)),
    }


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def markdown_table(rows: list[dict[str, Any]], budget: float) -> str:
    pct = f"{100 * budget:g}%"
    head = ["method", "bytes hashed", "time (ms)", "GB/s", "step (ms)", "% of 1 step",
            *(f"% of {k} steps" for k in K_VALUES[1:]), f"smallest K <= {pct}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["name"], _size(r["bytes"]), f"{1000 * r['seconds']:.2f}",
                 f"{r['gb_per_s']:.2f}" if r["gb_per_s"] is not None else "n/a", f"{1000 * r['step_seconds']:.1f}",
                 f"{r['pct_of_step']:.2f}", *(f"{r['pct_of_k_steps'][str(k)]:.3f}" for k in K_VALUES[1:]),
                 str(r["min_k"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and not os.environ.get("GPU_PLATFORM"):
        os.environ["GPU_PLATFORM"] = "cpu"  # Regent's platform helpers (memory stats, peak FLOP/s) agree
    import torch

    from regent import platform
    from regent.ft.digest import state_digest
    from regent.train.config import TrainConfig
    from regent.train.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = platform.device_for_local_rank(0)
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: torch sees no GPU", file=sys.stderr)
            return 2
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    on_gpu = device.type == "cuda"
    seq_len = args.seq_len or (2048 if on_gpu else 256)
    batch = args.batch_size or (4 if on_gpu else 8)
    cfg = TrainConfig(model=args.model, seq_len=seq_len, batch_size=batch, lr=3e-4, warmup_steps=10,
                      max_steps=10_000)
    trainer = Trainer(cfg, rank=0, world_size=1, replica_index=0, num_replicas=1, device=device)
    try:
        for _ in range(args.warmup):
            trainer.train_step()
        step_times = []
        for _ in range(args.steps):
            _sync(device)
            start = time.perf_counter()
            trainer.train_step()
            _sync(device)
            step_times.append(time.perf_counter() - start)
        step_s = statistics.median(step_times)

        state = trainer.state_dict()
        moments = sum(1 for s in state["optimizer"]["state"].values() for k in ("exp_avg", "exp_avg_sq") if k in s)
        if moments != 2 * len(trainer.params):
            raise RuntimeError(f"expected 2 AdamW moments per parameter after warm-up, found {moments} for "
                               f"{len(trainer.params)} parameters")
        all_tensors: list[tuple[str, Any]] = []
        others: list[str] = []
        _tensors(state, "", all_tensors, others)
        params = list(zip(trainer.param_names, trainer.params))
        full_bytes = sum(t.numel() * t.element_size() for _, t in all_tensors)
        param_bytes = sum(p.numel() * p.element_size() for _, p in params)

        digest_times, digest = _timed(lambda: state_digest(state), device, args.repeats)
        if state_digest(state) != digest:
            raise RuntimeError("state_digest is not deterministic on an unchanged state")
        params_times, _ = _timed(lambda: host_sha256(params), device, args.repeats)
        full_times, _ = _timed(lambda: host_sha256(all_tensors, others), device, args.repeats)
        rows = [cost_row(ROWS[0], full_bytes, digest_times, step_s, args.budget),
                cost_row(ROWS[1], param_bytes, params_times, step_s, args.budget),
                cost_row(ROWS[2], full_bytes, full_times, step_s, args.budget)]
        result = {
            "bench": "digest_bench", "model": args.model, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            "platform": platform.detect_platform(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "num_params": trainer.num_params,
            "seq_len": seq_len, "batch_size": batch, "bf16": trainer.bf16, "warmup": args.warmup,
            "steps": args.steps, "repeats": args.repeats, "budget": args.budget, "step_time_s": step_s,
            "step_times_s": step_times, "tensors": len(all_tensors), "state_bytes": full_bytes,
            "param_bytes": param_bytes, "digest": digest, "rows": rows,
        }
    finally:
        trainer.close()

    print(f"{args.model} ({trainer.num_params / 1e6:.1f}M params, {len(all_tensors)} state tensors, "
          f"{_size(full_bytes)} of state) on {result['device_name']} ({result['platform']}, "
          f"{result['threads']} torch threads), seq {seq_len} batch {batch}: median step "
          f"{1000 * step_s:.1f} ms over {args.steps}, digests median of {args.repeats}")
    print()
    print(markdown_table(rows, args.budget))
    print()
    print(f"vote every K commits at <= {100 * args.budget:g}% of step time: K >= {rows[0]['min_k']} "
          f"(default ft.vote_every: every {VOTE_STEPS} training steps, rounded to commits)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
