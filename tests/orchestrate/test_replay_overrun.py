"""A replayed fault file plays to its end: past --duration the run goes on (bounded) until its last fault is
injected and every replica trains again."""

from __future__ import annotations

import time
from types import SimpleNamespace

from regent.orchestrate import run as run_mod
from regent.orchestrate.faults import PlannedFault, RandomFaultSchedule, ReplayFaultSchedule
from regent.orchestrate.live import RunView
from regent.orchestrate.run import OrchestrationManager


def _manager(duration: float, started_ago: float, healthy: dict[int, float | None]) -> SimpleNamespace:
    events: list[dict] = []
    m = SimpleNamespace(
        cfg=SimpleNamespace(steps=None, duration=duration), t_start=time.time() - started_ago,
        t_train=time.time() - started_ago + 5, healthy_since=healthy, view=RunView(len(healthy)),
        _replay_overrun_said=False, max_step=7, record_event=events.append, events=events,
    )
    m._replay_unfinished = lambda s: OrchestrationManager._replay_unfinished(m, s)
    return m


def test_duration_waits_for_pending_replayed_faults_and_recovery():
    sched = ReplayFaultSchedule([PlannedFault(78, 1, "exit", 1)])
    m = _manager(duration=100, started_ago=101, healthy={0: 1.0, 1: 1.0})
    assert not OrchestrationManager._done(m, sched)  # a fault still to come
    sched.pending.clear()
    m.healthy_since[1] = None  # the replica it hit is recovering
    assert not OrchestrationManager._done(m, sched)
    m.healthy_since[1] = time.time()
    assert OrchestrationManager._done(m, sched)
    assert m.events == []


def test_a_random_schedule_or_none_ends_at_the_duration():
    m = _manager(duration=100, started_ago=101, healthy={0: None, 1: 1.0})
    assert OrchestrationManager._done(m, None)
    assert OrchestrationManager._done(m, RandomFaultSchedule(["kill"], 10, 0, 0, 1))
    m.t_start = time.time() - 50
    assert not OrchestrationManager._done(m, ReplayFaultSchedule([PlannedFault(78, 1, "exit", 1)]))


def test_the_overrun_is_bounded_and_reported():
    sched = ReplayFaultSchedule([PlannedFault(300, 0, "kill", 0)])
    m = _manager(duration=100, started_ago=100 + run_mod.REPLAY_OVERRUN_S + 1, healthy={0: 1.0, 1: None})
    assert OrchestrationManager._done(m, sched)
    (cut,) = m.events
    assert cut["kind"] == "replay_cut" and cut["faults_left"] == ["kill"] and cut["recovering"] == [1]


def test_a_replica_that_gave_up_is_not_waited_for():
    m = _manager(duration=100, started_ago=101, healthy={0: 1.0, 1: None})
    m.view.reps[1].status = "gave up"
    assert OrchestrationManager._done(m, ReplayFaultSchedule([]))


def test_an_undelivered_replayed_fault_is_tried_again_a_random_one_is_skipped():
    replay = ReplayFaultSchedule([PlannedFault(10, 1, "exit", 1), PlannedFault(20, 0, "kill", 0)])
    first = replay.pick(11, {})
    assert "waits" in replay.not_delivered(first)
    assert replay.pick(11.25, {}) == first  # first again, before the later one
    rand = RandomFaultSchedule(["kill"], 10, 0, 0, 1)
    fault = rand.pick(1, {0: 0.0})
    assert rand.not_delivered(fault) == "skipped" and not rand.due(2)  # the next one comes on time
