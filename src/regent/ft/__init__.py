"""regent.ft: fault tolerance across replica groups, usable from any launcher.

The public surface follows TorchFT's module layout and names, so TorchFT code runs after changing `torchft`
to `regent.ft`:

    from regent.ft import Manager, DistributedDataParallel, Optimizer, ProcessGroupGloo
    from regent.ft.local_sgd import DiLoCo, LocalSGD
    from regent.ft.coordination import LighthouseServer

Regent's additions (the committed watermark, early heal, the durable backstop) are opt-in or invisible to
TorchFT code; see the README's "Bring your own training loop". The rules of one fault-tolerant step, whichever
loop drives it (Regent's trainers, `Optimizer`, `DiLoCo`, `LocalSGD`), are `FaultTolerantStep`'s (`regent.ft.step`).
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use (PEP 562): `regent lighthouse` imports regent.ft.lighthouse and must not pay for torch.
_WHERE = {
    "DistributedDataParallel": "regent.ft.ddp",
    "DistributedSampler": "regent.ft.data",
    "FaultTolerantStep": "regent.ft.step",
    "Manager": "regent.ft.manager",
    "WorldSizeMode": "regent.ft.manager",
    "Optimizer": "regent.ft.optim",
    "OptimizerWrapper": "regent.ft.optim",
    "ProcessGroupBabyGloo": "regent.ft.process_group",
    "ProcessGroupBabyNCCL": "regent.ft.process_group",
    "ProcessGroupGloo": "regent.ft.process_group",
    "ProcessGroupNCCL": "regent.ft.process_group",
    "ReplicatedGroup": "regent.ft.process_group",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'regent.ft' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    value = getattr(module, "OptimizerWrapper" if name == "Optimizer" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
