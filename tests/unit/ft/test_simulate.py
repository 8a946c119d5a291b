"""The control-plane simulator: its pure pieces, and a small run against the real Lighthouse (behaviour, not
timing: no killed group is still counted live past the timeout, no live group is dropped)."""

from __future__ import annotations

from regent.ft.simulate import (
    LagHistogram,
    Life,
    SimConfig,
    fault_schedule,
    judge_liveness,
    lives,
)


def test_fault_schedule_is_seeded_and_never_fails_a_dead_group() -> None:
    cfg = SimConfig(groups=10, duration_s=60, faults_per_s=2, down_s=3, warmup_s=1, seed=7)
    faults = fault_schedule(cfg)
    assert faults == fault_schedule(cfg)
    assert faults != fault_schedule(SimConfig(groups=10, duration_s=60, faults_per_s=2, down_s=3, seed=8))
    assert all(cfg.warmup_s < f.at < cfg.duration_s and f.restart_at == f.at + 3 for f in faults)
    by_group: dict[int, list[float]] = {}
    for f in faults:
        by_group.setdefault(f.group, []).append(f.at)
    for times in by_group.values():
        assert all(b >= a + cfg.down_s for a, b in zip(times, times[1:]))
    assert fault_schedule(SimConfig(faults_per_s=0)) == []


def test_lives_follow_the_faults_with_new_incarnations() -> None:
    cfg = SimConfig(groups=3, duration_s=30, faults_per_s=1, down_s=2, seed=1)
    faults = fault_schedule(cfg)
    all_lives = lives(cfg, faults)
    restarted = sum(1 for f in faults if f.restart_at < cfg.duration_s)  # a restart after the end never lives
    assert len(all_lives) == cfg.groups + restarted
    assert len({life.replica_id for life in all_lives}) == len(all_lives)
    for g in range(cfg.groups):
        mine = [life for life in all_lives if life.group == g]
        assert mine[0].start == 0
        assert {life.replica_id.split(":")[0] for life in mine} == {f"sim{g}"}


def test_judge_liveness() -> None:
    dead = Life("a:1", 0, 0.0, 10.0)
    alive = Life("b:1", 1, 0.0, None)
    young = Life("c:1", 2, 19.5, None)
    # within the timeout a dead incarnation may still count; a live one must count once its grace passed
    assert judge_liveness(14.0, 14.1, {"a:1", "b:1"}, [dead, alive], 5.0, 1.0, 0.5) == (set(), set())
    assert judge_liveness(16.0, 16.1, {"a:1", "b:1"}, [dead, alive], 5.0, 1.0, 0.5) == ({"a:1"}, set())
    assert judge_liveness(20.0, 20.1, {"c:1"}, [dead, alive, young], 5.0, 1.0, 0.5) == (set(), {"b:1"})


def test_lag_histogram() -> None:
    h = LagHistogram()
    for ms in range(1, 101):
        h.add(ms / 1000)
    assert h.count == 100
    assert abs(h.percentile(50) - 0.050) < 0.050 * 0.06
    assert h.percentile(100) == 0.1
    other = LagHistogram()
    other.add(2.0)
    h.merge(LagHistogram.from_json(other.to_json()))
    assert h.count == 101 and h.maximum == 2.0
    assert LagHistogram().percentile(99) == 0.0
