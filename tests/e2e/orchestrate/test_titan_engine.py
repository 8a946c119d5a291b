"""`regent train --engine torchtitan`: TorchTitan's own Trainer (model, FSDP2, loss, optimizer, LR schedule,
dataloader) in each replica, healed from a live peer after a kill; replicas bit-identical at the end.

TorchTitan is an optional extra (`pip install 'regent-ml[titan]'`); the end-to-end case is skipped, saying why,
where it does not import (on a CPU-only torch it also needs `triton` importable: see README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from regent.orchestrate.commands import TITAN_TRAINER, parse_train_argv
from regent.orchestrate.config import ConfigError
from regent.orchestrate.titan_engine import TitanUnavailable, check_available

ROOT = Path(__file__).resolve().parents[3]


def _titan_missing() -> str | None:
    try:
        check_available()
    except TitanUnavailable as exc:
        return str(exc)
    return None


def test_engine_flags_map_to_the_titan_trainer_or_say_how_to_install():
    with pytest.raises(ConfigError, match="--engine torchtitan"):
        parse_train_argv(["--titan.config", "debugmodel", "--duration", "10s"])
    with pytest.raises(ConfigError, match="needs --titan.config"):
        parse_train_argv(["--engine", "torchtitan", "--duration", "10s"])
    missing = _titan_missing()
    if missing is not None:  # the message names the extra to install
        with pytest.raises(ConfigError, match=r"regent-ml\[titan\]"):
            parse_train_argv(["--engine", "torchtitan", "--titan.config", "debugmodel", "--duration", "10s"])
        return
    cfg = parse_train_argv(["--engine", "torchtitan", "--titan.config", "debugmodel",
                            "--titan.args=--training.seq_len 64", "--steps", "30"])
    assert cfg.trainer == TITAN_TRAINER
    assert cfg.trainer_options == {"titan.config": "debugmodel", "titan.args": "--training.seq_len 64",
                                   "regent.steps": "30"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_titan_trainer_heals_from_a_peer_under_regent_train(tmp_path):
    missing = _titan_missing()
    if missing is not None:
        pytest.skip(f"TorchTitan is not importable here: {missing}")
    run_dir = tmp_path / "run"
    faults = tmp_path / "faults.jsonl"
    faults.write_text(json.dumps({"at": 8, "replica": 1, "kind": "kill", "rank": 0}) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "regent.cli", "train", "--engine", "torchtitan", "--titan.config", "debugmodel",
         "--titan.args=--training.seq_len 64 --training.local_batch_size 2", "--replicas", "2",
         "--procs-per-replica", "1", "--steps", "60", "--faults-file", str(faults), "--no-live",
         "--run-dir", str(run_dir), "--ft.mode", "ddp", "--faults.hang-timeout", "30"],
        env=env, capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert json.loads((run_dir / "config.json").read_text())["trainer"] == TITAN_TRAINER
    assert summary["replicas_consistent"] is True, summary
    assert summary["full_restarts"] == 0 and summary["lineage_resets"] == 0 and summary["invariant_violations"] == []
    kills = [e for e in events if e["kind"] == "fault_injected"]
    assert len(kills) == 1 and kills[0]["replica"] == 1
    heals = [e for e in events if e["kind"] == "heal_done" and e["replica"] == 1 and e["time"] > kills[0]["time"]]
    assert heals and heals[0]["donor"].startswith("replica_0"), events
    failures = [e for e in events if e["kind"] == "failure_detected"]
    assert len(failures) == 1, failures  # the kill, and nothing after the heal
    # TorchTitan's loss, from its own forward/loss/backward; the synthetic data can be learned
    losses = [m["loss"] for m in metrics if m.get("committed") and m["replica"] == 0]
    assert len(losses) >= 50 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses


def test_chunked_loss_is_kept_only_where_torch_runs_it():
    from regent.orchestrate.titan_engine import chunked_loss_runs

    assert not chunked_loss_runs("2.11.0+cu130")  # the H200's torch: the decoder's backward failed
    assert not chunked_loss_runs("2.12.1")
    assert chunked_loss_runs("2.13.0+cpu") and chunked_loss_runs("2.14.0.dev20261201+cu130")
    assert chunked_loss_runs("3.0.0") and not chunked_loss_runs("garbage")
