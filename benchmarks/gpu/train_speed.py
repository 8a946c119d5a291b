"""Training speed of Regent's Trainer: tokens/s per device and MFU, on 1 GPU or with FSDP2 over G GPUs.

    python benchmarks/gpu/train_speed.py --model 1b --gpus 1 --steps 20
    python benchmarks/gpu/train_speed.py --model 1b --gpus 2 --steps 20 --batch-size 4,8 --compile 0,1

Every combination of --batch-size x --compile x --activation-checkpointing runs in the same worker processes
(one per GPU), one after the other: a fresh Trainer each time, `--warmup` untimed steps, then `--steps` timed
ones. Tokens/s per device = local batch x seq_len x steps / wall time of the timed steps (the Trainer
synchronizes the device at the end of each step). MFU = the Trainer's FLOPs/token (TorchTitan's formula:
6 x non-embedding params + 6 x layers x heads x head_dim x seq_len) x tokens/s / the device's peak dense bf16
FLOP/s from `regent.platform` (vendor datasheet; H100/H200 SXM = 989 TFLOP/s; override with
REGENT_PEAK_FLOPS). A configuration that runs out of memory is recorded as such and skipped.

Works on CUDA, ROCm and CPU (use `--model debug` on CPU to check the script; MFU is then unknown).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b", help="debug | 150m | 1b | 8b")
    parser.add_argument("--gpus", type=int, default=1, help="processes (one GPU each); > 1 shards with FSDP2")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocation, autotuning)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", default="4", help="local batch size(s), comma-separated")
    parser.add_argument("--compile", default="0", help="0,1: torch.compile of each block (comma list)")
    parser.add_argument("--activation-checkpointing", default="0", help="0,1 (comma list)")
    parser.add_argument("--replicate", type=int, default=1,
                        help="> 1: plain HSDP, this many replicas of --gpus/--replicate FSDP shards (no FT)")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds before the workers are stopped")
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--gpus and --steps must be >= 1 and --warmup >= 0")
    return args


def worker(args: argparse.Namespace) -> int:
    import torch

    from regent.train.config import TrainConfig
    from regent.train.trainer import Trainer

    rank, world = args.worker_rank, args.gpus
    _common.setup_logging(f"train_speed {rank}")
    device = _common.init_default_group(rank, world, args.rendezvous)
    info = _common.machine_info() if rank == 0 else {}
    combos = itertools.product(_common.parse_list(args.batch_size), _common.parse_list(args.compile),
                               _common.parse_list(args.activation_checkpointing))
    for batch, compiled, checkpointed in combos:
        name = f"{args.model} gpus={world} replicate={args.replicate} batch={batch} seq={args.seq_len} compile={compiled} ac={checkpointed}"
        cfg = TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=batch, lr=3e-4, warmup_steps=10,
                          max_steps=10_000, compile=bool(compiled), activation_checkpointing=bool(checkpointed),
                          hsdp_replicate=args.replicate)
        record: dict = {"bench": "train_speed", "model": args.model, "gpus": world, "replicate": args.replicate,
                        "batch_size": batch,
                        "seq_len": args.seq_len, "compile": bool(compiled), "activation_checkpointing":
                        bool(checkpointed), "steps": args.steps, **info}
        trainer = None
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            trainer = Trainer(cfg, rank=rank, world_size=world, device=device)
            for _ in range(args.warmup):
                trainer.train_step()
            _common.sync(device)
            start = time.perf_counter()
            losses = [trainer.train_step()["loss"] for _ in range(args.steps)]
            elapsed = time.perf_counter() - start
            per_device = batch * args.seq_len * args.steps / elapsed
            peak = trainer.peak_flops
            record.update(
                status="ok", seconds=elapsed, step_time_s=elapsed / args.steps, tokens_per_s_per_device=per_device,
                tokens_per_s_total=per_device * world, flops_per_token=trainer.flops_per_token,
                num_params=trainer.num_params, peak_flops=peak,
                mfu=(trainer.flops_per_token * per_device / peak) if peak else None,
                first_loss=losses[0], last_loss=losses[-1],
                peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            )
        except torch.cuda.OutOfMemoryError as err:
            record.update(status="oom", error=str(err).splitlines()[0])
            if world > 1:  # the other ranks are stuck in a collective; nothing sane to continue with
                print(f"rank {rank}: {name}: out of memory under FSDP; stopping", file=sys.stderr, flush=True)
                if rank == 0:
                    _common.append_result(args.out, record)
                return 3
        finally:
            if trainer is not None:
                trainer.close()
            del trainer
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if compiled:
                torch._dynamo.reset()
        if rank == 0:
            _common.append_result(args.out, record)
            if record["status"] == "ok":
                mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
                print(f"{name}: {record['tokens_per_s_per_device']:,.0f} tok/s/device, MFU {mfu} (vs vendor peak), "
                      f"step {1000 * record['step_time_s']:.0f} ms, peak mem {record['peak_mem_gib'] or 0:.1f} GiB",
                      flush=True)
            else:
                print(f"{name}: {record['status']}", flush=True)
    return _common.end_worker()


def main(argv: list[str] | None = None) -> int:
    return _common.worker_or_launcher(__file__, parse_args(argv), argv, worker)


if __name__ == "__main__":
    sys.exit(main())
