"""regent.train: the training engine (Llama 3, FSDP2, data, optimizer, checkpoints, metrics).

    from regent.train import TrainConfig, Trainer, run_no_ft

Names are imported lazily so `import regent.train` stays cheap (no torch import until used).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainConfig": "regent.train.config",
    "Trainer": "regent.train.trainer",
    "CheckpointError": "regent.train.checkpoint",
    "run_no_ft": "regent.train.launch",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'regent.train' has no attribute {name!r}")
