"""The one configuration system: typed fields parsed and checked by pydantic (regent.config_values)."""

from __future__ import annotations

from typing import Literal

import pytest

from regent.config_values import ConfigError, check_fields, coerce, parse_duration
from regent.ft.config import FTConfig
from regent.orchestrate.config import RunConfig, apply_toml, set_option, validate
from regent.train.config import TrainConfig


def test_a_tuple_field_stays_a_tuple_from_flags_toml_and_json():
    cfg = RunConfig()
    set_option(cfg, "train.betas", "0.9,0.99")
    assert cfg.train.betas == (0.9, 0.99) and isinstance(cfg.train.betas, tuple)
    apply_toml(cfg, {"train": {"betas": [0.8, 0.9]}})
    assert cfg.train.betas == (0.8, 0.9) and isinstance(cfg.train.betas, tuple)
    assert TrainConfig.from_dict({"betas": [0.5, 0.6], "seq_len": "32"}).betas == (0.5, 0.6)
    with pytest.raises(ConfigError, match=r"--train.betas: expected tuple\[float, float\]"):
        set_option(cfg, "train.betas", "0.9")


@pytest.mark.parametrize("key, bad, suggestion", [
    ("recovery", "peeer", "peer"), ("job", "slurmm", "slurm"), ("ft.mode", "diloko", "diloco"),
    ("ft.backend", "ncc", "nccl"),
])
def test_a_literal_value_is_checked_with_a_suggestion(key, bad, suggestion):
    with pytest.raises(ConfigError, match=f"is not one of .*did you mean {suggestion}\\?"):
        set_option(RunConfig(), key, bad)


def test_each_fault_kind_is_checked():
    cfg = RunConfig()
    set_option(cfg, "faults.kinds", "kill,hang")
    assert cfg.faults.kinds == ["kill", "hang"]
    with pytest.raises(ConfigError, match="'meteor' is not one of exception"):
        set_option(cfg, "faults.kinds", "kill,meteor")


def test_toml_errors_name_the_key_as_written_in_toml():
    with pytest.raises(ConfigError, match=r"^\[ft\] mode: 'bad' is not one of diloco, ddp"):
        apply_toml(RunConfig(), {"ft": {"mode": "bad"}})
    with pytest.raises(ConfigError, match=r"^\[ft\] sync_every: expected int"):
        apply_toml(RunConfig(), {"ft": {"sync_every": 2.5}})


def test_durations_numbers_none_and_bools():
    cfg = RunConfig()
    set_option(cfg, "faults.every", "1m30s")
    assert cfg.faults.every == 90.0
    set_option(cfg, "faults.every", "12.5")
    assert cfg.faults.every == 12.5
    with pytest.raises(ConfigError, match="expected float.*duration like 30s"):
        set_option(cfg, "faults.every", "fast")
    set_option(cfg, "train.data", "none")
    assert cfg.train.data is None
    set_option(cfg, "ft.vote_every", "null")
    assert cfg.ft.vote_every is None
    for word, value in (("yes", True), ("off", False), ("1", True)):
        set_option(cfg, "train.compile", word)
        assert cfg.train.compile is value
    with pytest.raises(ConfigError, match="--train.compile: expected bool, got 'maybe'"):
        set_option(cfg, "train.compile", "maybe")
    assert parse_duration("250ms") == 0.25


def test_validate_checks_a_config_built_in_python():
    """A config built in Python is not parsed; validate() still checks every field of every section."""
    cfg = RunConfig()
    cfg.recovery = "sometimes"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="--recovery: 'sometimes' is not one of peer, restart"):
        validate(cfg)
    cfg = RunConfig()
    cfg.ft = FTConfig(mode="allreduce")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--ft.mode: 'allreduce' is not one of diloco, ddp"):
        validate(cfg)
    cfg = RunConfig()
    cfg.lighthouse.min_replicas = "two"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="--lighthouse.min-replicas: expected int"):
        validate(cfg)


def test_coerce_and_check_fields_on_any_dataclass():
    from dataclasses import dataclass

    @dataclass
    class Section:
        color: Literal["red", "blue"] = "red"
        size: int | None = None

    assert coerce("blue", Literal["red", "blue"], "--color") == "blue"
    check_fields(Section(), lambda n: n)
    with pytest.raises(ConfigError, match="size: expected int"):
        check_fields(Section(size="big"), lambda n: n)  # type: ignore[arg-type]


def test_a_constant_batch_takes_plain_diloco_and_refuses_streaming():
    FTConfig(mode="diloco", constant_batch=True).validate()
    FTConfig(mode="ddp", constant_batch=True).validate()
    with pytest.raises(ValueError, match="ft.fragments=1 and ft.fragment_sync_delay=0"):
        FTConfig(mode="diloco", constant_batch=True, sync_every=20, fragments=2).validate()
    with pytest.raises(ValueError, match="ft.fragments=1 and ft.fragment_sync_delay=0"):
        FTConfig(mode="diloco", constant_batch=True, fragment_sync_delay=1).validate()


def test_a_constant_batch_is_on_by_default_in_per_step_mode_only_where_the_data_path_allows():
    from regent.orchestrate.config import RunConfig, constant_batch_choice

    def choice(**ft: object) -> tuple[bool, str]:
        cfg = RunConfig()
        for k, v in ft.items():
            if k in ("trainer", "no_ft"):
                setattr(cfg, k, v)
            elif k == "data":
                cfg.train.data = v  # type: ignore[assignment]
            else:
                setattr(cfg.ft, k, v)
        return constant_batch_choice(cfg)

    assert RunConfig().ft.constant_batch is None  # nobody chose: the mode and the data path decide
    assert choice(mode="ddp") == (True, "per-step mode's default: survivors take a missing replica's micro-batches")
    on, why = choice(mode="diloco")
    assert not on and "round in progress" in why  # DiLoCo keeps the mid-round join (issue 36 item 5)
    assert choice(mode="ddp", trainer="pkg.mod:make")[0] is False
    assert choice(mode="ddp", data="hf:wikitext")[0] is False
    assert choice(mode="ddp", no_ft=True)[0] is False
    # a value given wins either way
    assert choice(mode="ddp", constant_batch=False) == (False, "set by --ft.constant-batch")
    assert choice(mode="diloco", constant_batch=True) == (True, "set by --ft.constant-batch")
