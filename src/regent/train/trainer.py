"""The Trainer: one object that owns model, optimizer, schedule and data, and trains one step at a time.

A step, `train_step(ft)`, in order (`ft` holds the fault-tolerant step's rules: `regent.ft.step.FaultTolerantStep`
under `regent train`; None trains alone):
  1. next batch of this (replica, rank) shard (already on the device: gathered and copied while the previous
     step's backward ran); with a constant global batch, `ft.micro_batch_plan` says which replica-shards of it
     this replica covers; forward; loss; backward (FSDP reduce-scatters the gradients across the ranks of
     this replica)
  2. `ft.reduce_gradients(grads)`: the cross-replica allreduce of the gradients, in place (`grads()` are the
     tensors this rank holds, local shards under FSDP, in `model.parameters()` order, identical on every replica)
  3. global grad norm and clipping (over the whole replica)
  4. `ft.should_commit()`: the commit vote. False discards the step: gradients are zeroed; parameters, optimizer,
     schedule and `step` are unchanged; its batch is given back.
  5. `ft.update(optimizer.step)`: the optimizer step between the rules that guard it (where DiLoCo syncs); the
     schedule steps; `step += 1`; metrics; periodic checkpoint.

The trainer knows nothing about actors or orchestration; the caller sets up torch.distributed (the
intra-replica group) before constructing it when world_size > 1.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from regent import platform
from regent.contiguous import make_contiguous
from regent.dtensor import is_dtensor
from regent.train.checkpoint import Checkpointer, CheckpointError
from regent.train.config import TrainConfig
from regent.train.data import build_batches, build_tokenizer
from regent.train.metrics import MetricsWriter, mfu
from regent.train.optim import (
    WarmupCosineSchedule,
    build_optimizer,
    clip_grad_norm,
    grads_for_allreduce,
    local_tensor,
)
from regent.train.spec import ParallelContext, get_spec

log = logging.getLogger(__name__)


class StepRules(Protocol):
    """The rules of a fault-tolerant step a trainer's step runs under (`regent.ft.step.FaultTolerantStep`; the
    trainer does not import it: `regent.train` knows nothing of `regent.ft`)."""

    def micro_batch_plan(self, index: int) -> tuple[list[int], float] | None:
        """A constant global batch: the replica-shards of batch `index` to cover and the factor on their summed
        gradients; None: this replica's own shard only."""

    def micro_batch_backward(self, last: bool) -> None:
        """Before the backward of one of a step's micro-batches: only the last one's may start averaging the
        gradients across the replicas while it runs (the earlier ones accumulate into them)."""

    def reduce_gradients(self, grads: Callable[[], list[torch.Tensor]]) -> None:
        """Average `grads()` across the replicas, in place (or nothing: DiLoCo averages at its syncs)."""

    def should_commit(self) -> bool:
        """The commit vote: False drops the step."""

    def update(self, optimizer_step: Callable[[], Any]) -> Any:
        """Run `optimizer_step()` between the rules that guard a change of the weights."""


def compiled_loss(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`loss` under torch.compile (with `--train.compile`, beside the per-block compile of the model).

    Why: the loss over the full logits is the step's largest memory-bound work. Eagerly, cross-entropy upcasts
    the [batch x seq, vocab] logits to an fp32 copy, writes the log-softmax, and in backward fills, writes the
    fp32 gradient and casts it back (8.4 GB tensors at `1b`, batch 8). Compiled, the upcast, log-sum-exp and
    gather are one reduction over the bf16 logits and the backward one more that writes the bf16 gradient.
    Measured on an H200 (`1b`, batch 8): ~27 ms of device time per step down to 6 ms, peak memory 61.3 ->
    45.6 GiB, compiled step 268 -> 250 ms (benchmarks/RESULTS.md, 2026-12-02). TorchTitan compiles its loss
    too; without this the built-in trainer was behind it when both compile.
    """
    return torch.compile(loss)


class Trainer:
    def __init__(self, cfg: TrainConfig, *, rank: int = 0, world_size: int = 1, replica_index: int = 0,
                 num_replicas: int = 1, run_dir: str | None = None, device: torch.device | None = None,
                 process_group: dist.ProcessGroup | None = None):
        cfg.validate()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        if num_replicas < 1 or not 0 <= replica_index < num_replicas:
            raise ValueError(f"replica_index {replica_index} must be in [0, num_replicas={num_replicas})")
        if world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"world_size={world_size} needs torch.distributed initialised by the caller "
                "(MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE then dist.init_process_group); use world_size=1 "
                "for single-process training or regent.train.launch.run_no_ft to launch ranks"
            )
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.replica_index, self.num_replicas = replica_index, num_replicas
        self.group = process_group
        self.device = device or platform.device_for_local_rank(int(os.environ.get("LOCAL_RANK", rank)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.bf16 = cfg.mixed_precision if cfg.mixed_precision is not None else self.device.type == "cuda"
        self.sharded = world_size > 1

        self.spec = get_spec(cfg.spec)
        if cfg.model not in self.spec.flavors:
            raise ValueError(f"model={cfg.model!r} is not a flavor of spec {self.spec.name!r}; "
                             f"use one of {', '.join(self.spec.flavors)}")
        self.loss_fn = compiled_loss(self.spec.loss) if cfg.compile else self.spec.loss

        # Data
        tokenizer = build_tokenizer(cfg.tokenizer)
        shard, shards = replica_index * world_size + rank, num_replicas * world_size
        if self.spec.build_dataloader is not None:
            self.dataloader = self.spec.build_dataloader(cfg, tokenizer, shard, shards)
        else:
            self.dataloader = build_batches(cfg.data, tokenizer, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                            seed=cfg.seed, shard_index=shard, num_shards=shards,
                                            max_bytes=cfg.data_max_bytes)

        # Model
        self.model_args = self.spec.model_args(cfg.model, tokenizer.vocab_size, cfg.seq_len)
        self.model = self._build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Unsharded: parameters and each AdamW moment in one buffer apiece, so a heal is a few large
        # messages (FSDP2 shards own their storage and stay as they are).
        self.contiguous_state = cfg.contiguous_state and not self.sharded
        if self.contiguous_state:
            make_contiguous(self.params)
        self.param_names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self.num_params = sum(p.numel() for p in self.params)
        self.flops_per_token = (self.spec.flops_per_token(self.model_args, cfg.seq_len)
                                if self.spec.flops_per_token is not None else 6.0 * self.num_params)
        self.peak_flops = platform.peak_bf16_flops() if self.device.type == "cuda" else None

        # Optimizer and schedule
        self.optimizer = build_optimizer(self.model, cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay,
                                         contiguous=self.contiguous_state)
        self.lr_scheduler = WarmupCosineSchedule(self.optimizer, cfg.lr, cfg.warmup_steps, cfg.max_steps,
                                                 cfg.min_lr_ratio)
        self.step = 0

        # (data position, replica-shards covered) of the last step: what the sample ledger records
        self.last_coverage: tuple[int, list[int]] = (0, [replica_index])
        # (batch index, inputs, labels) already on the device: the next batch, made while the device works
        self._prefetched: tuple[int, torch.Tensor, torch.Tensor] | None = None
        # a batch has been taken for the step in progress (see `_data_state`)
        self._batch_in_flight = False

        async_group = None
        if cfg.async_checkpoint and self.sharded:
            async_group = dist.new_group(backend="gloo", ranks=dist.get_process_group_ranks(self.group)
                                         if self.group is not None else None)
        self.checkpointer = Checkpointer(self.group, async_group)
        self.run_dir = run_dir
        self.metrics = None
        if run_dir is not None and rank == 0:
            self.metrics = MetricsWriter(run_dir, extra={"replica": replica_index}, tensorboard=cfg.tensorboard)
        log.info("rank %d/%d replica %d/%d: %s model, %.1fM params, %s, bf16=%s, fsdp=%s", rank, world_size,
                 replica_index, num_replicas, cfg.model, self.num_params / 1e6, self.device, self.bf16,
                 self.sharded)

    # ---------------------------------------------------------------- construction
    def _build_model(self) -> torch.nn.Module:
        """Build, parallelize and initialize the model; weights are a function of (seed, world layout)."""
        cfg = self.cfg
        build = self.spec.build_model
        torch.manual_seed(cfg.seed)
        # GPU: never materialize the full model in host memory (needs the spec's init_weights after to_empty)
        on_meta = self.device.type != "cpu"
        if on_meta:
            with torch.device("meta"):
                model = build(self.model_args)
            if not hasattr(model, "init_weights"):
                raise ValueError(f"spec {self.spec.name!r}: the model has no init_weights(buffer_device=...), which "
                                 "initialises it on the GPU after it was built on the meta device")
        else:
            model = build(self.model_args)
            if hasattr(model, "init_weights"):
                torch.manual_seed(cfg.seed)
                model.init_weights()
        self.spec.parallelize(model, ParallelContext(cfg=cfg, world_size=self.world_size,
                                                     device_type=self.device.type, bf16=self.bf16,
                                                     group=self.group, sharded=self.sharded))
        if on_meta:
            model.to_empty(device=self.device)
            torch.manual_seed(cfg.seed)
            model.init_weights(buffer_device=self.device)
        else:
            model.to(self.device)
        return model

    # ---------------------------------------------------------------- training
    def _autocast(self):
        if self.bf16 and not self.sharded:  # under FSDP the mixed-precision policy does the casting
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _replica_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.sharded:
            value = value.clone()
            dist.all_reduce(value, group=self.group)  # SUM then divide: gloo has no AVG
            value /= self.world_size
        return value

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(inputs)
        return self.loss_fn(logits, labels)

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's gradient tensors (see `grads_for_allreduce`)."""
        return grads_for_allreduce(self.params)

    def _to_device(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.dataloader.batch(index)
        if self.device.type == "cuda":  # pinned, so the copy is asynchronous
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def _prefetch_next_batch(self) -> None:
        """Gather the next batch and queue its copy now, while the device still runs this step's backward,
        so the next step's first kernels do not wait for the host. The data position is not advanced: a heal
        or checkpoint load in between moves it, and `_next_batch` then drops this one."""
        index = self.dataloader.batches_consumed
        self._prefetched = (index, *self._to_device(index))

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        index, prefetched = self.dataloader.batches_consumed, self._prefetched
        self._prefetched = None
        self.dataloader.batches_consumed += 1
        if prefetched is not None and prefetched[0] == index:
            return prefetched[1], prefetched[2]
        return self._to_device(index)

    def train_step(self, ft: StepRules | None = None) -> dict[str, Any]:
        """Run one step under `ft`'s rules (None: alone); returns its metrics (see the module docstring for the
        order of operations)."""
        start = time.perf_counter()
        if not self.model.training:
            self.model.train()
        inputs, labels = self._next_batch()
        index = self.dataloader.batches_consumed - 1
        self._batch_in_flight = True
        plan = ft.micro_batch_plan(index) if ft is not None else None
        if plan is None:
            shards = [self.replica_index]
            loss = self._loss(inputs, labels)
            loss.backward()
        else:
            shards, scale = plan
            loss = self._accumulate(index, shards, scale, inputs, labels, ft)
        self.last_coverage = (index, list(shards))
        self._prefetch_next_batch()

        if ft is not None:
            ft.reduce_gradients(self.local_grads)
        # a device tensor: read after the optimizer step is queued, so the step does not wait for it
        grad_norm_t = clip_grad_norm(self.params, self.cfg.grad_clip, group=self.group, sharded=self.sharded,
                                     replicas=self.cfg.hsdp_replicate)
        committed = True if ft is None else ft.should_commit()
        lr = self.lr_scheduler.current_lr()  # after the vote: a heal that lands in it moves the schedule
        if committed:
            if ft is None:
                self.optimizer.step()
            else:
                ft.update(self.optimizer.step)
            self.lr_scheduler.step()
            self.step += 1
        else:
            # The step did not commit: its batch is given back and the next step trains on it. Counted as
            # consumed, a replica that copied its state from a peer during that step (before the batch was
            # taken, as far as the peer's served state says) ended one batch apart from it for the rest of the
            # run (found by the state votes in a per-step soak); and no committed step skips a batch.
            self.dataloader.batches_consumed -= 1
        self.optimizer.zero_grad(set_to_none=True)
        self._batch_in_flight = False

        loss_value = float(self._replica_mean(loss.detach()))
        grad_norm = float(grad_norm_t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        local_tokens = inputs.numel() * len(shards)
        per_device = local_tokens / elapsed
        record = {
            "step": self.step,
            "loss": loss_value,
            "tokens": local_tokens * self.world_size,
            "tokens_per_s": per_device * self.world_size,
            "tokens_per_s_per_device": per_device,
            "mfu": mfu(self.flops_per_token, per_device, self.peak_flops),
            "grad_norm": grad_norm,
            "peak_mem_bytes": platform.memory_stats()["peak_allocated_bytes"],
            "committed": committed,
            "lr": lr,
            "step_time_s": elapsed,
        }
        if plan is not None:
            record["micro_batches"] = len(shards)
            record["extra_micro_batches"] = max(0, len(shards) - 1)
        if self.metrics is not None:
            self.metrics.write(record)
        every = self.cfg.checkpoint_every
        if committed and every > 0 and self.step % every == 0:
            assert self.cfg.checkpoint_dir is not None
            self.save_checkpoint(os.path.join(self.cfg.checkpoint_dir, f"step-{self.step}"))
        return record

    def _accumulate(self, index: int, shards: list[int], scale: float, own_inputs: torch.Tensor,
                    own_labels: torch.Tensor, ft: StepRules | None = None) -> torch.Tensor:
        """Forward and backward over batch `index` of each replica-shard in `shards` (this rank's loader shard of
        each), gradients summed and scaled by `scale`: a smaller quorum still averages over the configured global
        batch. Returns the mean loss of the micro-batches."""
        losses = []
        for n, j in enumerate(shards):
            if j == self.replica_index:
                inputs, labels = own_inputs, own_labels
            else:
                inputs, labels = self.dataloader.shard_batch(index, j * self.world_size + self.rank)
                inputs, labels = inputs.to(self.device), labels.to(self.device)
            loss = self._loss(inputs, labels)
            if ft is not None:
                ft.micro_batch_backward(last=n == len(shards) - 1)
            (loss * scale).backward()
            losses.append(loss.detach())
        if not losses:  # no shard for this replica (cannot happen with participants <= replicas): zero gradients
            for p in self.params:
                p.grad = torch.zeros_like(p)
            return torch.zeros((), device=self.device)
        return torch.stack(losses).mean()

    @torch.no_grad()
    def evaluate_loss(self, batches: int = 2) -> float:
        """Mean loss over this shard's first `batches` batches (fixed, so comparable across steps/runs)."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for index in range(batches):
            inputs, labels = self.dataloader.batch(index)
            total += self._loss(inputs.to(self.device), labels.to(self.device)).float()
        return float(self._replica_mean(total / batches))

    # ---------------------------------------------------------------- state (peer healing)
    def extra_state(self) -> dict[str, Any]:
        """Everything but model and optimizer: schedule, data position, step (copied, not views)."""
        return {"lr_scheduler": copy.deepcopy(self.lr_scheduler.state_dict()), "data": self._data_state(),
                "step": self.step}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self._load_data_state(extra["data"])
        self.step = int(extra["step"])

    def _data_state(self) -> dict[str, Any]:
        """The data position as of the last step boundary: a batch already taken for the step in progress is
        not counted. A donor's state is read at any moment of its step; counting the batch it had just taken
        or not, depending on when the read landed, left healed replicas one batch apart from their donors
        (found by the state votes in a per-step soak)."""
        state = dict(self.dataloader.state_dict())
        state["batches_consumed"] -= int(self._batch_in_flight)
        return state

    def _load_data_state(self, state: dict[str, Any]) -> None:
        """A position at a step boundary; this trainer's own step in progress has taken its batch already."""
        self.dataloader.load_state_dict(state)
        self.dataloader.batches_consumed += int(self._batch_in_flight)

    def advance(self, delta: int) -> None:
        """Move the step count and the schedule by `delta` steps (a healed replica lines up with its donor)."""
        if not delta:
            return
        self.step += delta
        sched = self.lr_scheduler.state_dict()
        sched["step_count"] += delta
        self.lr_scheduler.load_state_dict(sched)

    def skip_batches(self, n: int) -> None:
        """Move the data position by `n` batches (either way) without training on them, with the step count:
        a DiLoCo replica that sat out a round takes the contributors' step count, and a healer lines up with a
        donor that was inside optimizer.step. Otherwise it reads its shard a few batches away from every other
        replica for the rest of the run (the state vote saw three different positions)."""
        self.dataloader.batches_consumed += n  # a prefetched batch of the old position is dropped by index

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, schedule, data and step. Tensors are views of this rank's live storage (local
        shards under FSDP), so a peer of the same rank can receive into them in place."""
        model = {name: local_tensor(p.detach()) for name, p in zip(self.param_names, self.params)}
        optim_state = {}
        for name, p in zip(self.param_names, self.params):
            state = self.optimizer.state[p]
            optim_state[name] = {key: local_tensor(value) if isinstance(value, torch.Tensor) else value
                                 for key, value in state.items()}
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        return {
            "model": model,
            "optimizer": {"state": optim_state, "param_groups": groups},
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "data": self._data_state(),
            "step": self.step,
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Copy a state_dict (from a peer or from `state_dict()`) into this trainer, in place."""
        missing = {"model", "optimizer", "lr_scheduler", "data", "step"} - set(sd)
        if missing:
            raise ValueError(f"state_dict lacks {sorted(missing)}; pass a dict produced by Trainer.state_dict()")
        mine = self.state_dict()
        _copy_tree(mine["model"], sd["model"], "model")
        _copy_tree(mine["optimizer"]["state"], sd["optimizer"]["state"], "optimizer.state")
        for group, incoming in zip(self.optimizer.param_groups, sd["optimizer"]["param_groups"]):
            # hyperparameters only: implementation flags (fused/foreach) belong to this process's device
            group.update({k: v for k, v in incoming.items() if k in ("lr", "betas", "eps", "weight_decay")})
        self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        self._load_data_state(sd["data"])
        self.step = int(sd["step"])

    def param_hash(self) -> str:
        """sha256 over the full (gathered) parameters in name order; equal exactly on bit-identical replicas.
        Under FSDP every rank of the replica must call it (it all-gathers)."""
        digest = hashlib.sha256()
        with torch.no_grad():
            for name, p in zip(self.param_names, self.params):
                full = p.full_tensor() if is_dtensor(p) else p
                digest.update(name.encode())
                digest.update(full.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    # ---------------------------------------------------------------- persistent checkpoints
    def _dcp_state(self) -> dict[str, Any]:
        """The DCP view: DTensors (not local shards) so checkpoints reshard across world sizes."""
        model = {name: p.detach() for name, p in zip(self.param_names, self.params)}
        optim = {name: dict(self.optimizer.state[p]) for name, p in zip(self.param_names, self.params)}
        return {"model": model, "optimizer": optim,
                "trainer": {"lr_scheduler": self.lr_scheduler.state_dict(), "data": self.dataloader.state_dict(),
                            "step": self.step}}

    def _checkpoint_meta(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.cfg.model, "model_args": _jsonable(_as_dict(self.model_args)),
                "world_size": self.world_size, "num_replicas": self.num_replicas,
                "replica_index": self.replica_index, "seq_len": self.cfg.seq_len,
                "data": self.dataloader.state_dict()}

    def save_checkpoint(self, path: str) -> None:
        """Save a DCP checkpoint to `path` atomically (async when cfg.async_checkpoint; see wait_checkpoint)."""
        self.checkpointer.save(self._dcp_state(), path, self._checkpoint_meta(), async_save=self.cfg.async_checkpoint)

    def wait_checkpoint(self) -> None:
        """Block until an in-flight async checkpoint is complete (and renamed into place)."""
        self.checkpointer.wait()

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by save_checkpoint; clear CheckpointError on corrupt/mismatched input."""
        manifest = self.checkpointer.read_manifest(path)
        expected = _jsonable(_as_dict(self.model_args))
        if manifest.get("model_args") != expected:
            raise CheckpointError(
                f"checkpoint {path} was saved for model {manifest.get('model')!r} with args "
                f"{manifest.get('model_args')}, but this run builds {self.cfg.model!r} with {expected}; "
                "use the same --model and tokenizer as the run that wrote it"
            )
        try:  # refuse before touching any tensor: a failed load must leave this trainer unchanged
            self.dataloader.check_compatible(manifest.get("data", {}))
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from exc
        self.checkpointer.verify(path, manifest)
        state = self._dcp_state()
        self.checkpointer.load(state, path)
        trainer_state = state["trainer"]
        self.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
        self.dataloader.load_state_dict(trainer_state["data"])
        self.step = int(trainer_state["step"])
        log.info("loaded checkpoint %s at step %d", path, self.step)

    def close(self) -> None:
        self.checkpointer.wait()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def _as_dict(args: Any) -> dict[str, Any]:
    """A spec's model args as a dict (a dataclass, a mapping or any object with attributes)."""
    return dict(args) if isinstance(args, dict) else vars(args)


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    import json

    return json.loads(json.dumps(values))


def _copy_tree(target: dict, source: dict, where: str) -> None:
    if target.keys() != source.keys():
        missing, extra = sorted(set(target) - set(source)), sorted(set(source) - set(target))
        raise ValueError(f"{where}: keys differ (missing {missing[:5]}, unexpected {extra[:5]}); the state comes "
                         "from a different model config")
    for key, dst in target.items():
        src = source[key]
        if isinstance(dst, dict):
            _copy_tree(dst, src, f"{where}.{key}")
        elif isinstance(dst, torch.Tensor):
            if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
                shape = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(f"{where}.{key}: shape {shape} does not match {tuple(dst.shape)}; "
                                 "peers must have the same model and the same rank layout")
            if src.data_ptr() != dst.data_ptr():  # received in place already: nothing to copy
                dst.copy_(src)
        else:
            raise ValueError(f"{where}.{key}: unexpected value of type {type(src).__name__}")
