"""TrainSpec: the built-in trainer with another model family (a causal convolution LM, not Llama), alone and
under the orchestrator with FSDP2 inside each replica and a fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from regent.orchestrate.commands import parse_train_argv
from regent.orchestrate.config import ConfigError
from regent.train.config import TrainConfig
from regent.train.spec import get_spec
from regent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
SPEC = "examples.tiny_lm_spec:SPEC"


def test_spec_names_resolve_or_say_why(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert get_spec("llama3").name == "llama3" and "debug" in get_spec("llama3").flavors
    assert get_spec(SPEC).name == "tiny_conv_lm"
    with pytest.raises(ValueError, match="module.path:SPEC"):
        get_spec("gpt5")
    with pytest.raises(ValueError, match="cannot load"):
        get_spec("examples.tiny_lm_spec:NOPE")
    with pytest.raises(ConfigError, match="not a flavor"):
        parse_train_argv(["--train.spec", SPEC, "--model", "debug", "--duration", "10s"])
    assert parse_train_argv(["--train.spec", SPEC, "--model", "tiny", "--duration", "10s"]).train.spec == SPEC


def test_the_trainer_trains_another_model_family(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    cfg = TrainConfig(spec=SPEC, model="tiny", seq_len=32, batch_size=4, lr=3e-3, warmup_steps=2, max_steps=60,
                      data_max_bytes=300_000)
    trainer = Trainer(cfg)
    assert type(trainer.model).__name__ == "CausalConvLM"
    first = trainer.evaluate_loss()
    for _ in range(40):
        trainer.train_step()
    assert trainer.evaluate_loss() < first - 0.5
    other = Trainer(cfg)  # healing state moves between two trainers of the spec
    other.load_state_dict(trainer.state_dict())
    assert other.param_hash() == trainer.param_hash() and other.step == trainer.step
    trainer.save_checkpoint(str(tmp_path / "ck"))
    trainer.wait_checkpoint()
    fresh = Trainer(cfg)
    fresh.load_checkpoint(str(tmp_path / "ck"))
    assert fresh.param_hash() == trainer.param_hash()
    with torch.no_grad():
        assert torch.isfinite(trainer.model(torch.zeros(1, 8, dtype=torch.long))).all()


@pytest.mark.long  # make test budget: the family trains in test_the_trainer_trains_another_model_family, and
@pytest.mark.timeout(600)  # the orchestrator's recovery is family-blind (test_case_study_e2e)
def test_another_family_under_the_orchestrator_with_fsdp_and_a_fault(tmp_path):
    run_dir = tmp_path / "run"
    faults = tmp_path / "faults.jsonl"
    faults.write_text(json.dumps({"at": 10, "replica": 1, "kind": "kill", "rank": 1}) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "regent.cli", "train", "--train.spec", SPEC, "--model", "tiny", "--replicas", "2",
         "--procs-per-replica", "2", "--duration", "34s", "--faults-file", str(faults), "--no-live",
         "--run-dir", str(run_dir), "--train.seq-len", "32", "--train.batch-size", "4", "--ft.sync-every", "5",
         "--faults.hang-timeout", "8"],
        env=env, capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    assert summary["replicas_consistent"] is True and summary["full_restarts"] == 0
    assert summary["invariant_violations"] == []
    kill = next(e for e in events if e["kind"] == "fault_injected")
    heals = [e for e in events if e["kind"] in ("heal_done", "early_heal_done") and e["replica"] == 1
             and e["time"] > kill["time"]]
    assert heals and heals[0]["donor"]
