"""Single-process Trainer: hooks, state transfer, DCP checkpoints (identity, atomicity, corruption, mismatch)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from regent.train.checkpoint import CheckpointError
from regent.train.config import TrainConfig
from regent.train.metrics import read_metrics
from regent.train.trainer import Trainer
from tests.support.step_rules import Rules

torch.set_num_threads(1)


def small_cfg(**overrides) -> TrainConfig:
    values = dict(seq_len=32, batch_size=2, warmup_steps=2, max_steps=50, data_max_bytes=300_000)
    values.update(overrides)
    return TrainConfig(**values)


def test_steps_report_metrics_and_write_jsonl(tmp_path):
    trainer = Trainer(small_cfg(), run_dir=str(tmp_path))
    records = [trainer.train_step() for _ in range(3)]
    trainer.close()
    keys = {"step", "loss", "tokens", "tokens_per_s", "tokens_per_s_per_device", "mfu", "grad_norm",
            "peak_mem_bytes", "committed"}
    assert keys <= set(records[0])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["tokens"] == 64
    if trainer.device.type == "cpu":
        assert records[0]["mfu"] is None  # no peak FLOP/s for CPUs
    written = read_metrics(str(tmp_path))
    assert [r["step"] for r in written] == [1, 2, 3] and written[0]["loss"] == records[0]["loss"]


def test_commit_false_changes_nothing_and_hooks_see_grads():
    trainer = Trainer(small_cfg())
    trainer.train_step()
    before_hash, before_step = trainer.param_hash(), trainer.step
    before_lr = trainer.optimizer.param_groups[0]["lr"]
    before_data = trainer.state_dict()["data"]["batches_consumed"]
    seen = []

    def reduce(grads):
        seen.append(len(grads))
        for g in grads:
            g.mul_(0.5)  # in place, as a cross-replica average would

    record = trainer.train_step(Rules(reduce=reduce, commit=False))
    assert record["committed"] is False and record["step"] == before_step == trainer.step
    assert trainer.param_hash() == before_hash
    assert trainer.optimizer.param_groups[0]["lr"] == before_lr
    # the batch goes back: the next step trains on it (a failed step skips no data, on every replica alike)
    assert trainer.state_dict()["data"]["batches_consumed"] == before_data
    assert all(p.grad is None for p in trainer.params)
    assert seen == [len(trainer.params)]
    assert trainer.train_step(Rules(commit=True))["step"] == before_step + 1
    assert trainer.param_hash() != before_hash


def test_state_dict_transfer_makes_replicas_identical():
    """Peer healing in miniature: a fresh trainer loads a trained one's state and both continue identically."""
    donor = Trainer(small_cfg())
    for _ in range(3):
        donor.train_step()
    healed = Trainer(small_cfg())  # same run config (data order follows the seed), fresh weights
    with torch.no_grad():
        healed.params[0].add_(1.0)
    assert healed.param_hash() != donor.param_hash()
    healed.load_state_dict(donor.state_dict())
    assert healed.param_hash() == donor.param_hash() and healed.step == donor.step == 3
    a, b = donor.train_step(), healed.train_step()
    assert a["loss"] == b["loss"] and donor.param_hash() == healed.param_hash()


def test_a_batch_prefetched_before_a_heal_is_dropped():
    """The next batch is made during backward without advancing the data position, so a heal in between
    (which moves the position) must not let the stale batch through."""
    donor, healed = Trainer(small_cfg()), Trainer(small_cfg())
    for _ in range(3):
        donor.train_step()
    healed.train_step()  # it now holds batch 1, prefetched
    assert healed.dataloader.batches_consumed == 1 and healed._prefetched is not None
    healed.load_state_dict(donor.state_dict())  # position 3
    a, b = donor.train_step(), healed.train_step()  # the donor uses its prefetched batch 3; the healed a new one
    assert a["loss"] == b["loss"] and donor.param_hash() == healed.param_hash()
    assert donor.dataloader.batches_consumed == healed.dataloader.batches_consumed == 4


def test_state_dict_tensors_are_live_views():
    trainer = Trainer(small_cfg())
    sd = trainer.state_dict()
    name = trainer.param_names[0]
    sd["model"][name].fill_(0.25)  # writing into the state dict writes the parameter
    assert torch.all(trainer.params[0] == 0.25)
    with pytest.raises(ValueError, match="keys differ"):
        trainer.load_state_dict({**sd, "model": {"nope": torch.zeros(1)}})


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_gives_identical_next_step(tmp_path, async_save):
    cfg = small_cfg(async_checkpoint=async_save)
    trainer = Trainer(cfg)
    for _ in range(3):
        trainer.train_step()
    path = str(tmp_path / "step-3")
    trainer.save_checkpoint(path)
    trainer.wait_checkpoint()
    saved_hash = trainer.param_hash()
    expected = trainer.train_step()

    restored = Trainer(small_cfg(async_checkpoint=async_save))
    with torch.no_grad():
        restored.params[0].add_(1.0)  # make sure the load, not the init, provides the weights
    restored.load_checkpoint(path)
    assert restored.step == 3 and restored.param_hash() == saved_hash
    got = restored.train_step()
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    assert restored.param_hash() == trainer.param_hash()
    assert not os.path.exists(path + ".tmp")


def test_periodic_checkpoints(tmp_path):
    trainer = Trainer(small_cfg(checkpoint_dir=str(tmp_path), checkpoint_every=2))
    for _ in range(4):
        trainer.train_step()
    trainer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    manifest = json.loads((tmp_path / "step-4" / "regent_checkpoint.json").read_text())
    assert manifest["step"] == 4 and ".metadata" in manifest["files"]


def test_bad_checkpoints_give_clear_errors(tmp_path):
    trainer = Trainer(small_cfg())
    trainer.train_step()
    path = tmp_path / "step-1"
    trainer.save_checkpoint(str(path))

    with pytest.raises(CheckpointError, match="no checkpoint"):
        trainer.load_checkpoint(str(tmp_path / "missing"))

    (tmp_path / "half.tmp").mkdir()
    with pytest.raises(CheckpointError, match="never finished"):
        trainer.load_checkpoint(str(tmp_path / "half"))

    other = Trainer(small_cfg(model="150m", seq_len=8, batch_size=1))
    with pytest.raises(CheckpointError, match="use the same --model"):
        other.load_checkpoint(str(path))

    other_layout = Trainer(small_cfg(batch_size=3))
    with pytest.raises(CheckpointError, match="batch_size"):
        other_layout.load_checkpoint(str(path))

    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = trainer.param_hash()
    with pytest.raises(CheckpointError, match="corrupt"):
        trainer.load_checkpoint(str(path))
    assert trainer.param_hash() == before  # nothing was loaded

    (path / "regent_checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="did not finish"):
        trainer.load_checkpoint(str(path))


def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="--model"):
        Trainer(TrainConfig(model="huge"))
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=0).validate()
    with pytest.raises(ValueError, match="checkpoint_dir"):
        TrainConfig(checkpoint_every=5).validate()
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"modle": "debug"})
    with pytest.raises(RuntimeError, match="init_process_group"):
        Trainer(small_cfg(), rank=0, world_size=2)


def test_evaluate_loss_is_repeatable_and_falls_with_training():
    trainer = Trainer(small_cfg(lr=3e-3))
    before = trainer.evaluate_loss(batches=2)
    assert trainer.evaluate_loss(batches=2) == before  # fixed batches, no state change
    assert trainer.dataloader.batches_consumed == 0
    for _ in range(8):
        trainer.train_step()
    assert trainer.evaluate_loss(batches=2) < before - 0.5


def test_contiguous_state_trains_identically_and_is_laid_out_back_to_back():
    from regent.contiguous import is_contiguous_run

    flat, apart = Trainer(small_cfg()), Trainer(small_cfg(contiguous_state=False))
    try:
        assert flat.contiguous_state and not apart.contiguous_state
        moments = [[flat.optimizer.state[p][k] for p in flat.params] for k in ("exp_avg", "exp_avg_sq", "step")]
        assert is_contiguous_run(flat.params) and all(is_contiguous_run(m) for m in moments)
        assert not is_contiguous_run(apart.params)
        for _ in range(3):
            a, b = flat.train_step(), apart.train_step()
            assert a["loss"] == b["loss"]
        assert flat.param_hash() == apart.param_hash()
        # Loading a state (a heal, a checkpoint) writes into the buffers; it does not replace them.
        ptr = flat.params[0].data_ptr()
        flat.load_state_dict(apart.state_dict())
        assert flat.params[0].data_ptr() == ptr and is_contiguous_run(flat.params)
    finally:
        flat.close()
        apart.close()


def test_compile_also_compiles_the_loss_and_eager_keeps_the_specs():
    """With --train.compile the loss goes through torch.compile (TorchTitan does the same: its fused
    cross-entropy is most of the compiled step's lead); eager runs call the spec's loss itself. Construction
    only: compiling is lazy, so nothing is compiled here."""
    eager = Trainer(small_cfg())
    assert eager.loss_fn is eager.spec.loss
    eager.close()
    compiled = Trainer(small_cfg(compile=True))
    assert compiled.loss_fn is not compiled.spec.loss
    assert getattr(compiled.loss_fn, "_torchdynamo_orig_callable", None) is compiled.spec.loss
    compiled.close()


def test_data_position_a_donor_serves_does_not_depend_on_when_in_its_step_it_is_read(tmp_path):
    """A donor's state read in the middle of its step (its next batch already taken) gives the position of the
    last step boundary; a healer that loads it in the middle of its own step counts its own batch. Both end the
    step at the same position (the state votes found healed replicas one batch apart before)."""
    donor = Trainer(small_cfg(), run_dir=str(tmp_path / "d"))
    for _ in range(3):
        donor.train_step()
    between = donor.state_dict()["data"]["batches_consumed"]
    seen = {}

    def read_mid_step() -> bool:
        seen["sd"] = {k: v for k, v in donor.state_dict().items() if k in ("data", "step")}
        return True

    donor.train_step(Rules(commit=read_mid_step))
    assert seen["sd"]["data"]["batches_consumed"] == between == 3
    healer = Trainer(small_cfg(), run_dir=str(tmp_path / "h"))

    def heal_mid_step() -> bool:
        sd = healer.state_dict()
        sd["data"], sd["step"] = dict(seen["sd"]["data"]), seen["sd"]["step"]
        healer.load_state_dict(sd)
        return True

    healer.train_step(Rules(commit=heal_mid_step))
    assert healer.dataloader.batches_consumed == donor.dataloader.batches_consumed == 4
    assert healer.step == donor.step == 4
    donor.close()
    healer.close()
