"""Telling a DTensor (an FSDP2 / tensor-parallel shard) from a plain tensor, in one place for `regent.ft` and
`regent.train` (no actors, no training: torch only).

The test is the type, `isinstance(t, DTensor)`, not a probe for a method: the callers go on to use what only a
DTensor has (`placements`, `device_mesh`, `to_local`, `full_tensor`, `DTensor.from_local`), and a probe answers
yes for any tensor subclass or wrapper that happens to define one of those names (the two probes this replaces,
`to_local` + `placements` and `full_tensor`, did not even agree). It never imports DTensor's module itself: a
process that has not imported `torch.distributed.tensor` holds no DTensor, and that import costs seconds.
"""

from __future__ import annotations

import sys

import torch

_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """True for a DTensor (including an FSDP2 parameter, an `nn.Parameter` around one); False for anything else."""
    if type(t) is torch.Tensor:  # the common case, without a lookup
        return False
    module = sys.modules.get(_DTENSOR_MODULE)
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(t, dtensor)
