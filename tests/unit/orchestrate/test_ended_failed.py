"""A replica that fails after the run has decided to stop is stopped, not restarted (seen at the end of a soak:
the restarted replica could not heal from finishing peers, restored an old backstop and trained alone for ~2
minutes, counted as a full restart). Its peers hold the committed state; the summary says which replica ended so."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from regent.orchestrate.events import make_event
from regent.orchestrate.policy import RestartPolicy
from regent.orchestrate.replica import ReplicaActor
from regent.orchestrate.summary import recovery_breakdowns


class _Report:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, item: tuple) -> None:
        self.sent.append(item)


def _replica(stop_target: int | None) -> tuple[ReplicaActor, _Report]:
    replica = ReplicaActor.__new__(ReplicaActor)  # the decision only, without a runtime around it
    report = _Report()
    replica.__dict__.update(
        cfg=SimpleNamespace(), index=1, report=report, policy=RestartPolicy(), autorestart=True, finished=False,
        stop_target=stop_target, ended_failed=False, errors={}, procs=None, trainers=None, _restart_task=None,
        _healing_at_end=False,
        last_error="")
    return replica, report


def test_a_failure_after_the_stop_decision_ends_the_replica_instead_of_restarting_it():
    async def go() -> tuple[list[str], RestartPolicy]:
        replica, report = _replica(stop_target=200)
        replica._on_failure(0, "rank 0 raised RuntimeError('boom')", "tb", rank=0)
        replica._on_failure(0, "rank 0 raised RuntimeError('again')", "tb", rank=0)  # reported once
        await replica._restart_task
        return [item[1]["kind"] for item in report.sent], replica.policy

    kinds, policy = asyncio.run(go())
    assert kinds == ["failure_detected", "ended_failed"]
    assert policy.attempts == 0  # no restart was counted or started


def test_the_recovery_record_of_an_ended_replica_is_closed():
    t = 1000.0
    events = [
        make_event("fault_injected", replica=1, t=t, fault_kind="kill"),
        make_event("failure_detected", replica=1, generation=0, t=t + 0.5),
        make_event("ended_failed", replica=1, generation=0, t=t + 0.6),
        make_event("commit", replica=1, generation=1, t=t + 5.0, committed=True),
    ]
    assert recovery_breakdowns(events) == []


def test_a_correlated_fault_is_the_cause_of_the_failures_it_made():
    t = 2000.0
    events = [
        make_event("fault_injected", replica=0, t=t, fault_kind="comm"),  # healed in place: no failure
        make_event("fault_injected", replica=None, replicas=[1, 0], offsets=[0.0, 1.0], t=t + 60,
                   fault_kind="correlated"),
        make_event("failure_detected", replica=0, generation=0, t=t + 61.5),
        make_event("restart_done", replica=0, generation=1, t=t + 62.0),
        make_event("commit", replica=0, generation=1, t=t + 63.0, committed=True),
    ]
    (rec,) = recovery_breakdowns(events)
    assert rec["fault_kind"] == "correlated"
    assert abs(rec["detect"] - 0.5) < 1e-6 and abs(rec["total"] - 2.0) < 1e-6
