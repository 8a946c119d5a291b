"""Adaptive hang detection, the chaos fault kinds (straggler, correlated, lighthouse), and the run's own failure
paths: pure tests first, then one real run with a Lighthouse kill and a hang."""

from __future__ import annotations

import asyncio
import json

import pytest

from regent.orchestrate.commands import parse_train_argv
from regent.orchestrate.config import FAULT_KINDS, ConfigError, FaultConfig
from regent.orchestrate.faults import (
    PlannedFault,
    RandomFaultSchedule,
    ReplayFaultSchedule,
    fault_record,
)
from regent.orchestrate.hang import HangDetector, HangRule, p99
from regent.orchestrate.run import _event, fixed_bind, highest_commit
from regent.orchestrate.vote import decide

# -- the hang rule ---------------------------------------------------------------------------------------------

RULE = HangRule(ceiling_s=15.0, floor_s=4.0, latency_k=3.0, step_k=0.5, margin_s=1.0, startup_s=90.0)


def stepping(detector: HangDetector, latency: float, step_time: float = 0.2, answers: int = 40,
             generation: int = 0, start_step: int = 0, t0: float = 0.0) -> float:
    """Feed `answers` pings of a ready replica taking a step every `step_time` s; returns the last answer's time."""
    detector.start_generation(generation)
    detector.on_answer(generation, 0.5, [start_step], t0)  # the first ready answer (start-up: not counted)
    now = t0
    for _ in range(answers):
        now += 0.5 + latency
        detector.on_answer(generation, latency, [start_step + int((now - t0) / step_time)], now)
    return now


def test_fast_answers_give_the_floor():
    d = HangDetector(RULE)
    stepping(d, latency=0.005)
    assert d.phase == "steady"
    assert d.deadline() == pytest.approx(4.0)
    assert not d.is_hung(3.9) and d.is_hung(4.1)
    assert "steady" in d.explain() and "p99 ping" in d.explain()


def test_slow_machine_gets_a_longer_deadline():
    d = HangDetector(RULE)
    stepping(d, latency=1.5)
    assert d.deadline() == pytest.approx(3 * 1.5 + 1.0)  # k x p99 latency + margin
    slow_steps = HangDetector(RULE)
    stepping(slow_steps, latency=0.01, step_time=12.0, answers=200)
    # ~12 s per step observed: half of it, plus the margin, beats the fast pings
    assert 6.0 < slow_steps.deadline() < 8.0


def test_one_slow_answer_counts():
    d = HangDetector(RULE)
    stepping(d, latency=0.01)
    d.on_answer(0, 2.0, [10_000], 1000.0)
    assert d.deadline() == pytest.approx(3 * 2.0 + 1.0)
    assert p99([0.01] * 98 + [2.0]) == 2.0  # nearest rank: the largest of fewer than 100


def test_never_above_the_ceiling():
    d = HangDetector(RULE)
    stepping(d, latency=10.0, answers=5)
    assert d.deadline() == 15.0
    s = HangDetector(RULE)
    stepping(s, latency=0.01, step_time=100.0, answers=1000)
    assert s.deadline() == 15.0


def test_start_up_allowance_until_a_generation_answers_ready():
    d = HangDetector(RULE)
    d.start_generation(0)
    assert d.phase == "startup" and d.deadline() == 90.0 and not d.ready
    assert not d.is_hung(60.0)  # a cold process importing torch
    d.on_answer(0, 20.0, [-1], 20.0)  # the actor is up, the model not built yet: still start-up
    assert d.deadline() == 90.0 and not d.latencies
    d.on_answer(0, 8.0, [0], 30.0)  # ready; this slow first answer is not a sample
    assert d.phase == "warming" and d.ready and not d.latencies
    assert d.deadline() == 15.0  # ready but no step yet (quorum, heal): the ceiling
    d.on_answer(0, 0.01, [0], 31.0)
    assert d.deadline() == 15.0
    d.on_answer(0, 0.01, [3], 32.0)
    assert d.phase == "steady" and d.deadline() == pytest.approx(4.0)


def test_a_new_generation_starts_over_but_keeps_the_machine_latencies():
    d = HangDetector(RULE)
    t = stepping(d, latency=1.0)
    d.start_generation(1)
    assert d.phase == "startup" and d.deadline() == 90.0
    d.on_answer(0, 0.01, [999], t + 1)  # a late answer of the old generation changes nothing
    assert d.phase == "startup"
    stepping(d, latency=1.0, generation=1, answers=2, t0=t + 5)
    assert d.deadline() == pytest.approx(4.0)


def test_straggler_shorter_than_the_deadline_is_tolerated():
    faults = FaultConfig()
    rule = HangRule.from_faults(faults)
    assert rule.floor_s > faults.straggler_s  # the default straggler must not look like a hang
    d = HangDetector(rule)
    t = stepping(d, latency=0.01)
    # paused just after a ping was sent: it stays unanswered for the pause plus a bit
    assert not d.is_hung(faults.straggler_s + 0.5)
    d.on_answer(0, faults.straggler_s + 0.5, [10_000], t + 4)
    # its late answer makes the deadline grow for a while; a pause longer than the deadline is a hang
    assert d.deadline() == pytest.approx(min(15.0, 3 * (faults.straggler_s + 0.5) + 1.0))
    assert d.is_hung(d.deadline() + 0.1)


def test_rule_from_config_knobs():
    rule = HangRule.from_faults(FaultConfig(hang_timeout=30.0, hang_floor_s=2.5, hang_latency_k=5.0))
    assert (rule.ceiling_s, rule.floor_s, rule.latency_k, rule.startup_s) == (30.0, 2.5, 5.0, 120.0)
    assert HangRule.from_faults(FaultConfig()).startup_s == 90.0
    assert HangRule.from_faults(FaultConfig(hang_timeout=3.0)).floor_s == 3.0  # the floor never beats the ceiling


# -- the fault schedule ----------------------------------------------------------------------------------------

ALL_HEALTHY = {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}


def draw(kinds, seed=0, healthy=None, **kw):
    s = RandomFaultSchedule(kinds, every=5, warmup=5, holdoff=1, procs_per_replica=2, seed=seed, **kw)
    out = []
    for t in range(0, 400):
        if s.due(t) and (f := s.pick(t, healthy or ALL_HEALTHY)):
            out.append(f)
    return out


def test_chaos_schedule_is_seeded():
    a, b = draw(list(FAULT_KINDS), seed=3), draw(list(FAULT_KINDS), seed=3)
    assert a == b and len(a) > 50
    assert {f.kind for f in a} == set(FAULT_KINDS)
    assert draw(list(FAULT_KINDS), seed=4) != a


def test_correlated_picks_distinct_replicas_within_the_window():
    faults = draw(["correlated"], seed=1, correlated_window=2.0)
    assert faults
    for f in faults:
        assert f.replica is None and len(f.replicas) == 2 and len(set(f.replicas)) == 2
        assert set(f.replicas) <= set(ALL_HEALTHY)
        assert f.offsets[0] == 0.0 and list(f.offsets) == sorted(f.offsets)
        assert all(0.0 <= o <= 2.0 for o in f.offsets)
        assert f.targets == f.replicas
    assert len({f.replicas for f in faults}) > 1  # not always the same pair


def test_correlated_size_all_and_fewer_eligible():
    for f in draw(["correlated"], correlated_size="all"):
        assert sorted(f.replicas) == [0, 1, 2, 3]
    for f in draw(["correlated"], correlated_size=3, healthy={0: 0.0, 1: None, 2: 0.0, 3: None}):
        assert sorted(f.replicas) == [0, 2]  # only two are running
    with pytest.raises(ValueError):
        RandomFaultSchedule(["correlated"], 5, 5, 1, 1, correlated_size=1)


def test_lighthouse_fault_hits_no_replica():
    faults = draw(["lighthouse"])
    assert faults and all(f.replica is None and f.targets == () for f in faults)
    assert draw(["lighthouse"], healthy={0: None, 1: None}) == []  # waits until the run is healthy


def test_single_replica_kinds_unchanged():
    for f in draw(["kill", "straggler"], seed=2):
        assert f.replica in ALL_HEALTHY and f.replicas == () and f.targets == (f.replica,)
        assert 0 <= f.rank < 2


def test_records_say_which_replicas_were_hit_and_replay(tmp_path):
    planned = [
        PlannedFault(1.0, 2, "hang", 1),
        PlannedFault(2.0, None, "correlated", 0, replicas=(3, 0), offsets=(0.0, 1.25)),
        PlannedFault(3.0, None, "lighthouse", 0),
    ]
    records = [json.loads(fault_record(f)) for f in planned]
    assert records[0]["replica"] == 2 and records[0]["replicas"] == [2] and records[0]["kind"] == "hang"
    assert records[1]["replica"] is None and records[1]["replicas"] == [3, 0] and records[1]["offsets"] == [0, 1.25]
    assert records[2]["replica"] is None and records[2]["replicas"] == []
    p = tmp_path / "faults.jsonl"
    p.write_text("".join(fault_record(f) + "\n" for f in planned)
                 + '{"at": 4, "kind": "lighthouse"}\n{"at": 5, "kind": "correlated", "replicas": [1, 2]}\n')
    s = ReplayFaultSchedule.from_file(p)
    replayed = [s.pick(100, {}) for _ in range(5)]
    assert replayed[:3] == planned
    assert replayed[3] == PlannedFault(4.0, None, "lighthouse", 0)
    assert replayed[4].replicas == (1, 2) and replayed[4].offsets == (0.0, 0.0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"at": 1, "kind": "correlated", "replicas": [1, 1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        ReplayFaultSchedule.from_file(bad)


# -- configuration ---------------------------------------------------------------------------------------------


def test_chaos_flag_turns_on_every_kind(tmp_path):
    cfg = parse_train_argv(["--chaos", "--fault-every", "20s", "--run-dir", str(tmp_path / "r")])
    assert cfg.faults.enabled and cfg.faults.kinds == list(FAULT_KINDS) and cfg.faults.every == 20
    assert {"straggler", "correlated", "lighthouse"} <= set(cfg.faults.kinds)
    assert parse_train_argv(["--run-dir", str(tmp_path / "d")]).faults.kinds == ["kill", "exception", "comm", "hang"]
    with pytest.raises(ConfigError, match="--chaos"):
        parse_train_argv(["--chaos", "--fault-kinds", "kill"])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--faults.correlated-size", "1"], "correlated-size"),
        (["--faults.correlated-size", "many"], "correlated-size"),
        (["--faults.hang-floor-s", "0"], "hang-floor-s"),
        (["--faults.straggler-s", "0"], "straggler-s"),
        (["--fault-kinds", "lighthouse", "--lighthouse.address", "http://h:1"], "external"),
    ],
)
def test_bad_chaos_knobs_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_train_argv(argv)


def test_correlated_size_all_accepted():
    assert parse_train_argv(["--faults.correlated-size", "all"]).faults.correlated_size == "all"


# -- run-level helpers -----------------------------------------------------------------------------------------


def test_fixed_bind_keeps_the_first_port():
    assert fixed_bind("127.0.0.1:0", "http://127.0.0.1:29517") == "127.0.0.1:29517"
    assert fixed_bind("0.0.0.0:29510", "http://host:29510") == "0.0.0.0:29510"
    assert fixed_bind("[::1]:0", "http://[::1]:4000/") == "[::1]:4000"


def test_the_controller_keeps_the_highest_commit_a_replica_reported():
    seen = (0, 0)
    for m in ({"manager_step": 3, "lineage": 2}, {"manager_step": 9, "lineage": None},  # group rank > 0: no lineage
              {"manager_step": 5, "lineage": 2}, {"manager_step": 4, "lineage": 6},  # restored older state, later
              {"step": 12}):
        seen = highest_commit(seen, m)
    assert seen == (5, 2)


def test_events_of_kinds_not_listed_yet_have_the_usual_fields():
    e = _event("lighthouse_restarted", cause="crashed", step=7)
    assert e["kind"] == "lighthouse_restarted" and e["cause"] == "crashed" and e["step"] == 7
    assert {"time", "replica", "generation", "quorum_id"} <= set(e)
    assert _event("fault_injected", replica=1)["kind"] == "fault_injected"


def test_fatal_state_lost_fails_the_run(tmp_path, capsys):
    from regent.orchestrate.run import OrchestrationManager

    cfg = parse_train_argv(["--run-dir", str(tmp_path / "r"), "--no-live", "--replicas", "2"])
    m = OrchestrationManager(cfg)
    m.record_event(_event("state_lost", replica=1, fatal=False, lost_step=3, restored_step=0))
    assert m.failed_reason is None  # restored from a backstop: not fatal
    m.record_event(_event("state_lost", replica=1, fatal=True, lost_step=5, reason="replicas 0 and 1 died"))
    assert "replicas 0 and 1 died" in m.failed_reason and "step 5" in m.failed_reason
    assert "RUN FAILED" in capsys.readouterr().out
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "run_failed"]
    assert len(failed) == 1 and "replicas 0 and 1 died" in failed[0]["reason"]
    m.record_event(_event("state_lost", replica=0, fatal=True, lost_step=5))
    assert sum(e["kind"] == "run_failed" for e in map(json.loads, (tmp_path / "r" / "events.jsonl")
                                                        .read_text().splitlines())) == 1


def test_a_copy_of_a_state_a_vote_stopped_is_stopped_too(tmp_path, capsys):
    """A tie while replica 2 restarts: both voters are stopped (backstop). Replica 2 healed from one of them
    meanwhile: its copy is as untrusted as the original and is stopped as well, and so is a copy of that copy; a
    heal from anyone else is left alone. A vote with a majority vouches for the backstop of its step."""
    from regent.ft.backstop import read_verdicts
    from regent.orchestrate.run import OrchestrationManager

    cfg = parse_train_argv(["--run-dir", str(tmp_path / "r"), "--no-live", "--replicas", "3"])
    m = OrchestrationManager(cfg)
    stopped: list[tuple[int, int | None]] = []

    async def stop(replica: int, generation: int | None, why: str) -> None:
        stopped.append((replica, generation))

    m._stop_diverged = stop  # the replica actors are not started here; this records what would be stopped
    m._replicas = object()

    async def scenario() -> None:
        for r in (0, 1):
            m.record_event(_event("commit", replica=r, generation=0, replica_id=f"replica_{r}:a", committed=True,
                                  manager_step=100))
        for r, digest in ((0, "flipped"), (1, "good")):
            m.record_event({"kind": "state_digest", "replica": r, "generation": 0, "manager_step": 100, "rank": 0,
                            "ranks": 1, "digest": digest})
        # replica 2 was restarting; it healed from replica 0 (to step 100) before the vote is decided, and is live
        # again: it holds no state of its own at step 100, so the vote does not wait for its ballot
        m.record_event(_event("heal_done", replica=2, generation=1, replica_id="replica_2:b", donor="replica_0:a",
                              manager_step=100))
        m.healthy_since.update({0: 1.0, 1: 1.0, 2: 2.0})
        m._decide_votes()
        m.record_event(_event("heal_done", replica=0, generation=1, replica_id="replica_0:c", donor="replica_2:b",
                              manager_step=100))
        m.record_event(_event("heal_done", replica=1, generation=1, replica_id="replica_1:d", donor="replica_9:z",
                              manager_step=90))
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert stopped[:2] == [(0, 0), (1, 0)]  # the tie: both voters
    assert (2, 1) in stopped and (0, 1) in stopped  # the copy, and the copy of the copy
    assert (1, 1) not in stopped and "replica_1:d" not in m._distrusted
    assert "copied a state a vote stopped" in capsys.readouterr().out
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    (vote,) = [e for e in events if e["kind"] == "state_vote"]
    assert vote["diverged"] == [0, 1] and not vote["undecided"]
    assert read_verdicts(tmp_path / "r" / "backstop") == {}  # a tie vouches for nothing
    m._vouch_backstop(decide(104, {0: "x", 1: "x", 2: "x"}))
    assert read_verdicts(tmp_path / "r" / "backstop") == {104: "x"}
