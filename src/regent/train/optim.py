"""AdamW with eagerly created state, a warmup + cosine schedule, and global grad-norm clipping over shards."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from regent.contiguous import contiguous_empty_like


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: the local shard of a DTensor (a view, writable in place), else itself."""
    if type(t) is torch.Tensor:  # the common case, without the attribute probe
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def grads_for_allreduce(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every trainable parameter's gradient (this rank's shard), in parameter order, writable in place. One that
    got none this step (unused on this replica's batch) becomes zeros, so every replica hands the cross-replica
    allreduce the same tensors (leaving it out made one replica's flattened gradient shorter than its peers': a
    mismatched allreduce, which one side can finish and the other wait out) and it receives the average."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [local_tensor(p.grad) for p in params]


def build_optimizer(model: nn.Module, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float, contiguous: bool = False) -> torch.optim.AdamW:
    """AdamW whose per-parameter state exists before the first step.

    Eager state means `state_dict()` has the same tensors at step 0 as at step 1000, so a healing peer can
    receive optimizer state in place at any time.

    On GPU the fused kernel is used (one launch for all parameters), which keeps its step counters on the
    GPU; on CPU the foreach path keeps them on the CPU, as torch does.

    `contiguous` puts each moment of all parameters in one buffer (plain tensors only; see
    `regent.contiguous`), so a peer heal sends each moment as a few large messages.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and params[0].device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  fused=fused or None, foreach=None if fused else True)
    if contiguous:
        exp_avg, exp_avg_sq = contiguous_empty_like(params), contiguous_empty_like(params)
    else:
        exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
    counters = [torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu") for p in params]
    if contiguous:  # the step counters too: on the GPU (fused) they then travel as one small message
        counters = contiguous_empty_like(counters, align_bytes=4)  # scalars: no kernel wants them aligned
    for p, step, avg, avg_sq in zip(params, counters, exp_avg, exp_avg_sq):
        state = optimizer.state[p]
        state["step"] = step
        state["exp_avg"] = avg
        state["exp_avg_sq"] = avg_sq
    return optimizer


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup from ~0 to 1 over warmup_steps, then cosine from 1 to min_ratio at max_steps; flat after."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosineSchedule:
    """Sets each param group's lr from the step count. State is just the step, so it transfers trivially."""

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup_steps: int, max_steps: int,
                 min_ratio: float):
        self.optimizer = optimizer
        self.peak_lr, self.warmup_steps, self.max_steps, self.min_ratio = peak_lr, warmup_steps, max_steps, min_ratio
        self.step_count = 0
        self._apply()

    def current_lr(self) -> float:
        return self.peak_lr * lr_multiplier(self.step_count, self.warmup_steps, self.max_steps, self.min_ratio)

    def _apply(self) -> None:
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None = None,
                   sharded: bool = False, replicas: int = 1) -> torch.Tensor:
    """Global L2 norm of the gradients, clipped to max_norm (no clipping when max_norm <= 0).

    With `sharded`, each rank holds disjoint shards: the squared norms are summed over `group` first. Under
    HSDP each shard is held by `replicas` ranks of the group, so that sum counts it `replicas` times.
    Returns the norm before clipping as a 0-dim tensor on the gradients' device: reading it waits for the
    device, so the caller chooses when (after queueing the optimizer step, not before).
    """
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if grads:
        # one multi-tensor kernel for all the per-gradient norms (fp32 even for bf16 gradients)
        total_sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
    else:
        total_sq = torch.zeros((), device=params[0].device if params else "cpu")
    if sharded and dist.is_initialized():
        dist.all_reduce(total_sq, group=group)
        if replicas > 1:
            total_sq = total_sq / replicas
    total = total_sq.sqrt()
    if max_norm > 0 and grads:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return total
