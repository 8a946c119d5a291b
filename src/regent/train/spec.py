"""TrainSpec: what the built-in Trainer needs to know about a model family, so that family is pluggable.

The Trainer owns the loop (data position, prefetch, mixed precision, clipping, the fault-tolerance hooks,
checkpoints, metrics); a spec says how to build and parallelize the model, what the data and the loss are and
how many FLOPs a token costs. Llama 3 is the default spec (`llama3`). Another family is one object:

    SPEC = TrainSpec(name="tiny", flavors=("tiny",), model_args=..., build_model=..., parallelize=...)

and `--train.spec my_pkg.my_module:SPEC --model tiny` (any importable module; `regent train` resolves it from
the current directory or PYTHONPATH in every process).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ParallelContext:
    """What a spec's `parallelize` gets: the replica's shape and the precision and features asked for."""

    cfg: Any  # TrainConfig
    world_size: int
    device_type: str
    bf16: bool
    group: Any  # the replica's process group (None: the default group)
    sharded: bool  # world_size > 1: shard the model over the replica's ranks (FSDP2)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss over every position, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@dataclass(frozen=True)
class TrainSpec:
    """A model family for the built-in Trainer.

    model_args(flavor, vocab_size, seq_len): the flavor's arguments (JSON-able attributes: they are compared
        when a checkpoint is loaded).
    build_model(args): the module, built under the current default device (the meta device on GPUs: it must
        then have `init_weights(buffer_device=...)`, which initialises it after `to_empty`).
    parallelize(model, ctx): activation checkpointing, compile and FSDP2 as asked for, in place.
    loss(logits, labels): the training loss.
    flops_per_token(args, seq_len): for MFU; None: 6 x parameters.
    build_dataloader(cfg, tokenizer, shard_index, num_shards): None: the token stream of `--train.data`.
    """

    name: str
    flavors: tuple[str, ...]
    model_args: Callable[[str, int, int], Any]
    build_model: Callable[[Any], nn.Module]
    parallelize: Callable[[nn.Module, ParallelContext], None]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    flops_per_token: Callable[[Any, int], float] | None = None
    build_dataloader: Callable[[Any, Any, int, int], Any] | None = None


def _llama3_parallelize(model: nn.Module, ctx: ParallelContext) -> None:
    from regent.train.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp

    apply_activation_checkpointing(model, ctx.cfg.activation_checkpointing)
    if ctx.cfg.compile:
        apply_compile(model)
    if ctx.sharded:
        apply_fsdp(model, ctx.world_size, ctx.device_type, ctx.bf16, group=ctx.group, replicate=ctx.cfg.hsdp_replicate)


def _llama3() -> TrainSpec:
    from regent.train.models import llama3

    return TrainSpec(name="llama3", flavors=tuple(llama3.MODEL_CONFIGS),
                     model_args=lambda flavor, vocab, seq_len: llama3.model_args(flavor, vocab, max_seq_len=seq_len),
                     build_model=llama3.Llama3, parallelize=_llama3_parallelize,
                     flops_per_token=llama3.flops_per_token)


BUILTIN: dict[str, Callable[[], TrainSpec]] = {"llama3": _llama3}


def get_spec(name: str) -> TrainSpec:
    """A built-in spec by name, or `module.path:ATTRIBUTE` (a TrainSpec, or a function returning one)."""
    if name in BUILTIN:
        return BUILTIN[name]()
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--train.spec {name!r}: use one of {', '.join(BUILTIN)} or module.path:SPEC")
    if os.getcwd() not in sys.path:  # as `python -m` does: specs next to the user's code are found
        sys.path.append(os.getcwd())
    try:
        value = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--train.spec {name!r}: cannot load it ({exc}); check the module path and that it is "
                         "importable from the current directory or PYTHONPATH") from exc
    spec = value() if callable(value) and not isinstance(value, TrainSpec) else value
    if not isinstance(spec, TrainSpec):
        raise ValueError(f"--train.spec {name!r} is a {type(spec).__name__}, not a regent.train.spec.TrainSpec")
    return spec
