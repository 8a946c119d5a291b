"""`--ft.backend` reaches the Manager's cross-replica group (it was validated and then ignored: two replicas on
one GPU still built NCCL groups and every quorum failed with "Duplicate GPU detected")."""

from __future__ import annotations

import pytest

from regent.ft.config import FTConfig
from regent.orchestrate.commands import parse_train_argv
from regent.orchestrate.session import replicated_group


@pytest.mark.parametrize(("flag", "expected"), [("gloo", "gloo"), ("nccl", "nccl"), ("rccl", "nccl")])
def test_the_flag_picks_the_replicated_group_backend(flag, expected):
    cfg = parse_train_argv(["--no-live", "--steps", "3", "--ft.backend", flag])
    assert cfg.ft.backend == flag
    assert replicated_group(cfg.ft).backend == expected


def test_unset_lets_the_platform_decide_and_timeouts_follow_the_environment(monkeypatch):
    monkeypatch.setenv("GPU_PLATFORM", "cpu")
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "7")
    group = replicated_group(FTConfig(timeout_s=30.0, connect_timeout_s=11.0))
    assert group.backend == "gloo"
    assert group.timeout == 7.0 and group.connect_timeout == 11.0
