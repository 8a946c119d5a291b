"""LocalSGD / DiLoCo written as TorchFT code is (its names, keyword arguments and call order), running on
regent.ft: only the imports differ. Prints one JSON line per committed sync and a final line with the
parameters' digest, for test_torchft_compat.py."""

import argparse
import contextlib
import hashlib
import json
import time
from datetime import timedelta

import torch
from torch import nn

from regent.ft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from regent.ft.local_sgd import DiLoCo, LocalSGD
from regent.ft.manager import WorldSizeMode

parser = argparse.ArgumentParser()
parser.add_argument("--replica", type=int, required=True)
parser.add_argument("--mode", choices=["localsgd", "diloco", "ddp"], required=True)
parser.add_argument("--spares", action="store_true", help="WorldSizeMode.FIXED_WITH_SPARES (min_replica_size=1)")
parser.add_argument("--syncs", type=int, default=30)
parser.add_argument("--sync-every", type=int, default=4)
parser.add_argument("--step-time", type=float, default=0.02)
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(args.replica)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)


def state_dict() -> dict:
    return {"model": model.state_dict(), "optim": inner.state_dict()}


def load_state_dict(state: dict) -> None:
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])


manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    min_replica_size=1,
    use_async_quorum=args.mode == "ddp",
    world_size_mode=WorldSizeMode.FIXED_WITH_SPARES if args.spares else WorldSizeMode.DYNAMIC,
    replica_id=f"torchft_style_{args.replica}",
    timeout=timedelta(seconds=10),
    quorum_timeout=timedelta(seconds=30),
    connect_timeout=timedelta(seconds=30),
    rank=0,
    world_size=1,
)
if args.mode == "ddp":  # per step: DDP + OptimizerWrapper
    ddp, optimizer = DistributedDataParallel(manager, model), Optimizer(manager, inner)
    while manager.current_step() < args.syncs:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(args.replica * 7919 + manager.current_step()))
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)).backward()
        time.sleep(args.step_time)
        optimizer.step()
        print(json.dumps({"sync": manager.current_step(), "participants": manager.num_participants(),
                          "participating": manager.is_participating()}), flush=True)
    algo = None
elif args.mode == "localsgd":
    algo = LocalSGD(manager, model, inner, sync_every=args.sync_every)
else:
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    algo = DiLoCo(manager, [model], inner, outer, args.sync_every, None, True, True, 1,
                  should_quantize=False)  # TorchFT's positional order; bucketized (1 MiB buckets)

local = 0
with algo or contextlib.nullcontext():
    while algo is not None and manager.current_step() < args.syncs:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(args.replica * 7919 + local))
        inner.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        time.sleep(args.step_time)
        before = manager.current_step()
        inner.step()  # every sync_every steps this syncs (a hook of LocalSGD / DiLoCo)
        local += 1
        if manager.current_step() != before:
            print(json.dumps({"sync": manager.current_step(), "participants": manager.num_participants()}),
                  flush=True)
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16]
print(json.dumps({"done": manager.current_step(), "params": digest}), flush=True)
manager.shutdown()
