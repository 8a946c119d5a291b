"""One rank of the HSDP check in test_fsdp_gloo.py: 2 replicas x 2 shards, no fault tolerance (the baseline
that fault tolerance across replica groups is measured against)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from regent.train.config import TrainConfig
from regent.train.optim import clip_grad_norm
from regent.train.trainer import Trainer


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = TrainConfig(seq_len=32, batch_size=2, warmup_steps=2, max_steps=50, data_max_bytes=300_000,
                      hsdp_replicate=2)
    trainer = Trainer(cfg, rank=rank, world_size=world)
    losses = [trainer.train_step()["loss"] for _ in range(4)]
    inputs, labels = trainer.dataloader.next_batch()
    trainer._loss(inputs, labels).backward()
    grads = [p.grad for p in trainer.params if p.grad is not None]
    # the norm of the whole gradient (each DTensor gathered over both mesh dims) vs the trainer's HSDP norm
    full = float(torch.stack([g.full_tensor().float().pow(2).sum() for g in grads]).sum().sqrt())
    hsdp = float(clip_grad_norm(trainer.params, 0.0, group=trainer.group, sharded=True, replicas=2))
    result = {"losses": losses, "hash": trainer.param_hash(), "full_norm": full, "hsdp_norm": hsdp,
              "placements": str(grads[0].placements)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
