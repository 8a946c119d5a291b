"""Step metrics: MFU arithmetic and the `metrics.jsonl` writer (optionally mirrored to TensorBoard)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1] (None when the device's peak is unknown, e.g. on CPU)."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_s_per_device / peak_flops


class MetricsWriter:
    """Appends one JSON object per step to <run_dir>/metrics.jsonl; flushes every line so a crash loses none."""

    def __init__(self, run_dir: str, extra: dict[str, Any] | None = None, tensorboard: bool = False):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives as long as the writer
        self._extra = dict(extra or {})
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except ImportError:
                log.warning("tensorboard requested but the 'tensorboard' package is missing; pip install tensorboard")

    def write(self, record: dict[str, Any]) -> None:
        line = {"time": time.time(), **self._extra, **record}
        self._file.write(json.dumps(line, default=float) + "\n")
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
