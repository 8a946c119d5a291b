"""A trainer that is not Llama, run by the orchestrator with faults, peer healing and the report:

    regent train --trainer examples.mlp_trainer:make_trainer --replicas 3 --procs-per-replica 1 \\
        --duration 90s --fault-every 20s --trainer-opt hidden=256

A small MLP learns which of 10 Gaussian blobs a point came from. Everything fault tolerance needs is the
protocol in `regent.orchestrate.user_trainer`: a model, an optimizer (and optionally a schedule and gradient
clipping), and `forward_backward(batch_index)`; Regent does zero_grad, the cross-replica average, the commit
vote, the optimizer step and the healing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from regent.orchestrate.user_trainer import TrainerContext


class BlobsTrainer:
    def __init__(self, ctx: TrainerContext) -> None:
        self.ctx = ctx
        hidden = int(ctx.options.get("hidden", 128))
        self.batch_size = int(ctx.options.get("batch_size", 64))
        self.model = nn.Sequential(nn.Linear(32, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                   nn.Linear(hidden, 10)).to(ctx.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(ctx.options.get("lr", 3e-3)))
        self.lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=20_000)
        self.grad_clip = 1.0
        self.centers = torch.randn(10, 32, generator=torch.Generator().manual_seed(1234)) * 1.5  # the task

    def forward_backward(self, batch_index: int) -> dict[str, torch.Tensor]:
        # this (replica, rank)'s shard: a pure function of the batch index, so a healed replica goes on with
        # exactly the batch its donor would take next
        shard = self.ctx.replica_index * self.ctx.world_size + self.ctx.rank
        g = torch.Generator().manual_seed(shard * 1_000_003 + batch_index)
        labels = torch.randint(0, 10, (self.batch_size,), generator=g)
        points = self.centers[labels] + torch.randn(self.batch_size, 32, generator=g)
        logits = self.model(points.to(self.ctx.device))
        loss = F.cross_entropy(logits, labels.to(self.ctx.device))
        loss.backward()
        accuracy = (logits.argmax(1).cpu() == labels).float().mean()
        return {"loss": loss.detach(), "accuracy": accuracy}


def make_trainer(ctx: TrainerContext) -> BlobsTrainer:
    return BlobsTrainer(ctx)
