"""`regent check`: the seven run directories that each hide a loss or a disagreement (issue 32), the holes found
in the code beside them, and clean runs that must pass. Each case fails on the checker before issue 32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from regent.cli import main as cli_main
from regent.orchestrate.invariants import check_run
from regent.orchestrate.summary import compute_summary
from regent.orchestrate.vote import decide


def ev(kind: str, t: float, replica: int | None = None, generation: int | None = 0, **kw: Any) -> dict[str, Any]:
    return {"time": float(t), "kind": kind, "replica": replica, "generation": generation, "quorum_id": 1,
            "step": kw.pop("step", None), **kw}


class Run:
    """A synthetic run in today's format: per-step records every second for each replica, a commit event per
    committed step (ddp) or per sync (DiLoCo, every `h` steps), stopped and finished at the end."""

    def __init__(self, mode: str = "ddp", replicas: int = 3, h: int = 1) -> None:
        self.mode, self.replicas, self.h = mode, replicas, h
        self.events: list[dict[str, Any]] = [ev("run_started", 0.0, generation=None, mode=mode, replicas=replicas)]
        self.metrics: list[dict[str, Any]] = []
        self.finals: list[dict[str, Any]] | None = None

    def train(self, replica: int, t0: float, t1: float, step0: int, gen: int = 0, ms0: int | None = None) -> int:
        """Replica trains one step a second from time t0 (at trainer step step0 + 1) until t1; returns the last
        trainer step. The manager step is the trainer step (ddp) or the number of syncs (DiLoCo)."""
        step = step0
        ms = (step0 // self.h) if ms0 is None else ms0
        t = t0
        while t < t1:
            step += 1
            if step % self.h == 0:
                ms += 1
                self.events.append(ev("commit", t - 0.01, replica, gen, committed=True, manager_step=ms, step=step))
            self.metrics.append({"time": t, "replica": replica, "generation": gen, "step": step, "manager_step": ms,
                                 "committed": True, "loss": 5.0 - 0.001 * step, "rank": 0})
            t += 1.0
        return step

    def finish(self, t: float, finals: dict[int, tuple[int, str]] | None = None) -> None:
        self.events.append(ev("training_stopped", t, generation=None))
        self.events.append(ev("run_finished", t + 5, generation=None))
        if finals is None:
            top = max(m["step"] for m in self.metrics)
            finals = {r: (top, "d" * 64) for r in range(self.replicas)}
        self.finals = [{"replica": r, "step": s, "digest": d, "ranks": 1} for r, (s, d) in finals.items()]

    def write(self, path: Path, **summary_overrides: Any) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        for name, rows in (("events.jsonl", self.events), ("metrics.jsonl", self.metrics)):
            (path / name).write_text("".join(json.dumps(x) + "\n" for x in sorted(rows, key=lambda r: r["time"])))
        s = compute_summary(self.events, self.metrics, replicas=self.replicas, replicas_consistent=True,
                            final_states=self.finals)
        s["final_states"] = self.finals
        s.update(summary_overrides)
        (path / "summary.json").write_text(json.dumps(s))
        return path


def clean(mode: str = "ddp", h: int = 1) -> Run:
    run = Run(mode, h=h)
    for r in range(3):
        run.train(r, 1.0, 301.0, 0)
    run.finish(301.5)
    return run


@pytest.mark.parametrize("mode,h", [("ddp", 1), ("diloco", 5)])
def test_clean_runs_hold(tmp_path, mode, h, capsys):
    run = clean(mode, h).write(tmp_path / "r")
    assert check_run(run) == []
    assert cli_main(["check", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"{run}: holds"


def test_1_two_replicas_silently_go_back_while_the_third_stays_at_the_top(tmp_path, capsys):
    run = Run()
    run.train(0, 1.0, 801.0, 0)
    for r in (1, 2):
        last = run.train(r, 1.0, 601.0, 0)
        # a new generation that resumes 500 committed steps back, with no state_lost
        run.train(r, 601.0, 801.0, last - 500, gen=1)
    run.finish(801.5, {r: (800, "d" * 64) for r in range(3)})
    v = check_run(run.write(tmp_path / "r"))
    assert sum("went back from 600 to 101" in x for x in v) == 2, v
    assert all("no state_lost" in x for x in v if "went back" in x)
    assert cli_main(["check", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().out.count("VIOLATION") >= 2


def test_2_a_counted_small_reset_does_not_excuse_a_large_drop_after_it(tmp_path):
    run = Run()
    for r in range(3):
        run.train(r, 1.0, 100.0, 0)  # to step 99
    # every replica dies; the backstop holds step 79: a counted 20-step reset
    run.events += [ev("state_lost", 101.0 + r * 0.1, r, 1, lost_step=99, restored_step=79, fatal=False,
                      source="backstop/step-79") for r in range(3)]
    for r in range(3):
        run.train(r, 102.0, 140.0, 79, gen=1)  # 80..117
    # 40 s later: a silent 300-step drop (to a state nobody counted)
    for r in range(3):
        run.train(r, 141.0, 200.0, 0, gen=2, ms0=0)
    run.finish(200.5)
    v = check_run(run.write(tmp_path / "r"))
    assert len([x for x in v if "went back from 117 to 1 " in x]) == 3, v
    assert not any("went back from 99 to 80" in x for x in v)  # the counted reset is fine


def test_2b_a_counted_reset_must_cover_the_whole_drop(tmp_path):
    run = Run()
    for r in range(3):
        run.train(r, 1.0, 400.0, 0)  # to step 399
    # state_lost says 20 steps were lost, but the replicas come back 320 steps lower
    run.events += [ev("state_lost", 401.0, r, 1, lost_step=99, restored_step=79, fatal=False) for r in range(3)]
    for r in range(3):
        run.train(r, 402.0, 450.0, 79, gen=1)
    run.finish(450.5)
    v = check_run(run.write(tmp_path / "r"))
    assert len([x for x in v if "went back from 399 to 80" in x and "counts only 99 -> 79" in x]) == 3, v


def test_3_every_replica_repeating_one_committed_step(tmp_path):
    run = Run()
    for r in range(3):
        last = run.train(r, 1.0, 101.0, 0)
        run.train(r, 101.0, 201.0, last - 1)  # goes back by exactly one: step 100 is committed twice
    run.finish(201.5)
    v = check_run(run.write(tmp_path / "r"))
    assert len([x for x in v if "went back from 100 to 100" in x or "committed manager_step 100 again" in x]) >= 3, v


@pytest.mark.parametrize("lost_step, holds", [(16, False), (21, True)])
def test_a_step_committed_again_by_a_later_incarnation_needs_a_reset_that_counts_it(tmp_path, lost_step, holds):
    """Seen in a run (a Lighthouse outage, then every replica killed): both replicas commit manager step 21, all
    die, the new incarnations restore the backstop of step 20 and commit 21 again. Their step records never go
    below 21, so only the commit events show the loss; the state_lost must count it (lost 21, not the 16 a stale
    Lighthouse knew)."""
    run = Run("diloco", replicas=2, h=5)
    for r in range(2):
        run.train(r, 1.0, 106.0, 0)  # 21 syncs
    run.events += [ev("state_lost", 108.0 + r * 0.1, r, 1, lost_step=lost_step, restored_step=20, fatal=False,
                      source="backstop/step-20") for r in range(2)]
    for r in range(2):
        run.train(r, 110.0, 150.0, 100, gen=1, ms0=20)  # from the backstop: manager step 21 again at 110 + 4
    run.finish(150.5)
    v = check_run(run.write(tmp_path / "r"))
    again = [x for x in v if "committed manager_step 21 again" in x and "(commit events)" in x]
    assert (not again) if holds else len(again) == 2, v


def test_4_diloco_one_sync_round_rolled_back(tmp_path):
    run = Run("diloco", h=5)
    for r in range(3):
        last = run.train(r, 1.0, 101.0, 0)  # 20 syncs
        run.train(r, 101.0, 201.0, last - 5)  # one whole round rolled back: manager step 20 -> 19
    run.finish(201.5)
    v = check_run(run.write(tmp_path / "r"))
    assert len([x for x in v if "from 20 to 19" in x]) == 3, v


def test_5_a_replica_that_trained_to_the_end_without_a_final_state(tmp_path):
    run = clean()
    run.finish(301.5, {0: (300, "d" * 64), 1: (300, "d" * 64)})
    v = check_run(run.write(tmp_path / "r"))
    assert any("no final state of replica(s) [2]" in x for x in v), v
    # ...but one that gave up is not expected
    run.events.append(ev("gave_up", 200.0, 2, reason="crash loop"))
    assert not any("final state" in x for x in check_run(run.write(tmp_path / "r2")))


def test_6_a_replica_that_ended_one_step_behind_with_other_weights(tmp_path):
    run = clean()
    run.finish(301.5, {0: (300, "d" * 64), 1: (300, "d" * 64), 2: (299, "e" * 64)})
    v = check_run(run.write(tmp_path / "r"))
    assert any("ended at different steps" in x and "replica 2 at 299" in x for x in v), v
    assert any("ended with different states" in x for x in v), v


def test_7_progress_stops_and_the_run_goes_on(tmp_path):
    run = Run()
    for r in range(3):
        run.train(r, 1.0, 61.0, 0)
    run.finish(400.0)
    (tmp_path / "r").mkdir()
    v = check_run(run.write(tmp_path / "r"))
    assert any("committed progress stopped 34" in x for x in v), v
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["max_stall_seconds"] == pytest.approx(340.0)
    assert s["time_below_n_seconds"] > 300  # silent replicas are down
    assert s["wall_seconds"] == pytest.approx(399.0)


def test_goodput_above_one_or_an_estimate_reported_as_measured(tmp_path):
    run = clean()
    assert any("above 1" in x for x in check_run(run.write(tmp_path / "a", goodput=1.2, goodput_is_estimate=False)))
    assert any("estimated" in x for x in check_run(run.write(tmp_path / "b", goodput=0.9, goodput_is_estimate=True)))
    s = compute_summary(run.events, run.metrics, replicas=3, replicas_consistent=True)
    assert s["goodput"] is None and s["goodput_estimate"] is not None  # an estimate never poses as goodput
    fast = compute_summary(run.events, run.metrics, replicas=3, replicas_consistent=True, baseline_rate=0.5)
    assert fast["goodput"] > 1.5  # not clamped: a baseline slower than the run shows


def test_open_recoveries_and_vulnerability_windows_are_counted(tmp_path):
    run = Run()
    for r in (0, 1):
        run.train(r, 1.0, 301.0, 0)
    run.train(2, 1.0, 101.0, 0)
    run.events += [ev("fault_injected", 100.5, 2, fault_kind="hang"), ev("failure_detected", 105.3, 2),
                   ev("restart_started", 105.4, 2)]  # never came back
    run.finish(301.5, {0: (300, "d" * 64), 1: (300, "d" * 64)})
    s = compute_summary(run.events, run.metrics, replicas=3, replicas_consistent=True)
    assert s["recoveries"] == 0 and s["recoveries_open"] == 1
    assert s["recovery_seconds"]["max"] == pytest.approx(301.5 - 100.5)
    vw = s["vulnerability_window_seconds"]
    assert vw["open"] == 1 and vw["max"] == pytest.approx(301.5 - 100.5)  # from the fault, not the restart


def test_bitflips_must_be_found_and_divergences_explained(tmp_path):
    run = clean()
    run.events[0]["vote_every"] = 10
    run.events.append(ev("bitflip_applied", 50.0, 1, manager_step=49, tensor="/model/w", bit=20))
    v = check_run(run.write(tmp_path / "a"))
    assert any("never found" in x for x in v), v
    healed = Run()
    healed.events, healed.metrics, healed.finals = list(run.events), run.metrics, run.finals
    healed.events.append(ev("heal_done", 51.0, 1, donor="replica_0:x", manager_step=50))
    assert check_run(healed.write(tmp_path / "a2")) == []  # a heal overwrote the flipped state first
    run.events.append(ev("state_diverged", 52.0, None, replicas=[1], manager_step=50, action="heal"))
    assert check_run(run.write(tmp_path / "b")) == []
    run.events.append(ev("state_diverged", 90.0, None, replicas=[0], manager_step=90, action="heal"))
    assert any("no injected bitflip" in x for x in check_run(run.write(tmp_path / "c")))
    late = clean()
    late.events[0]["vote_every"] = 10
    late.events += [ev("bitflip_applied", 50.0, 1, manager_step=49),
                    ev("state_diverged", 80.0, None, replicas=[1], manager_step=80, action="heal")]
    assert any("more than 10 commits later" in x for x in check_run(late.write(tmp_path / "d")))


def test_vote_decisions():
    assert decide(10, {0: "a", 1: "a", 2: "a"}).agreed
    heal = decide(10, {0: "a", 1: "b", 2: "a"})
    assert (heal.diverged, heal.action, heal.majority) == ([1], "heal", "a")
    two = decide(10, {0: "a", 1: "b"})
    assert (two.diverged, two.action) == ([0, 1], "backstop")
    assert decide(10, {0: "a", 1: "b", 2: "c"}).action == "backstop"


def test_votes_wait_for_a_majority_of_the_run():
    from regent.orchestrate.vote import StateVotes

    votes = StateVotes(3, wait_s=30)
    votes.add(4, 0, 0, 1, "a", 0, now=0.0)
    votes.add(4, 2, 0, 1, "b", 0, now=0.1)
    # replica 1 is live but has not reported: two that differ are no majority; wait for it
    assert votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=1.0) == []
    votes.add(4, 1, 0, 1, "a", 0, now=2.0)
    (v,) = votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=2.0)
    assert (v.diverged, v.action, v.generations[2]) == ([2], "heal", 0)
    # a late digest of a decided step is compared with its majority
    late = votes.add(4, 2, 0, 1, "c", 3, now=3.0)
    assert late is not None and late.late and late.diverged == [2]
    # a tie that a live replica's missing ballot could break, but not in time, is left undecided
    votes.add(8, 0, 0, 1, "a", 0, now=10.0)
    votes.add(8, 2, 0, 1, "b", 0, now=10.0)
    assert votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=20.0) == []
    (u,) = votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=41.0)
    assert u.undecided and not u.agreed and u.diverged == []


def test_a_tie_while_the_third_replica_restarts_is_decided_at_once():
    """The restarting replica holds no state of the step: whatever it holds next it copies from one of the two,
    so it can never break the tie. Left open, a soak had it (and then the other tied replica) heal from the
    flipped one before the next vote, and the flip was agreed on from then on."""
    from regent.orchestrate.vote import StateVotes

    votes = StateVotes(3, wait_s=30)
    votes.add(100, 0, 0, 1, "flipped", 0, now=0.0)
    votes.add(100, 2, 0, 1, "good", 0, now=0.1)
    (b,) = votes.due(live={0, 2}, expected={0, 1, 2}, now=0.2)
    assert (b.action, b.diverged, b.undecided) == ("backstop", [0, 2], False)
    # with a majority among the live ones, the heal does not wait for the restarting replica either
    four = StateVotes(4, wait_s=30)
    for r, d in ((0, "x"), (1, "y"), (2, "y")):
        four.add(104, r, 0, 1, d, 0, now=1.0)
    (h,) = four.due(live={0, 1, 2}, expected={0, 1, 2, 3}, now=1.1)
    assert (h.action, h.diverged) == ("heal", [0])

    # with only two replicas in the run, a tie is a backstop restore
    two = StateVotes(2)
    two.add(5, 0, 0, 2, "a0", 0, now=0.0)
    two.add(5, 0, 1, 2, "a1", 0, now=0.0)
    two.add(5, 1, 0, 2, "a0", 0, now=0.0)
    assert two.due(live={0, 1}, expected={0, 1}, now=0.0) == []  # replica 1's rank 1 not in yet
    two.add(5, 1, 1, 2, "x1", 0, now=0.1)
    (b,) = two.due(live={0, 1}, expected={0, 1}, now=0.2)
    assert b.action == "backstop" and b.diverged == [0, 1]


def test_a_baseline_of_another_config_is_refused_before_launch(tmp_path):
    import dataclasses

    from regent.orchestrate.commands import parse_train_argv
    from regent.orchestrate.config import ConfigError
    from regent.orchestrate.preflight import baseline_mismatches, check_baseline

    base = parse_train_argv(["--replicas", "3", "--procs-per-replica", "1", "--ft.mode", "ddp",
                             "--run-dir", str(tmp_path / "base")])
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "metrics.jsonl").write_text("")
    (tmp_path / "base" / "config.json").write_text(json.dumps(dataclasses.asdict(base), default=str))
    same = parse_train_argv(["--replicas", "3", "--procs-per-replica", "1", "--ft.mode", "ddp",
                             "--baseline", str(tmp_path / "base"), "--run-dir", str(tmp_path / "r")])
    check_baseline(same)  # same model, replicas, mode and batch: accepted
    other = parse_train_argv(["--replicas", "3", "--procs-per-replica", "1", "--ft.mode", "diloco",
                              "--train.batch-size", "8", "--baseline", str(tmp_path / "base"),
                              "--run-dir", str(tmp_path / "r2")])
    with pytest.raises(ConfigError, match="ft.mode: 'diloco' here, 'ddp' in the baseline"):
        check_baseline(other)
    assert len(baseline_mismatches(dataclasses.asdict(other), dataclasses.asdict(base))) == 2
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("")  # a run directory without its config.json
    missing = parse_train_argv(["--baseline", str(tmp_path / "old"), "--run-dir", str(tmp_path / "r3")])
    with pytest.raises(ConfigError, match="cannot read its config.json"):
        check_baseline(missing)


def test_votes_say_which_parts_differ_and_forget_a_reset_lineage():
    from regent.orchestrate.vote import StateVotes

    votes = StateVotes(3)
    ok = {"/trainer/model": "m", "/trainer/data": "d"}
    for r in range(3):
        votes.add(10, r, 0, 1, "a" if r != 1 else "b", 0, now=0.0,
                  parts=ok if r != 1 else {**ok, "/trainer/data": "x"})
    (v,) = votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=0.0)
    assert v.diverged == [1] and v.differs == {1: ["rank 0 /trainer/data"]}
    # the run went back to committed step 5 (a backstop restore): step 10 is committed again by a new history
    votes.forget_after(5)
    assert votes.add(10, 2, 0, 1, "c", 1, now=1.0) is None  # not judged by the old lineage's majority
    for r in (0, 1):
        votes.add(10, r, 0, 1, "c", 1, now=1.0)
    (again,) = votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=1.0)
    assert again.agreed


def test_default_vote_interval_is_at_least_every_thirty_steps_in_commits():
    from regent.ft.config import FTConfig

    assert FTConfig(mode="ddp").vote_interval() == 30
    assert FTConfig(mode="diloco", sync_every=20).vote_interval() == 1
    assert FTConfig(mode="diloco", sync_every=50).vote_interval() == 1
    assert FTConfig(mode="diloco", sync_every=7).vote_interval() == 4
    assert FTConfig(mode="diloco", sync_every=5).vote_interval() == 6
    assert FTConfig(mode="diloco", sync_every=20, fragments=4).vote_interval() == 6
    assert FTConfig(mode="ddp", vote_every=0).vote_interval() == 0


def test_a_copy_is_no_witness():
    """Replica 0 flipped a bit, replica 1 healed from it before the vote: 0 and 1 agree, 2 differs. Counted as
    two witnesses they would heal the correct replica away; as one (a copy and its origin) it is a tie."""
    from regent.orchestrate.vote import StateVotes, decide, origins

    assert decide(30, {0: "x", 1: "x", 2: "y"}).diverged == [2]  # no heals known: 2 is the odd one
    tie = decide(30, {0: "x", 1: "x", 2: "y"}, copied_from={1: 0})
    assert tie.action == "backstop"
    # the copy was taken before its origin flipped: they differ, so each is a witness again
    heal = decide(30, {0: "x", 1: "y", 2: "y"}, copied_from={1: 0})
    assert (heal.action, heal.diverged) == ("heal", [0])
    assert origins([0, 1, 2], [(1, 0), (2, 1)]) == {0: 0, 1: 0, 2: 0}  # 2 copied 1 after 1 copied 0
    # 2 copied 0, and only then 0 copied 1: 2 holds 0's old state (soak: the chain made all three one witness)
    assert origins([0, 1, 2], [(2, 0), (0, 1)]) == {0: 1, 1: 1, 2: 0}
    assert decide(90, {0: "x", 1: "x", 2: "y"}, [(2, 0), (0, 1)]).action == "backstop"
    # copies both ways within one window (DiLoCo soak): one witness, not two
    assert origins([0, 1, 2], [(1, 0), (0, 1)]) == {0: 0, 1: 0, 2: 2}
    votes = StateVotes(3)
    votes.note_heal(1, 0, 25)  # between the votes of steps 0 and 30
    votes.note_heal(2, 0, 31)  # after the vote of step 30: no copy for it
    for r, d in ((0, "x"), (1, "x"), (2, "y")):
        votes.add(30, r, 0, 1, d, 0, now=0.0)
    (v,) = votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=0.0)
    assert v.action == "backstop" and v.diverged == [0, 1, 2]


def _vote_round(votes, step, held: dict[int, list[str]]) -> list:
    for r, ranks in held.items():
        for rank, d in enumerate(ranks):
            votes.add(step, r, rank, len(ranks), d, 0, now=0.0)
    return votes.due(live={0, 1, 2}, expected={0, 1, 2}, now=0.0)


def test_a_copy_of_the_state_its_step_vouched_for_is_a_witness():
    """The soak of 2026-12-05 15:31 UTC (16-core host): replica 0 healed from replica 1 at committed step 97,
    then a bit flipped on replica 2. At step 98 replicas 0 and 1 agreed and 2 differed, but 0 held a copy of 1, so
    it was a tie and the backstop was restored (a counted lineage reset). The healer's every rank digests what it
    copied (`heal_digest`): when that is the state the vote of step 97 decided, the copy is a witness and the
    flipped replica is healed instead. A copy that differs from that vote, or is not digested by every rank,
    stays a copy."""
    from regent.orchestrate.vote import StateVotes

    def run(heal_digests: list[str]):
        votes = StateVotes(3)
        assert _vote_round(votes, 96, {0: ["a0", "a1"], 1: ["a0", "a1"], 2: ["a0", "a1"]})[0].agreed
        votes.note_heal(0, 1, 97, generation=15)
        for rank, d in enumerate(heal_digests):
            votes.note_heal_digest(0, 15, 97, rank, 2, d)
        (v97,) = _vote_round(votes, 97, {1: ["b0", "b1"], 2: ["b0", "b1"]})  # 0 healed to 97: no ballot of its own
        assert v97.agreed
        (v98,) = _vote_round(votes, 98, {0: ["c0", "c1"], 1: ["c0", "c1"], 2: ["c0", "flipped"]})
        return v98

    verified = run(["b0", "b1"])
    assert (verified.action, verified.diverged) == ("heal", [2])
    assert run(["b0", "flipped"]).action == "backstop"  # it copied something else than step 97's vouched state
    assert run(["b0"]).action == "backstop"  # one rank's digest is missing
    # a heal at a quorum (heal_done, undigested) to the vote's step: the donor may have flipped after its ballot
    undigested = StateVotes(3)
    assert _vote_round(undigested, 97, {0: ["b0", "b1"], 1: ["b0", "b1"], 2: ["b0", "b1"]})[0].agreed
    undigested.note_heal(0, 1, 97, generation=15)
    assert undigested.copies(98) == [(0, 1)]
    votes = StateVotes(3)  # no vote at the step it copied: nothing to verify against
    votes.note_heal(0, 1, 97, generation=15)
    votes.note_heal_digest(0, 15, 97, 0, 1, "b")
    assert not votes.verified(0, 15, 97)
    assert votes.copies(98) == [(0, 1)]


def test_per_step_mode_votes_at_the_first_commit_of_a_new_quorum():
    """Per-step mode: a heal copies a donor's live state at a step with no vote; voted on only at the next
    multiple of `vote_every`, a flip on the third replica in between tied the copy and its donor against it (the
    backstop, a lineage reset). Every member of the new quorum the healer joins now votes at its first commit
    (`vote_due`): the copy is judged against the replica that took no part in it, and from then on it is a
    witness, so the later flip is one ballot against two and is healed."""
    from regent.orchestrate.session import vote_due
    from regent.orchestrate.vote import StateVotes

    assert vote_due(30, 30, new_quorum=False, voted_step=None, at_boundary=True)
    assert not vote_due(31, 30, new_quorum=False, voted_step=30, at_boundary=True)
    assert vote_due(31, 30, new_quorum=True, voted_step=30, at_boundary=True)  # the quorum changed
    assert not vote_due(31, 30, new_quorum=True, voted_step=31, at_boundary=True)  # voted already
    assert not vote_due(31, 0, new_quorum=True, voted_step=None, at_boundary=True)  # votes are off
    assert not vote_due(30, 30, new_quorum=True, voted_step=None, at_boundary=False)  # mid-round (DiLoCo)

    def run(vote_at_join: bool):
        votes = StateVotes(3)
        assert _vote_round(votes, 30, {0: ["a"], 1: ["a"], 2: ["a"]})[0].agreed
        votes.note_heal(0, 1, 41, generation=2)  # 0 restarted and copied 1's live state at step 41
        if vote_at_join:  # the three commit step 42 in the quorum 0 joined, and vote there
            assert _vote_round(votes, 42, {0: ["b"], 1: ["b"], 2: ["b"]})[0].agreed
        # a bit flips on replica 2 at step 50; the vote of step 60 finds it
        (v60,) = _vote_round(votes, 60, {0: ["c"], 1: ["c"], 2: ["flipped"]})
        return v60

    assert run(vote_at_join=False).action == "backstop"  # the tie this closes: 0 and 1 are one ballot
    healed = run(vote_at_join=True)
    assert (healed.action, healed.diverged) == ("heal", [2])


def _witness(votes, step, held: dict[int, list[str]]) -> None:
    for r, ranks in held.items():
        for rank, d in enumerate(ranks):
            votes.add_witness(step, r, rank, len(ranks), d)


def test_a_copy_at_a_step_with_no_vote_is_checked_by_the_holders():
    """The 3 x 2 soak of 2026-12-06 (5-step rounds, a vote every 30 steps): replica 0 copied replica 1's committed
    step 151, where no vote ran, then a bit flipped on replica 2. At the vote of step 156 replicas 0 and 1 agreed,
    but 0 held an unchecked copy of 1: one ballot against 2's, a tie, and every replica restored the backstop (a
    counted lineage reset). Now the holders digest their committed state of 151 when asked (`witness_digest`):
    two of them agreeing with the healer's digest of its copy make the copy a witness, and 2 is healed instead.
    One holder alone (the donor only shows the copy is faithful) or holders with no majority do not."""
    from regent.orchestrate.vote import StateVotes

    def run(witnesses: dict[int, list[str]], heal=("b0", "b1"), other_heal=None):
        votes = StateVotes(3)
        assert _vote_round(votes, 150, {0: ["a0", "a1"], 1: ["a0", "a1"], 2: ["a0", "a1"]})[0].agreed
        if other_heal is not None:  # replica 2 itself copied replica 1 at 150 (after that vote's ballots)
            votes.note_heal(2, 1, other_heal, generation=4)
        votes.note_heal(0, 1, 151, generation=15)
        votes.open_check(0, 15, 151, asked={1, 2}, now=0.0)
        for rank, d in enumerate(heal):
            votes.note_heal_digest(0, 15, 151, rank, 2, d)
        _witness(votes, 151, witnesses)
        checks = votes.checks_due(now=0.0)
        if other_heal is not None:
            return votes.verified(0, 15, 151), checks
        (v156,) = _vote_round(votes, 156, {0: ["c0", "c1"], 1: ["c0", "c1"], 2: ["c0", "flipped"]})
        return v156, checks

    v, checks = run({1: ["b0", "b1"], 2: ["b0", "b1"]})
    assert (v.action, v.diverged) == ("heal", [2])
    assert [(c["replica"], c["manager_step"], c["verified"], c["answered"]) for c in checks] == [(0, 151, True, [1, 2])]
    assert run({1: ["b0", "b1"]})[0].action == "backstop"  # only the donor answered: still open, not verified
    assert run({1: ["b0", "b1"], 2: ["x0", "b1"]})[0].action == "backstop"  # the holders disagree
    assert run({1: ["b0", "b1"], 2: ["b0"]})[0].action == "backstop"  # one rank of replica 2 did not answer
    assert run({1: ["b0", "b1"], 2: ["b0", "b1"]}, heal=("b0", "x1"))[0].action == "backstop"  # not a faithful copy
    # replica 2 holds a copy of 1 made at 150 (after that vote's ballots, unchecked): the two are one ballot, as
    # in a vote. When they agree, every live replica holds what 0 copied (no correct replica is left to outvote):
    # verified, as a vote of step 151 would have; when they differ, neither is a majority
    assert run({1: ["b0", "b1"], 2: ["b0", "b1"]}, other_heal=150)[0] is True
    assert run({1: ["b0", "b1"], 2: ["x0", "b1"]}, other_heal=150)[0] is False


def test_a_copy_check_is_reported_once_when_it_ends():
    """`checks_due` reports a check once: verified as soon as it is, unverified once every holder asked has
    answered or `wait_s` passed (a holder that committed a newer step before it was asked cannot answer)."""
    from regent.orchestrate.vote import StateVotes

    votes = StateVotes(3, wait_s=30.0)
    votes.note_heal(0, 1, 7, generation=3)
    votes.note_heal_digest(0, 3, 7, 0, 1, "s")
    votes.open_check(0, 3, 7, asked={1, 2}, now=100.0)
    _witness(votes, 7, {1: ["s"]})
    assert votes.checks_due(now=101.0) == []  # replica 2 may still answer
    (late,) = votes.checks_due(now=130.0)
    assert (late["verified"], late["answered"], late["heal_digested"]) == (False, [1], True)
    assert votes.checks_due(now=200.0) == []  # reported once
    votes.note_heal(2, 1, 9, generation=8)
    votes.open_check(2, 8, 9, asked={0, 1}, now=300.0)
    _witness(votes, 9, {0: ["t"], 1: ["u"]})
    (split,) = votes.checks_due(now=301.0)  # both answered, and they differ: ended, not verified
    assert (split["verified"], split["answered"], split["heal_digested"]) == (False, [0, 1], False)
    # a holder that moved past the step says so at once: the check ends then, not `wait_s` later
    votes.note_heal(1, 0, 11, generation=5)
    votes.note_heal_digest(1, 5, 11, 0, 1, "v")
    votes.open_check(1, 5, 11, asked={0, 2}, now=400.0)
    _witness(votes, 11, {0: ["v"]})
    assert votes.checks_due(now=401.0) == []
    votes.decline_witness(11, 2)
    (declined,) = votes.checks_due(now=401.5)
    assert (declined["verified"], declined["answered"], declined["declined"]) == (False, [0], [2])
    votes.forget_after(5)  # a lineage reset to step 5: the copies of the old history cannot be checked any more
    votes.note_heal_digest(2, 8, 9, 0, 1, "t")
    _witness(votes, 9, {0: ["t"]})
    assert not votes.verified(2, 8, 9)


def test_a_holder_asked_about_a_step_answers_waits_or_declines():
    """A DiLoCo holder with no state of the asked step (neither its boundary state nor a kept digest) waits when it
    has not reached the step yet (still in that sync) and declines when it moved past it."""
    from regent.orchestrate.session import witness_answer

    assert witness_answer(12, held_step=11, current_step=11) == "wait"  # still in step 12's sync
    assert witness_answer(12, held_step=13, current_step=13) == "decline"  # committed 13: 12 is gone
    assert witness_answer(12, held_step=None, current_step=12) == "wait"  # between two boundary states
    assert witness_answer(12, held_step=None, current_step=13) == "decline"


def test_a_flip_copied_by_a_heal_lives_on_in_the_healer(tmp_path):
    """The flipped replica's state is copied by a heal before its own failure throws its copy away: the flip
    lives on in the healer. Found there later: explained (not "no injected bitflip"). Copied to every replica and
    never found: caught (soak of 2026-12-04 20:00 UTC, DiLoCo at step 98)."""
    run = clean()
    run.events[0]["vote_every"] = 10
    run.events += [ev("bitflip_applied", 50.0, 0, manager_step=49, tensor="/model/w", bit=20),
                   ev("heal_done", 51.0, 1, donor="replica_0:x", manager_step=50),
                   ev("failure_detected", 52.0, 0, error="killed"),
                   ev("early_heal_done", 53.0, 0, donor="replica_2:y", manager_step=50)]
    found = Run()
    found.events, found.metrics, found.finals = list(run.events), run.metrics, run.finals
    found.events.append(ev("state_diverged", 55.0, None, replicas=[1], manager_step=52, action="heal"))
    assert check_run(found.write(tmp_path / "f")) == []
    spread = Run()
    spread.events, spread.metrics, spread.finals = list(run.events), run.metrics, run.finals
    spread.events += [ev("failure_detected", 54.0, 2, error="killed"),
                      ev("early_heal_done", 54.5, 2, donor="replica_1:z", manager_step=51),
                      ev("failure_detected", 56.0, 0, error="killed"),
                      ev("early_heal_done", 56.5, 0, donor="replica_1:z", manager_step=52)]
    assert any("never found" in x for x in check_run(spread.write(tmp_path / "s")))


def test_a_flip_saved_in_a_backstop_comes_back_with_its_restore(tmp_path):
    """A carrier writes the backstop before its flip is found; every replica dies and restores that backstop: the
    flip is back in all of them. The checker follows it there (a restore used to count as throwing it away)."""
    run = clean()
    run.events[0]["vote_every"] = 10
    run.events += [ev("bitflip_applied", 50.0, 0, manager_step=49, tensor="/model/w", bit=20),
                   ev("backstop_saved", 50.5, 0, manager_step=50, path="backstop/step-00000050")]
    run.events += [ev("failure_detected", 51.0 + r, r, error="killed") for r in range(3)]
    back = Run()
    back.events, back.metrics, back.finals = list(run.events), run.metrics, run.finals
    back.events += [ev("state_lost", 55.0 + r, r, generation=1, cause="backstop_restore", restored_step=50,
                       lost_step=53) for r in range(3)]
    assert any("never found" in x for x in check_run(back.write(tmp_path / "b")))
    older = Run()  # an older, vouched backstop: the flip is gone
    older.events, older.metrics, older.finals = list(run.events), run.metrics, run.finals
    older.events += [ev("state_lost", 55.0 + r, r, generation=1, cause="backstop_restore", restored_step=40,
                        lost_step=53) for r in range(3)]
    assert check_run(older.write(tmp_path / "o")) == []
