"""The control-plane simulator: its pure pieces, and a small run against the real Lighthouse (behaviour, not
timing: no killed group is still counted live past the timeout, no live group is dropped): the cases that
start processes (the others: tests/unit/ft/test_simulate.py)."""

from __future__ import annotations

from regent.ft.simulate import (
    SimConfig,
    run_simulation,
)


def _check(report: dict, cfg: SimConfig) -> None:
    assert report["faults"] > 0
    assert report["liveness_polls"] > 0
    assert report["missed_failures"] == [], report
    assert report["false_failures"] == [], report
    assert report["heartbeat_lag"]["n"] > cfg.groups
    assert report["counters"]["bad_answers"] == 0
    assert report["counters"]["goaway"] == 0
    assert report["quorum"]["rounds"] > 0


def test_small_simulation_against_the_real_lighthouse() -> None:
    """Crashed and hung groups are dropped within the heartbeat timeout (crashes at once, by their next
    incarnation), live ones never; quorum rounds complete around the faults."""
    cfg = SimConfig(groups=96, workers=2, duration_s=7.0, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5,
                    quorum_every_s=1.0, join_timeout_ms=500, faults_per_s=1.5, down_s=2.5, warmup_s=1.5,
                    silent_fraction=0.5, seed=3)
    _check(run_simulation(cfg), cfg)


def test_small_simulation_with_compact_answers() -> None:
    cfg = SimConfig(groups=64, workers=1, duration_s=5.0, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5,
                    quorum_every_s=0.7, join_timeout_ms=500, faults_per_s=1.0, down_s=1.0, warmup_s=1.5,
                    compact=True, seed=5)
    report = run_simulation(cfg)
    _check(report, cfg)
    assert report["quorum"]["answer_bytes"] < 400  # the share, not 64 members
