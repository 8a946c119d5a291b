"""Trainer throughput: tokens/s (per device and total) and MFU for one replica group.

    .venv/bin/python benchmarks/train_bench.py --model debug --steps 20            # CPU, one process
    .venv/bin/python benchmarks/train_bench.py --model debug --steps 20 --procs 2  # CPU, FSDP over Gloo
    python benchmarks/train_bench.py --model 1b --steps 20 --seq-len 2048 --batch-size 4 [--compile]
    python benchmarks/train_bench.py --model 1b --steps 20 --procs 2               # 2 GPUs, FSDP over NCCL

Method: `--warmup` untimed steps (allocation, autotuning, compilation), then `--steps` timed ones. Tokens/s per
device = local batch x seq_len x timed steps / their wall time (each step ends with a device sync). MFU uses
TorchTitan's FLOPs/token (6 x non-embedding params + 6 x layers x heads x head_dim x seq_len) and the device's
peak dense bf16 FLOP/s from `regent.platform` (REGENT_PEAK_FLOPS overrides). With --procs > 1 the ranks are
launched through `regent.train.launch.run_no_ft` and the figures come from its summary.json (which averages
every step after the first two).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Regent trainer throughput")
    parser.add_argument("--model", default="debug", help="debug | 150m | 1b | 8b")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--seq-len", type=int, default=None, help="default 256 on CPU, 2048 on GPU")
    parser.add_argument("--batch-size", type=int, default=None, help="per rank; default 8 on CPU, 4 on GPU")
    parser.add_argument("--procs", type=int, default=1, help="> 1: FSDP over this many local processes/GPUs")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="CPU torch threads (default: all cores)")
    parser.add_argument("--json", default=None, help="also write the result as JSON to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from regent import platform
    from regent.train.config import TrainConfig

    on_gpu = platform.device_type() != "cpu"
    seq_len = args.seq_len or (2048 if on_gpu else 256)
    batch = args.batch_size or (4 if on_gpu else 8)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    cfg = TrainConfig(model=args.model, seq_len=seq_len, batch_size=batch, lr=3e-4, warmup_steps=10,
                      max_steps=10_000, compile=args.compile, activation_checkpointing=args.activation_checkpointing)
    result = {"model": args.model, "platform": platform.detect_platform(), "procs": args.procs, "seq_len": seq_len,
              "batch_size": batch, "compile": args.compile, "activation_checkpointing": args.activation_checkpointing,
              "device_name": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__}
    if args.procs == 1:
        from regent.train.trainer import Trainer

        trainer = Trainer(cfg)
        for _ in range(args.warmup):
            trainer.train_step()
        start = time.perf_counter()
        records = [trainer.train_step() for _ in range(args.steps)]
        elapsed = time.perf_counter() - start
        per_device = batch * seq_len * args.steps / elapsed
        mfu = None if trainer.peak_flops is None else trainer.flops_per_token * per_device / trainer.peak_flops
        result.update(num_params=trainer.num_params, tokens_per_s=per_device, tokens_per_s_per_device=per_device,
                      mfu=mfu, final_loss=records[-1]["loss"], peak_mem_bytes=records[-1]["peak_mem_bytes"],
                      step_time_s=elapsed / args.steps)
    else:
        from regent.train.launch import run_no_ft

        with tempfile.TemporaryDirectory() as run_dir:
            code = run_no_ft(cfg, args.procs, args.warmup + args.steps, run_dir)
            if code != 0:
                print(f"training failed with exit code {code}", file=sys.stderr)
                return code
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
        result.update({k: summary[k] for k in ("num_params", "tokens_per_s", "tokens_per_s_per_device", "mfu",
                                               "final_loss", "peak_mem_bytes")})
    mfu_text = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "n/a (no peak FLOP/s for CPU)"
    print(f"{args.model} ({result['num_params'] / 1e6:.1f}M params) on {result['device_name']} x{args.procs}: "
          f"seq {seq_len} batch {batch}/rank compile={args.compile} ac={args.activation_checkpointing}")
    print(f"  tokens/s total {result['tokens_per_s']:,.0f}  per device {result['tokens_per_s_per_device']:,.0f}  "
          f"MFU {mfu_text}  peak mem {result['peak_mem_bytes'] / 2**30:.1f} GiB  loss {result['final_loss']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
