"""A fault-tolerant training loop on regent.ft's public API (TorchFT's names). Run one per replica group:

    regent lighthouse --bind 127.0.0.1:29510 --min-replicas 1 &
    export REGENT_FT_LIGHTHOUSE=127.0.0.1:29510
    python examples/ft_custom_loop.py --replica 0 & python examples/ft_custom_loop.py --replica 1

Kill either one at any time and start it again: it heals from the other, which never stopped, and the two
finish bit-identical.
"""

import argparse
import hashlib
import time

import torch
from torch import nn

from regent.ft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

parser = argparse.ArgumentParser()
parser.add_argument("--replica", type=int, default=0)
parser.add_argument("--steps", type=int, default=500)
parser.add_argument("--step-time", type=float, default=0.02, help="stand-in for a real model's compute (s)")
args = parser.parse_args()

torch.manual_seed(args.replica)  # the replicas start different: step 0 gives every one replica 0's weights
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)


def state_dict() -> dict:  # what a healing replica receives from a live one
    return {"model": model.state_dict(), "optim": inner.state_dict()}


def load_state_dict(state: dict) -> None:
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])


manager = Manager(pg=ProcessGroupGloo(), load_state_dict=load_state_dict, state_dict=state_dict,
                  min_replica_size=1, replica_id=f"example_{args.replica}")
ddp = DistributedDataParallel(manager, model)  # gradients averaged over the live replicas during backward
optimizer = Optimizer(manager, inner)  # zero_grad() starts the quorum; step() commits only agreed steps

while manager.current_step() < args.steps:
    data = torch.Generator().manual_seed(args.replica * 1_000_003 + manager.current_step())
    x = torch.randn(32, 16, generator=data)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
    loss.backward()
    time.sleep(args.step_time)
    optimizer.step()
    if manager.current_step() % 50 == 0:
        print(f"replica {args.replica} step {manager.current_step()} loss {loss.item():.4f} "
              f"replicas {manager.num_participants()}", flush=True)

digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16]
print(f"replica {args.replica} done at step {manager.current_step()} params {digest}", flush=True)
manager.shutdown()
