"""Mirrors of metrics.jsonl in the tools users already watch: TensorBoard and Weights & Biases.

Both are optional packages (`pip install 'regent-ml[tensorboard]'` / `'regent-ml[wandb]'`) and off unless
asked for (`--train.tensorboard true`, `--wandb-project NAME`). metrics.jsonl stays the record; these see the
same numbers, one series per replica (`replica_0/loss`, ...), at the replica's committed step. A sink that
fails mid-run is reported once and dropped: the run does not stop for a dashboard.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MissingSinkPackage(RuntimeError):
    """A requested sink's package is not installed (raised before the run starts)."""


def check_available(tensorboard: bool, wandb_project: str) -> None:
    """Refuse before launch, naming the install command, when a requested sink cannot work."""
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise MissingSinkPackage("--train.tensorboard needs the tensorboard package: "
                                 "pip install 'regent-ml[tensorboard]' (or drop the flag)")
    if wandb_project and importlib.util.find_spec("wandb") is None:
        raise MissingSinkPackage("--wandb-project needs the wandb package: pip install 'regent-ml[wandb]' "
                                 "(or drop the flag)")


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    skip = {"step", "time", "replica", "rank", "generation", "quorum_id", "rseq"}
    return {k: float(v) for k, v in record.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricSinks:
    """Sends each metrics record to the configured sinks."""

    def __init__(self, run_dir: str | os.PathLike[str], tensorboard: bool = False, wandb_project: str = "",
                 config: dict[str, Any] | None = None) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(run_dir), name=Path(run_dir).name,
                                     config=config or {}, reinit=True)

    @property
    def active(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        prefix = f"replica_{record.get('replica', 0)}/"
        values = {prefix + k: v for k, v in _scalars(record).items()}
        step = int(record.get("step") or 0)
        if self._tb is not None:
            try:
                for key, value in values.items():
                    self._tb.add_scalar(key, value, step, walltime=record.get("time"))
            except Exception as err:  # noqa: BLE001 - reported once; the run goes on without this sink
                logger.warning("TensorBoard sink failed (%r); no more TensorBoard metrics for this run", err)
                self._tb = None
        if self._wandb is not None:
            try:
                # W&B steps must not go back; several replicas share one run, so the replica's step is a metric
                self._wandb.log({**values, prefix + "step": step})
            except Exception as err:  # noqa: BLE001 - reported once; the run goes on without this sink
                logger.warning("Weights & Biases sink failed (%r); no more W&B metrics for this run", err)
                self._wandb = None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
