"""Gloo with GPU tensors (replicas sharing one GPU, `--ft.backend gloo`): does a collective's future resolve only
once the result is in the GPU tensor? Two processes on one GPU, many rounds of allreduce on a large tensor
produced by a chain of kernels, each checked right after its future resolves: torch's own Gloo future
(`work.get_future()`) against Regent's `ReplicatedGroup` (host-staged). Prints the mismatches of each.

    python benchmarks/gpu/gloo_cuda_check.py [--rounds 40] [--numel 16000000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _produce(rank: int, i: int, numel: int) -> torch.Tensor:
    x = torch.full((numel,), float(rank + 1), device="cuda")
    for _ in range(20):  # keep the GPU busy so a racing reader sees stale values
        x = x * 1.0 + 0.0
    return x.add_(i)


def _expected(world: int, i: int, average: bool) -> float:
    total = sum(r + 1 + i for r in range(world))
    return total / world if average else float(total)


def _worker(rank: int, world: int, port: int, rounds: int, numel: int, out: str) -> None:
    from regent.ft.process_group import ReplicatedGroup

    torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + 1))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    raw_bad = 0
    for i in range(rounds):
        x = _produce(rank, i, numel)
        fut = dist.all_reduce(x, async_op=True).get_future()
        fut.wait()
        if abs(x[-1].item() - _expected(world, i, False)) > 1e-3:
            raw_bad += 1
    # rank 0 serves the rendezvous store the group connects to by address (kept alive to the end)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    group = ReplicatedGroup(backend="gloo", timeout=60, connect_timeout=60)
    group.configure(f"127.0.0.1:{port}/check", f"replica_{rank}", rank, world)
    staged_bad = 0
    for i in range(rounds):
        x = _produce(rank, i, numel)
        group.allreduce([x], dist.ReduceOp.AVG).wait()
        if abs(x[-1].item() - _expected(world, i, True)) > 1e-3 or abs(x[0].item() - _expected(world, i, True)) > 1e-3:
            staged_bad += 1
    dist.barrier()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "rounds": rounds, "numel": numel, "torch_gloo_future_mismatches": raw_bad,
                   "replicated_group_mismatches": staged_bad}, f)
    dist.destroy_process_group()
    del store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--numel", type=int, default=16_000_000)
    ap.add_argument("--out", default="/tmp/gloo_cuda_check")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, a.rounds, a.numel, a.out), nprocs=2)
    for r in range(2):
        print(Path(f"{a.out}.{r}").read_text())


if __name__ == "__main__":
    main()
