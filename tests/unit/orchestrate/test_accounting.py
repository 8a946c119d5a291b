"""Honest accounting (summary.json), run invariants and the progress plot, on small synthetic runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from regent.orchestrate.invariants import check_run, main
from regent.orchestrate.live import RunView
from regent.orchestrate.report import _mark_faults, write_report
from regent.orchestrate.summary import (
    compute_summary,
    missed_first_syncs,
    progress_drops,
    recovery_breakdowns,
)


def ev(kind: str, t: float, replica: int | None = None, generation: int | None = 0, **kw: Any) -> dict[str, Any]:
    """An event as events.jsonl holds it (plain dicts: the newest kinds need not be registered yet)."""
    return {"time": t, "kind": kind, "replica": replica, "generation": generation, "quorum_id": None,
            "step": None, **kw}


def rec(t: float, replica: int, step: int, *, gen: int = 0, manager_step: int | None = None,
        committed: bool = True) -> dict[str, Any]:
    return {"time": float(t), "replica": replica, "generation": gen, "step": step,
            "manager_step": step if manager_step is None else manager_step, "committed": committed,
            "loss": 5.0 - step * 0.01, "quorum_id": 1}


def all_down_run(with_state_lost: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two replicas train to step 50, both die, and come back from a backstop checkpoint at step 20."""
    events = [ev("run_started", 0.0, generation=None, mode="ddp")]
    metrics = [rec(t, r, t) for t in range(1, 51) for r in (0, 1)]
    for r in (0, 1):
        events += [
            ev("fault_injected", 50.5, r, fault_kind="node", step=50),
            ev("failure_detected", 51.0, r),
            ev("restart_started", 51.1, r),
            ev("restart_done", 55.0, r, generation=1, seconds=3.9),
        ]
        if with_state_lost:
            events.append(ev("state_lost", 56.0 + r, r, generation=1, lost_step=50, restored_step=20,
                             source="/ckpt/step-20", reason="no live replica held step 50", fatal=False))
        events.append(ev("commit", 57.0, r, generation=1, committed=True, manager_step=21, step=21))
    metrics += [rec(t, r, t - 36, gen=1) for t in range(57, 101) for r in (0, 1)]
    events.append(ev("run_finished", 101.0, generation=None))
    return events, metrics


def write_run(tmp_path: Path, events: list[dict[str, Any]], metrics: list[dict[str, Any]], **summary: Any) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, rows in (("events.jsonl", events), ("metrics.jsonl", metrics)):
        (tmp_path / name).write_text("".join(json.dumps(x) + "\n" for x in rows))
    # every replica compared at the end, at its last step, with one state (the checker expects every one)
    last = {m["replica"]: m["step"] for m in sorted(metrics, key=lambda m: m["time"])}
    finals = [{"replica": r, "step": step, "digest": "d" * 64} for r, step in sorted(last.items())]
    s = compute_summary(events, metrics, replicas=summary.get("replicas", 2), replicas_consistent=True,
                        baseline_rate=1.0, final_states=summary.get("final_states", finals))
    s["final_states"] = finals
    s.update(summary)
    (tmp_path / "summary.json").write_text(json.dumps(s))
    return tmp_path


def test_reset_with_state_lost_is_counted_and_costs_goodput():
    events, metrics = all_down_run(with_state_lost=True)
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True, baseline_rate=1.0,
                        baseline_dir="/runs/base")
    assert s["lineage_resets"] == 1 and s["lineage_resets_undetected"] == 0
    assert s["full_restarts"] == 1
    assert s["full_restart_causes"] == [{"time": pytest.approx(55.0), "cause": "state_lost"}]
    assert s["steps_lost_reset"] == 2 * (50 - 20)
    assert s["steps_lost_uncommitted"] == 0 and s["steps_lost"] == 60
    assert s["global_committed_step"] == 64
    assert s["replica_steps_useful"] == 2 * 64
    # 188 committed records, but only 128 replica-steps are in the model; fault-free: 1 step/s x 2 x 100 s (the
    # figures run from the first step to the end of training, run_finished at 101, not to the last record)
    assert s["goodput"] == pytest.approx(128 / 200)
    assert s["goodput"] < s["replica_steps_committed"] / 200 < 1
    # the old high (50) is passed again at t=87: the stall lasts from t=50 until then
    assert s["max_stall_seconds"] == pytest.approx(37.0) and s["max_stall_at"] == pytest.approx(49.0)
    assert s["goodput_basis"] == "baseline run /runs/base: 1 steps/s" and s["goodput_is_estimate"] is False
    for key in ("steps_lost", "lineage_resets", "lineage_resets_undetected", "full_restarts", "gave_up",
                "max_stall_seconds", "time_below_n_seconds", "vulnerability_window_seconds", "goodput"):
        assert s["how"][key].endswith(".")


def test_reset_without_state_lost_is_flagged(tmp_path):
    events, metrics = all_down_run(with_state_lost=False)
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True, baseline_rate=1.0)
    assert s["lineage_resets"] == 0 and s["lineage_resets_undetected"] == 1
    assert s["full_restarts"] == 0
    assert s["steps_lost_reset"] == 60  # thrown away all the same
    assert s["goodput"] == pytest.approx(128 / 200)
    # detectable from metrics alone
    (drop,) = progress_drops(metrics)
    assert (drop["from"], drop["to"], drop["time"]) == (50, 21, 57.0)
    violations = check_run(write_run(tmp_path, events, metrics))
    # per replica now: each of the two went back, and neither drop is counted
    assert len(violations) == 2 and all("went back from 50 to 21" in v and "no state_lost" in v for v in violations)


def test_counted_reset_is_no_violation(tmp_path):
    events, metrics = all_down_run(with_state_lost=True)
    assert check_run(write_run(tmp_path, events, metrics)) == []
    # ...unless summary.json does not count it (run.py zeroing full_restarts, say)
    (tmp_path / "summary.json").write_text(json.dumps({"lineage_resets": 1, "full_restarts": 0}))
    assert any("fewer than the 1 lineage resets" in v for v in check_run(tmp_path))


def test_single_replica_restart_that_heals_is_not_a_reset(tmp_path):
    events = [ev("run_started", 0.0, generation=None, mode="ddp"),
              ev("fault_injected", 30.0, 0, fault_kind="kill", step=30),
              ev("failure_detected", 30.2, 0), ev("restart_started", 30.3, 0),
              ev("restart_done", 32.0, 0, generation=1, seconds=1.7),
              ev("heal_done", 35.0, 0, generation=1, donor=1)]
    metrics = [rec(t, r, t) for t in range(1, 61) for r in (1, 2)]
    metrics += [rec(t, 0, t) for t in range(1, 31)]
    # the restarted replica's first committed step is after its heal, at the others' step
    metrics += [rec(t, 0, t, gen=1) for t in range(36, 61)]
    s = compute_summary(events, metrics, replicas=3, replicas_consistent=True)
    assert s["lineage_resets"] == 0 and s["lineage_resets_undetected"] == 0
    assert s["steps_lost_reset"] == 0 and s["full_restarts"] == 0
    assert s["max_stall_seconds"] == pytest.approx(1.0)
    assert check_run(write_run(tmp_path / "a", events, metrics, replicas=3)) == []
    # one that committed steps of its own from scratch before healing forked the run: flagged
    forked = metrics + [rec(33, 0, 1, gen=1), rec(34, 0, 2, gen=1)]
    assert any("replica 0" in v and "went back from 30 to 1" in v
               for v in check_run(write_run(tmp_path / "b", events, forked, replicas=3)))


def test_diloco_failed_sync_loses_its_window_but_is_no_reset():
    """DiLoCo: trainer step keeps counting through a failed sync; manager_step (syncs) does not move."""
    h = 5
    events = [ev("run_started", 0.0, generation=None, mode="diloco")]
    metrics = []
    manager = 0
    for step in range(1, 31):
        for r in (0, 1):
            metrics.append(rec(step, r, step, manager_step=manager))
        if step % h == 0:
            ok = step != 15  # the sync at step 15 fails for everyone
            for r in (0, 1):
                events.append(ev("commit", step + 0.5, r, committed=ok, step=step, manager_step=manager + ok))
            manager += ok
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True, baseline_rate=1.0)
    assert s["progress_key"] == "manager_step"
    assert s["steps_lost_uncommitted"] == 2 * h and s["steps_lost_reset"] == 0
    assert s["lineage_resets_undetected"] == 0
    assert s["max_stall_seconds"] == pytest.approx(10.0)  # syncs at steps 10 and 20: manager_step 2 -> 3
    assert s["replica_steps_useful"] == 60 - 2 * h


def test_a_round_given_up_by_a_replica_left_out_of_a_sync_is_lost():
    """DiLoCo with late members left out (`--lighthouse.late-member-ms`): replica 1 was paused at the sync of step
    10, the others committed it without it, and it gave its round up (`round_abandoned`, its 5 inner steps) and
    pulled the committed state. Its records of that round exist (the trainer wrote them) but no sync averaged
    them: they are lost, not useful, and counted once."""
    h = 5
    events = [ev("run_started", 0.0, generation=None, mode="diloco")]
    metrics = []
    for step in range(1, 21):
        for r in (0, 1):
            metrics.append(rec(step, r, step, manager_step=step // h))
        if step % h == 0:
            for r in (0, 1):
                if not (step == 10 and r == 1):
                    events.append(ev("commit", step + 0.5, r, committed=True, step=step, manager_step=step // h))
    events.append(ev("round_abandoned", 10.8, 1, step=10, inner_steps=h, behind_at=1, how="early", manager_step=2))
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True, baseline_rate=1.0)
    assert s["rounds_abandoned"] == {"rounds": 1, "inner_steps": h}
    assert s["steps_lost_uncommitted"] == h and s["steps_lost_reset"] == 0 and s["lineage_resets"] == 0
    assert s["replica_steps_useful"] == 40 - h
    assert s["how"]["rounds_abandoned"].endswith(".")


def test_diloco_rounds_given_back_each_lose_the_round_once(tmp_path):
    """Plain DiLoCo gives a failed round back and trains it again (the trainer step goes back to the round's
    first step): two failed syncs of the same round each lose that round's steps, not the first the round and
    the second nothing; and the trainer step going back is no loss of committed progress."""
    h = 5
    events = [ev("run_started", 0.0, generation=None, mode="diloco")]
    metrics = []
    manager, t = 0, 0.0
    for ok_round, first in ((True, 1), (True, 6), (False, 11), (False, 11), (True, 11), (True, 16)):
        for step in range(first, first + h):
            t += 1.0
            for r in (0, 1):
                metrics.append(rec(t, r, step, manager_step=manager))
        for r in (0, 1):
            events.append(ev("commit", t + 0.5, r, committed=ok_round, step=first + h - 1,
                             manager_step=manager + ok_round))
        manager += ok_round
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True, baseline_rate=1.0)
    assert s["steps_lost_uncommitted"] == 2 * 2 * h and s["steps_lost_reset"] == 0
    assert s["lineage_resets_undetected"] == 0
    assert check_run(write_run(tmp_path / "a", events, metrics, replicas=2)) == []


def test_time_below_n_and_vulnerability_window():
    events = [ev("run_started", 0.0, generation=None, mode="diloco"),
              ev("fault_injected", 9.0, 0, fault_kind="kill"), ev("failure_detected", 9.5, 0),
              ev("restart_started", 10.0, 0), ev("restart_done", 12.0, 0, generation=1, seconds=2.0),
              ev("early_heal_done", 13.0, 0, generation=1, donor=1, seconds=0.4, manager_step=9),
              ev("failure_detected", 20.0, 1), ev("restart_started", 20.5, 1),
              ev("restart_done", 21.0, 1, generation=1, seconds=0.5),
              ev("heal_done", 22.0, 1, generation=0),  # an older generation's: not this restart's
              ev("commit", 24.5, 1, generation=1, committed=False),
              ev("commit", 25.0, 1, generation=1, committed=True)]
    metrics = [rec(t, 0, t) for t in range(0, 10)] + [rec(t, 0, t) for t in range(14, 31)]
    metrics += [rec(t, 1, t) for t in range(0, 20)] + [rec(t, 1, t) for t in range(26, 31)]
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True)
    # replica 0 down 9.5 (detected) -> 14, replica 1 down 20 -> 26
    assert s["time_below_n_seconds"] == pytest.approx(4.5 + 6.0)
    # from the fault (9.0, else the detection: 20.0) until it holds the committed state: replica 0 pulled the
    # global state at 13.0 (DiLoCo), replica 1 first committed at 25.0
    assert s["vulnerability_window_seconds"] == {"p50": pytest.approx(4.5), "max": pytest.approx(5.0), "n": 2,
                                                 "open": 0}


def test_max_stall():
    metrics = [rec(t, r, min(t, 20) if t < 32 else t - 11) for t in range(1, 41) for r in (0, 1)]
    s = compute_summary([], metrics, replicas=2, replicas_consistent=None)
    assert s["max_stall_seconds"] == pytest.approx(12.0)  # at 20 from t=20, 21 only at t=32
    assert s["max_stall_at"] == pytest.approx(19.0)


def test_goodput_basis_says_when_it_is_an_estimate():
    metrics = [rec(t, r, t) for t in range(1, 41) for r in (0, 1)]
    s = compute_summary([], metrics, replicas=2, replicas_consistent=None)
    assert s["goodput_is_estimate"] is True
    assert s["goodput_basis"].startswith("ESTIMATE from this run's pace before its first fault")
    assert "1 steps/s" in s["goodput_basis"]
    # not clamped: the estimate's pace (after the warm-up fifth) is a little faster than the whole run's
    assert s["goodput"] is None and s["goodput_estimate"] == pytest.approx(80 / 78)
    base = compute_summary([], metrics, replicas=2, replicas_consistent=None, baseline_rate=2.0)
    assert base["goodput_basis"] == "baseline run: 2 steps/s" and base["goodput"] == pytest.approx(80 / 156)
    none = compute_summary([], metrics[:4], replicas=2, replicas_consistent=None)
    assert none["goodput"] is None and none["goodput_estimate"] is None
    assert "no fault-free pace" in none["goodput_basis"]


def test_invariants_states_processes_memory(tmp_path, capsys):
    events, metrics = all_down_run(with_state_lost=True)
    for m in metrics:  # replica 1 balloons in the last part of the run
        m["rss_mb"] = 1000.0 if m["replica"] == 1 and m["time"] > 80 else 300.0
    finals = [{"replica": 0, "step": 64, "hash": "aaaa"}, {"replica": 1, "step": 64, "hash": "bbbb"},
              {"replica": 2, "step": None, "hash": None}]
    run = write_run(tmp_path, events, metrics, final_states=finals, leaked_pids=[123], processes_at_end=2)
    violations = check_run(run)
    assert any("ended with different states" in v for v in violations)
    assert any("pids [123]" in v for v in violations)
    assert any("still running at the end" in v for v in violations)
    assert [v for v in violations if "memory" in v] == [violations[-1]] and "replica 1" in violations[-1]
    assert main([str(run)]) == 1
    assert capsys.readouterr().out.count("VIOLATION") == 4
    run2 = write_run(tmp_path / "clean", [events[0], ev("run_finished", 6.0, generation=None)], metrics[:10],
                     leaked_pids=[])
    assert main([str(run2)]) == 0


def test_report_draws_progress_and_fault_lines(tmp_path):
    events, metrics = all_down_run(with_state_lost=True)
    out = write_report(write_run(tmp_path, events, metrics))
    page = out.read_text()
    assert (tmp_path / "progress.png").stat().st_size > 1000 and "progress.png" in page
    assert "how it was made" in page and "lineage_resets" in page and "baseline run: 1 steps/s" in page

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _mark_faults(ax, events, step_of=lambda t: 50)
    labels = [ln.get_label() for ln in ax.lines if not ln.get_label().startswith("_")]
    assert labels == ["fault: node", "state lost (lineage reset)"]  # one legend entry each
    assert len(ax.lines) == 3 and ax.lines[0].get_xdata()[0] == 50  # both faults, then the reset
    plt.close(fig)


def test_live_view_counts_resets_and_steps_lost():
    view = RunView(replicas=2)
    events, metrics = all_down_run(with_state_lost=True)
    for item in sorted([("e", e) for e in events] + [("m", m) for m in metrics], key=lambda x: x[1]["time"]):
        if item[0] == "e":
            view.on_event(item[1])
        else:
            view.on_metric(item[1])
    assert view.lineage_resets == 1 and view.steps_lost == 60
    assert view.max_stall == pytest.approx(37.0)
    assert any("STATE LOST" in line for line in view.feed)


def test_checkpoint_restart_baseline_is_a_counted_rollback(tmp_path):
    """recovery=restart: every replica reloads the step-30 checkpoint; counted, not flagged as undetected."""
    events = [ev("run_started", 0.0, generation=None, mode="ddp")]
    for r in (0, 1):
        events += [ev("failure_detected", 40.5, r), ev("restart_started", 41.0, r, action="full_restart"),
                   ev("restart_done", 44.0, r, generation=1, seconds=3.0, full_restart=True)]
    metrics = [rec(t, r, t) for t in range(1, 41) for r in (0, 1)]
    metrics += [rec(t, r, t - 14, gen=1) for t in range(45, 61) for r in (0, 1)]
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True, recovery_mode="restart")
    assert s["full_restarts"] == 1 and s["lineage_resets"] == 0 and s["lineage_resets_undetected"] == 0
    assert s["full_restart_causes"] == [{"time": pytest.approx(40.0), "cause": "checkpoint_restart"}]
    assert s["steps_lost_reset"] == 2 * (40 - 30)
    assert check_run(write_run(tmp_path, events, metrics)) == []


def test_fatal_reset_loses_everything():
    events = [ev("run_started", 0.0, generation=None, mode="ddp")]
    events += [ev("state_lost", 31.0 + r, r, lost_step=30, restored_step=None, source=None, fatal=True,
                  reason="no backstop") for r in (0, 1)]
    metrics = [rec(t, r, t) for t in range(1, 31) for r in (0, 1)]
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=None, baseline_rate=1.0)
    assert s["lineage_resets"] == 1 and s["lineage_resets_fatal"] == 1 and s["full_restarts"] == 1
    assert s["steps_lost_reset"] == 60 and s["replica_steps_useful"] == 0 and s["goodput"] == 0.0


def test_steps_committed_through_a_lighthouse_outage_are_counted_once_per_step():
    events, metrics = all_down_run(with_state_lost=True)
    events += [ev("fault_injected", 20.0, fault_kind="lighthouse", generation=None),
               ev("lighthouse_restarted", 23.2, generation=None, cause="injected", down_s=3.0)]
    # two replicas kept quorum 1 for steps 21 and 22: one event per replica and step
    events += [{**ev("quorum_reused", 20.5 + i, r), "quorum_id": 1, "step": 21 + i} for i in (0, 1) for r in (0, 1)]
    s = compute_summary(events, metrics, replicas=2, replicas_consistent=True, baseline_rate=1.0)
    assert (s["lighthouse_restarts"], s["steps_without_lighthouse"]) == (1, 2)


def test_a_mid_round_joiner_that_missed_the_holders_sync_is_counted():
    """Replica 1 (generation 1) joins at manager step 5 and its first commit is step 6: it made the holders' sync.
    Replica 0 (generation 2) joins at step 6; the holder commits 7 without it, and its own first commit is 8 (it
    sat out a round). Generation 3 of replica 0 joins and dies before any commit: not judged."""
    def commit(t: float, replica: int, gen: int, manager_step: int) -> dict[str, Any]:
        return ev("commit", t, replica, gen, committed=True, group_rank=0, manager_step=manager_step)

    events = [commit(1.0, 0, 1, 5), ev("round_joined", 1.5, 1, 1, manager_step=5), commit(3.0, 0, 1, 6),
              commit(3.0, 1, 1, 6),
              ev("round_joined", 4.0, 0, 2, manager_step=6), commit(5.0, 1, 1, 7), commit(9.0, 1, 1, 8),
              commit(9.0, 0, 2, 8), ev("round_joined", 10.0, 0, 3, manager_step=8)]
    assert missed_first_syncs(events) == [{"replica": 0, "generation": 2, "time": 4.0, "joined_at": 6,
                                           "first_commit": 8}]
    s = compute_summary(events, [rec(1.0, 0, 1), rec(9.0, 0, 9)], replicas=2, replicas_consistent=True)
    assert (s["rounds_joined"], s["rounds_joined_missed_sync"]) == (3, 1)
    assert s["how"]["rounds_joined_missed_sync"].endswith(".") and s["how"]["recovery_seconds"].endswith(".")


def test_a_fault_the_replica_absorbed_is_not_paired_with_its_next_failure():
    """A `comm` fault on replica 1 at t=10 fails nothing: its group is rebuilt and it syncs again at t=14. Its
    failure at t=80 (another cause) starts its own recovery, not one from t=10. A `straggler` that is not
    absorbed (no sync of that replica before its hang is detected) stays paired with it."""
    def commit(t: float, replica: int, gen: int) -> dict[str, Any]:
        return ev("commit", t, replica, gen, committed=True, group_rank=0, manager_step=int(t))

    events = [ev("fault_injected", 10.0, 1, None, fault_kind="comm"), commit(14.0, 1, 0),
              ev("failure_detected", 80.0, 1, 0), ev("restart_done", 81.0, 1, 1), commit(85.0, 1, 1),
              ev("fault_injected", 100.0, 0, None, fault_kind="straggler"), commit(100.3, 0, 0),
              ev("failure_detected", 104.0, 0, 0), ev("restart_done", 105.0, 0, 1), commit(108.0, 0, 1)]
    recs = {r["replica"]: r for r in recovery_breakdowns(events)}
    assert recs[1]["fault_kind"] is None and recs[1]["total"] == 5.0  # from its detection, not from the comm fault
    assert recs[0]["fault_kind"] == "straggler" and recs[0]["total"] == 8.0  # the commit 0.3 s after proves nothing
