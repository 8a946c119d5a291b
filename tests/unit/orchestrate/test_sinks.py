"""Metric mirrors: TensorBoard for real (its own reader reads back what was written), and clear errors before
launch for a sink whose package is missing."""

from __future__ import annotations

import importlib.util

import pytest

from regent.orchestrate.commands import parse_train_argv
from regent.orchestrate.config import ConfigError
from regent.orchestrate.sinks import MetricSinks


def test_tensorboard_gets_one_series_per_replica_at_the_committed_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = MetricSinks(tmp_path, tensorboard=True)
    for step in range(1, 4):
        for replica in (0, 1):
            sinks.write({"time": 1000.0 + step, "replica": replica, "step": step, "loss": 1.0 / step + replica,
                         "committed": True, "note": "text is skipped"})
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"replica_0/loss", "replica_1/loss"} <= tags and not any("note" in t or "committed" in t for t in tags)
    loss1 = acc.Scalars("replica_1/loss")
    assert [e.step for e in loss1] == [1, 2, 3] and loss1[-1].value == pytest.approx(1 / 3 + 1)


def test_a_missing_sink_package_is_refused_before_launch():
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match=r"regent-ml\[wandb\]"):
            parse_train_argv(["--duration", "10s", "--wandb-project", "demo"])
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ConfigError, match=r"regent-ml\[tensorboard\]"):
            parse_train_argv(["--duration", "10s", "--train.tensorboard", "true"])


def test_no_sink_asked_for_is_free(tmp_path):
    sinks = MetricSinks(tmp_path)
    assert not sinks.active
    sinks.write({"replica": 0, "step": 1, "loss": 2.0})
    sinks.close()
    assert not (tmp_path / "tb").exists()
