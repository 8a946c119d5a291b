"""Found on the GPU case study: a 70 s run injected no faults. The fault schedule counts seconds from the
first training step, but the orchestrator handed it wall-clock "healthy since" times, so no replica was ever
healthy for `holdoff` seconds on the schedule's clock."""

from __future__ import annotations

from regent.orchestrate.faults import RandomFaultSchedule
from regent.orchestrate.run import since_first_step


def test_a_replica_healthy_long_enough_gets_a_fault() -> None:
    t_train = 1_795_977_400.0  # wall clock of the first step
    healthy_since = {0: t_train + 1.0, 1: t_train + 2.0}  # wall clock, as the orchestrator records them
    schedule = RandomFaultSchedule(["kill"], every=18.0, warmup=12.0, holdoff=20.0, procs_per_replica=1, seed=0)
    now = 25.0  # seconds since the first step
    assert schedule.due(now)
    fault = schedule.pick(now, since_first_step(healthy_since, t_train))
    assert fault is not None and fault.replica in (0, 1) and fault.kind == "kill"


def test_unhealthy_replicas_stay_ineligible() -> None:
    assert since_first_step({0: None, 1: 105.0}, 100.0) == {0: None, 1: 5.0}
