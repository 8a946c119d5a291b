"""Parallelism inside one replica group: FSDP2 over its ranks, plus activation checkpointing and compile.

FSDP2 (`fully_shard`) shards the embedding, every transformer block and the head (final norm + output) as
units of their own, then the root, so one unit's parameters are all-gathered just before it runs (prefetched
under the previous unit's compute) and freed after. Mixed precision keeps fp32
master weights and computes in bf16, reducing gradients in fp32.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from regent.train.models.llama3 import Llama3

log = logging.getLogger(__name__)


def _fsdp_api():
    try:  # public since torch 2.6
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def apply_activation_checkpointing(model: Llama3, enabled: bool) -> None:
    model.set_activation_checkpointing(enabled)


def apply_compile(model: Llama3) -> None:
    """Compile each block separately (as TorchTitan does): small graphs compile fast and compose with FSDP."""
    for block in model.layers:
        block.compile()  # in place: parameter names (and so checkpoints) stay the same
    log.info("torch.compile applied to %d transformer blocks", len(model.layers))


def apply_fsdp(model: Llama3, world_size: int, device_type: str, bf16: bool,
               group: dist.ProcessGroup | None = None, replicate: int = 1) -> None:
    """Shard `model` in place over the `world_size` ranks of the default (or given) process group.

    With `replicate` > 1 (default group only): HSDP, `replicate` copies each sharded over world/replicate ranks.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    fully_shard, MixedPrecisionPolicy = _fsdp_api()
    if replicate > 1:
        if group is not None or world_size % replicate:
            raise ValueError(f"HSDP needs the default group and world_size ({world_size}) divisible by "
                             f"replicate ({replicate})")
        mesh = init_device_mesh(device_type, (replicate, world_size // replicate),
                                mesh_dim_names=("replicate", "shard"))
    elif group is None:
        mesh = init_device_mesh(device_type, (world_size,))
    else:
        mesh = DeviceMesh.from_group(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for unit, reshard in fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def fsdp_units(model: Llama3) -> list[tuple[nn.Module | list[nn.Module], bool]]:
    """The FSDP units below the root, in forward order, and whether each reshards after forward.

    The embedding and the head (final norm + output) are units of their own rather than part of the root:
    the root's parameters are gathered before anything else runs and reduced after everything else, so
    nothing hides that traffic, while a unit of its own is prefetched under the previous unit's compute and
    reduce-scattered under the next one's backward. The head and the last block are needed again first in
    backward, so they stay gathered.
    """
    last = len(model.layers) - 1
    units: list[tuple[nn.Module | list[nn.Module], bool]] = [(model.tok_embeddings, True)]
    units += [(block, index < last) for index, block in enumerate(model.layers)]
    units.append(([model.norm, model.output], False))
    return units
