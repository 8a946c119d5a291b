"""Your own trainer under `regent train`: the protocol it implements, and the adapter that runs it.

`regent train --trainer my_pkg.my_module:make_trainer` runs your model, optimizer and data instead of the
built-in Llama 3 trainer, with everything the built-in one gets: supervision and in-place restart, peer
healing (per-step or DiLoCo), the durable backstop, fault injection, the run directory, the report and the
live view. You write the part that is yours; Regent keeps the rules that make a loop fault-tolerant
(zero_grad, the cross-replica allreduce, the commit vote, when the optimizer may step, what a healer
receives).

The protocol (duck-typed; `UserTrainer` below spells it out):

    def make_trainer(ctx: TrainerContext) -> UserTrainer: ...   # called once per trainer process

    class MyTrainer:
        model: torch.nn.Module
        optimizer: torch.optim.Optimizer
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None   # optional; stepped after each commit
        grad_clip: float                                           # optional; 0 = no clipping

        def forward_backward(self, batch_index: int) -> torch.Tensor | dict:
            # the loss of batch `batch_index` of this (replica, rank) shard, after loss.backward();
            # return the loss tensor, or a dict with "loss" and any other metrics (floats)
        def extra_state(self) -> dict: ...             # optional: more state a healer needs (e.g. an EMA)
        def load_extra_state(self, state: dict) -> None: ...

Why a batch index: the data position is then part of the healed state for free (a healed replica goes on
with the batch its donor would take next), and a dropped step's batch is consumed on every replica alike.
With several processes per replica (`--procs-per-replica`), the model must do its own intra-replica
averaging (wrap it in torch's DDP or FSDP2 over the default process group, which Regent initialises).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from regent.train.optim import grads_for_allreduce
from regent.train.optim import local_tensor as _local

if TYPE_CHECKING:
    from regent.train.trainer import StepRules


@dataclasses.dataclass
class TrainerContext:
    """What a trainer factory is told about the process it runs in."""

    rank: int  # this process's rank inside its replica group
    world_size: int  # processes per replica group
    replica_index: int
    num_replicas: int
    device: torch.device
    seed: int
    run_dir: str
    options: dict[str, Any]  # `--trainer-opt KEY=VALUE` (strings) or the TOML [trainer_options] table


@runtime_checkable
class UserTrainer(Protocol):
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def forward_backward(self, batch_index: int) -> torch.Tensor | Mapping[str, Any]: ...


def load_factory(spec: str) -> Callable[[TrainerContext], Any]:
    """`module.path:function` -> the function (found from the current directory or PYTHONPATH); a clear error
    for anything else."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--trainer {spec!r}: write it as module.path:factory (e.g. examples.mlp_trainer:make)")
    if os.getcwd() not in sys.path:  # `regent` is a console script: make the current directory importable,
        sys.path.append(os.getcwd())  # as `python -m` does (trainer processes start in it too)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--trainer {spec!r}: cannot import {module_name!r} ({exc}); run from the directory that "
                         "holds it or add it to PYTHONPATH") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--trainer {spec!r}: {module_name} has no callable {attr!r}")
    return factory


class ExternalTrainer:
    """Runs a `UserTrainer` with the interface the training session drives (the built-in `Trainer`'s):
    `train_step(ft)` under a fault-tolerant step's rules (`regent.ft.step.FaultTolerantStep`), peer-healing state,
    step alignment, parameter hash."""

    def __init__(self, user: Any, ctx: TrainerContext) -> None:
        missing = [name for name in ("model", "optimizer", "forward_backward") if not hasattr(user, name)]
        if missing:
            raise TypeError(f"the trainer returned by the factory lacks {missing}; see regent.orchestrate."
                            "user_trainer for the protocol")
        self.user = user
        self.ctx = ctx
        self.model: nn.Module = user.model
        self.optimizer: torch.optim.Optimizer = user.optimizer
        self.lr_scheduler = getattr(user, "lr_scheduler", None)
        self.grad_clip = float(getattr(user, "grad_clip", 0.0) or 0.0)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.sharded = any(hasattr(p, "placements") for p in self.params)  # FSDP2: reduce after backward
        self.step = 0
        self.batches_consumed = 0
        self._batch_in_flight = False  # a batch is taken for the step in progress (see Trainer._data_state)
        self.world_size = ctx.world_size
        # Several processes per replica and a plain model: average the gradients inside the replica here (the
        # ranks train on different batches). A model under torch DDP or FSDP2 does it itself.
        wrapped = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        self._average_in_replica = ctx.world_size > 1 and not self.sharded and not wrapped

    # -- one step ---------------------------------------------------------------------------------------
    def local_grads(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient, zeros where it got none (see `grads_for_allreduce`)."""
        return grads_for_allreduce(self.params)

    def train_step(self, ft: StepRules | None = None) -> dict[str, Any]:
        """One step of the user's trainer under `ft`'s rules (None: alone), in the built-in `Trainer.train_step`'s
        order: forward and backward, the replica's own average, `ft.reduce_gradients`, clipping, the vote, and on
        commit `ft.update(optimizer.step)` and the schedule."""
        start = time.perf_counter()
        self.model.train()
        out = self.user.forward_backward(self.batches_consumed)
        self.batches_consumed += 1  # given back below if the step does not commit (see Trainer.train_step)
        self._batch_in_flight = True
        metrics = dict(out) if isinstance(out, Mapping) else {"loss": out}
        if "loss" not in metrics:
            raise ValueError("forward_backward must return the loss tensor, or a dict with 'loss'")
        if self._average_in_replica:
            self._replica_average()
        if ft is not None:
            ft.reduce_gradients(self.local_grads)
        grad_norm = None
        if self.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        committed = True if ft is None else ft.should_commit()
        lr = self.optimizer.param_groups[0].get("lr")  # after the vote: a heal that lands in it moves the schedule
        if committed:
            if ft is None:
                self.optimizer.step()
            else:
                ft.update(self.optimizer.step)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.step += 1
        else:
            self.batches_consumed -= 1
        self.optimizer.zero_grad(set_to_none=True)
        self._batch_in_flight = False
        record = {k: _number(v) for k, v in metrics.items()}
        record.update(step=self.step, committed=committed, lr=_number(lr), grad_norm=grad_norm,
                      step_time_s=time.perf_counter() - start)
        return record

    def _replica_average(self) -> None:
        import torch.distributed as dist

        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):  # every rank must send the same shapes: missing ones count as zeros
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
            for p, g in zip(self.params, grads):
                p.grad = g
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # SUM (Gloo has no AVG), then divide
        flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- state a healer receives --------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Schedule, data position, step and the trainer's own extras: what the committed-state copy holds
        besides model and optimizer (see TrainingSession)."""
        return {"lr_scheduler": copy.deepcopy(self.lr_scheduler.state_dict()) if self.lr_scheduler else None,
                "data": {"batches_consumed": self.batches_consumed - int(self._batch_in_flight)}, "step": self.step,
                "user": copy.deepcopy(self.user.extra_state()) if hasattr(self.user, "extra_state") else None}

    def load_extra_state(self, extra: Mapping[str, Any]) -> None:
        if self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            self._lr_from_schedule()
        self.batches_consumed = int(extra["data"]["batches_consumed"]) + int(self._batch_in_flight)
        self.step = int(extra["step"])
        if extra.get("user") is not None and hasattr(self.user, "load_extra_state"):
            self.user.load_extra_state(extra["user"])

    def _lr_from_schedule(self) -> None:
        """Set the optimizer's learning rates to the loaded schedule's. A scheduler's state does not hold them,
        and chainable schedules (CosineAnnealingLR) compute the next rate from the optimizer's current one: a
        DiLoCo replica healed with the committed schedule but its own inner optimizer went on from its own
        stale rate, and its schedule drifted from its peers' (found by the state votes)."""
        get_last_lr = getattr(self.lr_scheduler, "get_last_lr", None)
        if not callable(get_last_lr):
            return
        try:
            rates = list(get_last_lr())
        except (AttributeError, RuntimeError):  # a schedule that has not stepped yet has no last rate
            return
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr

    def skip_batches(self, n: int) -> None:
        """Move the data position by `n` batches (see `Trainer.skip_batches`)."""
        self.batches_consumed += n

    def advance(self, delta: int) -> None:
        """Move the step count and the schedule by `delta` steps (a healed replica lines up with its donor)."""
        self.step += delta
        if self.lr_scheduler is None or delta == 0:
            return
        if delta > 0:
            for _ in range(delta):
                self.lr_scheduler.step()
        else:  # rare (the donor was inside optimizer.step, the healer not): the schedule's counter goes back
            state = self.lr_scheduler.state_dict()
            state["last_epoch"] = state.get("last_epoch", 0) + delta
            self.lr_scheduler.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Model parameters as views of the live tensors (a healer of the same shape receives in place),
        optimizer state, and `extra_state()`."""
        model = {n: _local(p.detach()) for n, p in zip(self.param_names, self.params)}
        buffers = {n: _local(b) for n, b in self.model.named_buffers()}
        return {"model": model, "buffers": buffers, "optimizer": self.optimizer.state_dict(),
                **self.extra_state()}

    @torch.no_grad()
    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        mine = dict(zip(self.param_names, self.params))
        if set(sd["model"]) != set(mine):
            raise ValueError("peer state has other parameters than this trainer's model; every replica must build "
                             "the same model")
        for name, p in mine.items():
            dst, src = _local(p.detach()), sd["model"][name]
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        for name, b in self.model.named_buffers():
            if name in sd.get("buffers", {}) and sd["buffers"][name].data_ptr() != b.data_ptr():
                _local(b).copy_(sd["buffers"][name])
        self.optimizer.load_state_dict(_unshared(sd["optimizer"], self.optimizer))
        self.load_extra_state(sd)

    def param_hash(self) -> str:
        digest = hashlib.sha256()
        with torch.no_grad():
            for name, p in zip(self.param_names, self.params):
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                digest.update(name.encode())
                digest.update(full.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def close(self) -> None:
        close = getattr(self.user, "close", None)
        if callable(close):
            close()


def _unshared(optim_state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state to load, with every tensor that is not already this optimizer's own cloned: torch's
    load_state_dict keeps the tensors it is given, and two optimizers sharing moments would update them twice."""
    own = {t.data_ptr() for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)}
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def fresh(v: Any, param: Any) -> Any:
        v = v.clone() if isinstance(v, torch.Tensor) and v.data_ptr() not in own else v
        # An FSDP2 (DTensor) parameter's moments arrive as this rank's local shard (peer transfer sends local
        # tensors): make them DTensors like the parameter again, or the optimizer step mixes the two kinds.
        if (hasattr(param, "placements") and isinstance(v, torch.Tensor) and not hasattr(v, "placements")
                and v.dim() > 0 and v.shape == param.to_local().shape):
            from torch.distributed.tensor import DTensor

            v = DTensor.from_local(v, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
        return v

    state = {k: {kk: fresh(vv, params[k] if isinstance(k, int) and k < len(params) else None)
                 for kk, vv in st.items()} for k, st in optim_state["state"].items()}
    return {**optim_state, "state": state}


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean()) if value.numel() else None
    return value
