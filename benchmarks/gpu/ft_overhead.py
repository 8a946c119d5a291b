"""Cost of fault tolerance: tokens/s with Regent's Manager against the same model without it, in one run.

    python benchmarks/gpu/ft_overhead.py --model 1b --steps 40

Two workers, one accelerator each, i.e. 2 replicas x 1 GPU. The modes run one after the other in the same
processes, each with a fresh Trainer (same model, same local batch), `--warmup` untimed steps, then
`--steps` timed ones:

* `local`     -- no cross-replica communication at all: the per-GPU ceiling.
* `ddp`       -- plain `torch.nn.parallel.DistributedDataParallel` over both GPUs (bucketed gradient
                 all-reduce overlapped with backward), no fault tolerance: the usual way to train this.
* `fsdp`      -- the Trainer's FSDP2 over both GPUs, no fault tolerance.
* `ft_step`   -- `regent.orchestrate.session.TrainingSession` with `ft.mode=ddp`: the Manager's quorum every
                 step (async, overlapped with forward), a per-step cross-replica gradient all-reduce on the
                 Manager's reconfigurable NCCL group, and the commit vote.
  `ft_step:MB` sets the gradient bucket size (default `ft.bucket_mb`, 25 MiB); `ft_step:0` averages all
                 gradients in one flat all-reduce after backward (no overlap), for comparison.
* `ft_diloco` -- the same session with `ft.mode=diloco`, `sync_every` inner steps between pseudo-gradient
                 syncs (needs `regent.ft.local_sgd`; recorded as unavailable otherwise).

A Lighthouse runs in the launching process. Overheads are reported against `ddp` (targets: <= 3% for
per-step mode, <= 1% for DiLoCo) and, for reference, against `local` and `fsdp`. The first steps of each FT
mode include the initial sync (replica 1 pulls replica 0's weights); they fall inside the warm-up.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MODES = ("local", "ddp", "fsdp", "ft_step", "ft_diloco")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode (cover >= 2 DiLoCo syncs)")
    parser.add_argument("--warmup", type=int, default=24,
                        help="untimed steps; > --sync-every so the first DiLoCo sync (NCCL ring set-up) is not timed")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4, help="local batch per GPU")
    parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo inner steps per sync")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--compile", type=int, default=0)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=1500)
    _common.add_common_args(parser)
    args = parser.parse_args(argv)
    unknown = {m.split(":")[0] for m in _common.parse_list(args.modes, str)} - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def _train_config(args: argparse.Namespace):
    from regent.train.config import TrainConfig

    return TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, lr=3e-4,
                       warmup_steps=10, max_steps=10_000, compile=bool(args.compile))


def _time_steps(step, device, warmup: int, steps: int) -> tuple[float, list[dict]]:
    for _ in range(warmup):
        step()
    _common.sync(device)
    start = time.perf_counter()
    records = []
    for _ in range(steps):
        begin = time.perf_counter()
        record = step()
        record["outer_step_s"] = time.perf_counter() - begin  # the whole step, hooks and syncs included
        records.append(record)
    _common.sync(device)
    return time.perf_counter() - start, records


def _step_times(records: list[dict]) -> list[float]:
    return [round(r["outer_step_s"], 4) for r in records]


def _run_mode(mode: str, args: argparse.Namespace, rank: int, device, out_dir: str) -> dict:
    import torch.distributed as dist

    from regent.train.trainer import Trainer

    cfg = _train_config(args)
    if mode in ("local", "ddp"):
        trainer = Trainer(cfg, rank=0, world_size=1, replica_index=rank, num_replicas=2, device=device)
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            trainer.model = DistributedDataParallel(trainer.model, device_ids=[device] if device.type == "cuda"
                                                    else None, gradient_as_bucket_view=True)
        try:
            elapsed, records = _time_steps(trainer.train_step, device, args.warmup, args.steps)
        finally:
            trainer.close()
        return {"seconds": elapsed, "committed": sum(bool(r["committed"]) for r in records),
                "step_times": _step_times(records)}
    if mode == "fsdp":
        trainer = Trainer(cfg, rank=rank, world_size=2, device=device)
        try:
            elapsed, records = _time_steps(trainer.train_step, device, args.warmup, args.steps)
        finally:
            trainer.close()
        return {"seconds": elapsed, "committed": sum(bool(r["committed"]) for r in records),
                "step_times": _step_times(records)}

    # Fault-tolerant modes: the real per-rank session the orchestrator drives.
    from regent.ft.config import FTConfig
    from regent.orchestrate.config import RunConfig
    from regent.orchestrate.session import TrainingSession

    base, _, bucket_mb = mode.partition(":")
    ft = FTConfig(mode="ddp" if base == "ft_step" else "diloco", sync_every=args.sync_every, min_replica_size=1,
                  timeout_s=120, quorum_timeout_s=120, connect_timeout_s=60, lighthouse=args.lighthouse)
    if bucket_mb:
        ft.bucket_mb = float(bucket_mb)
    run_cfg = RunConfig(replicas=2, procs_per_replica=1,
                        run_dir=str(Path(out_dir) / f"ft_overhead_{mode.replace(':', '_')}"),
                        recovery="peer", train=cfg, ft=ft)
    events: list[tuple[str, dict]] = []
    session = TrainingSession(run_cfg, replica_index=rank, rank=0, world_size=1, generation=0,
                              lighthouse_addr=args.lighthouse, on_event=lambda k, d: events.append((k, d)))
    dist.barrier()  # both replicas constructed before anyone asks for a quorum
    try:
        elapsed, records = _time_steps(session.step, device, args.warmup, args.steps)
        extra = 0
        while not session.at_boundary() and extra < args.sync_every:  # DiLoCo replicas agree only after a sync
            session.step()
            extra += 1
        digest = session.param_hash()
    finally:
        session.close()
    heals = [d for k, d in events if k == "heal_done"]
    return {"seconds": elapsed, "committed": sum(bool(r.get("committed", True)) for r in records),
            "step_times": _step_times(records), "param_hash": digest, "heals": heals,
            "quorums": sum(1 for k, _ in events if k == "quorum"),
            "participants_last": records[-1].get("participants") if records else None}


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank = args.worker_rank
    _common.setup_logging(f"ft_overhead {rank}")
    device = _common.init_default_group(rank, 2, args.rendezvous)
    # TrainingSession pins torch's CPU threads (REGENT_TORCH_THREADS, default 1); every mode gets the same.
    torch.set_num_threads(int(os.environ.get("REGENT_TORCH_THREADS", "1")))
    info = _common.machine_info() if rank == 0 else {}
    tokens = args.batch_size * args.seq_len * args.steps
    results: dict[str, dict] = {}
    for mode in _common.parse_list(args.modes, str):
        if mode == "ft_diloco":
            try:
                import regent.ft.local_sgd  # noqa: F401
            except ImportError as err:
                results[mode] = {"status": "unavailable", "error": str(err)}
                continue
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            result = _run_mode(mode, args, rank, device, args.out)
            result["status"] = "ok"
            result["tokens_per_s_per_gpu"] = tokens / result["seconds"]
        except Exception as err:  # noqa: BLE001 - reported; one broken mode must not hide the others' figures
            import traceback

            traceback.print_exc()
            result = {"status": "error", "error": f"{type(err).__name__}: {err}"}
        if device.type == "cuda":
            result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        both = [None, None]
        dist.all_gather_object(both, result)
        results[mode] = {"ranks": both, "status": "ok" if all(r["status"] == "ok" for r in both) else "error"}
        if results[mode]["status"] == "ok":
            results[mode]["tokens_per_s_per_gpu"] = statistics.mean(r["tokens_per_s_per_gpu"] for r in both)
        if rank == 0:
            rate = results[mode].get("tokens_per_s_per_gpu")
            print(f"mode {mode}: " + (f"{rate:,.0f} tok/s/GPU" if rate else str(both)), flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        def rate(mode: str) -> float | None:
            return results.get(mode, {}).get("tokens_per_s_per_gpu")

        summary = {"bench": "ft_overhead", "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "steps": args.steps, "warmup": args.warmup, "sync_every": args.sync_every, **info,
                   "modes": results}
        ft_modes = [m for m in results if m.startswith("ft_")]
        for ft_mode in ft_modes:
            for base in ("ddp", "local", "fsdp"):
                if rate(ft_mode) and rate(base):
                    summary[f"overhead_{ft_mode}_vs_{base}"] = 1 - rate(ft_mode) / rate(base)
        for key, value in summary.items():
            if key.startswith("overhead_"):
                print(f"{key}: {100 * value:+.2f}%", flush=True)
        for ft_mode in ft_modes:
            hashes = {r.get("param_hash") for r in results.get(ft_mode, {}).get("ranks", []) or [] if r}
            if hashes and None not in hashes:
                summary[f"{ft_mode}_replicas_identical"] = len(hashes) == 1
                print(f"{ft_mode}: replicas bit-identical at the end: {len(hashes) == 1}", flush=True)
        _common.append_result(args.out, summary)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_rank is not None:
        return worker(args)
    from regent.ft.lighthouse import LighthouseServer

    _common.setup_logging("ft_overhead lighthouse")
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000, quorum_tick_ms=20,
                          heartbeat_timeout_ms=5000) as lighthouse:
        forwarded = list(sys.argv[1:] if argv is None else argv)
        return _common.launch_workers(__file__, forwarded, 2, args.timeout,
                                      extra_args=["--lighthouse", lighthouse.address()])


if __name__ == "__main__":
    sys.exit(main())
