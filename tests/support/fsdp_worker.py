"""One rank of the FSDP checks in test_fsdp_gloo.py (run as a script with RANK/WORLD_SIZE/MASTER_* set)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from step_rules import Rules

from regent.train.config import TrainConfig
from regent.train.trainer import Trainer


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(os.environ.get("REGENT_TEST_BACKEND", "gloo"), rank=rank, world_size=world)
    cfg = TrainConfig(seq_len=32, batch_size=2, warmup_steps=2, max_steps=50, data_max_bytes=300_000,
                      async_checkpoint=True)
    result: dict = {}
    a = Trainer(cfg, rank=rank, world_size=world)
    shard_numel = []
    counting = Rules(reduce=lambda grads: shard_numel.append(sum(g.numel() for g in grads)))
    for _ in range(3):
        a.train_step(counting)
    result["local_grad_numel"] = shard_numel[0]
    result["num_params"] = a.num_params

    path = os.path.join(out_dir, "ckpt", "step-3")
    a.save_checkpoint(path)
    a.wait_checkpoint()
    result["hash_saved"] = a.param_hash()

    skipped = a.train_step(Rules(commit=False))
    result["skip_kept_params"] = a.param_hash() == result["hash_saved"] and skipped["step"] == 3
    # the discarded step gave its batch back: the next step trains on it, so the comparison below is like-for-like
    result["next_loss"] = a.train_step()["loss"]
    result["hash_after"] = a.param_hash()

    b = Trainer(cfg, rank=rank, world_size=world)
    with torch.no_grad():
        b.params[0].add_(1.0)
    b.load_checkpoint(path)
    result["hash_loaded"] = b.param_hash()
    result["next_loss_loaded"] = b.train_step()["loss"]
    result["hash_after_loaded"] = b.param_hash()

    c = Trainer(cfg, rank=rank, world_size=world)
    c.load_state_dict(a.state_dict())  # peer-style transfer of local shards, same rank layout
    result["hash_transferred"] = c.param_hash()
    result["state_is_local_shard"] = all(
        not hasattr(t, "full_tensor") for t in c.state_dict()["model"].values())
    for trainer in (a, b, c):
        trainer.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
