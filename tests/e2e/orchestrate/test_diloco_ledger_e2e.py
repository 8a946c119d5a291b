"""DiLoCo's sample ledger end to end on CPU (real processes, real Lighthouse, real Gloo; the same harness as
test_case_study_e2e): with a constant global batch, a replica killed mid-round and the survivor covering its
shard in the rounds it is missing from; a sync that does not commit, whose round is given back and trained
again; the ledger proving every sample once."""

from __future__ import annotations

import json

import pytest

from tests.e2e.orchestrate.test_case_study_e2e import check_fault_recovered, run_regent, write_schedule

# 33 to 69 s on the shared 2-core box (start, restart and end of a run dominate): `long` (make test's budget)
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]

H = 5  # --ft.sync-every in the harness: inner steps per round


def test_diloco_constant_batch_kill_every_sample_once(tmp_path):
    """--ft.mode diloco (the default) with --ft.constant-batch: replica 1 is killed mid-round. Its samples of that
    round are recorded as skipped (the survivor learns of it at the round's sync); in the rounds whose quorum lacks
    it the survivor covers both shards of every inner step; every committed round's lines and skip records cover
    its global batches exactly once, and the run's own `regent check` proves it too."""
    from regent.orchestrate.invariants import check_ledger, effective_ledger

    sched = write_schedule(tmp_path / "faults.jsonl", [(6, 1, "kill", 0)])
    run = run_regent(tmp_path / "run", "--procs-per-replica", "1", "--ft.constant-batch", "--duration", "25s",
                     "--faults-file", sched)
    check_fault_recovered(run, "kill")
    ledger = [json.loads(x) for x in (run.dir / "ledger.jsonl").read_text().splitlines() if x.strip()]
    assert check_ledger(ledger, run.events) == []
    rounds = effective_ledger(ledger)
    assert len(rounds) >= 3 and all("round" in x for ls in rounds.values() for x in ls)
    span = 2 * 1 * 4  # replicas x ranks x batch size: one global batch, in samples
    # consecutive rounds of H global batches from the first: none consumed twice, none left out
    firsts = sorted(ls[0]["round"][0] for ls in rounds.values())
    assert firsts == list(range(0, H * len(rounds), H)), firsts
    lost = [step for step, ls in rounds.items() if len(ls) < ls[0]["participants"]]
    assert len(lost) <= 1, lost  # one kill: at most the line of the round it interrupted
    skipping = [step for step, ls in rounds.items() if ls[0]["skipped_samples"]]
    # only the round the kill interrupted loses samples: the dead replica's shard, at most every inner step
    assert len(skipping) <= 1 and all(rounds[s][0]["skipped_samples"] <= H * 4 for s in skipping), skipping
    for step, ls in rounds.items():
        if step in lost or step in skipping:
            continue
        covered = sum(hi - lo for x in ls for lo, hi in x["samples"])
        assert covered == H * span, (step, ls)  # a constant global batch: the whole round
    # the survivor carried the dead replica's shard: rounds of one contributor covering both shards of every step
    alone = [ls[0] for ls in rounds.values() if len(ls) == 1 and ls[0]["participants"] == 1]
    assert any(x["micro_batches"] == 2 * H and x["samples"] == [[x["round"][0] * span, x["round"][1] * span]]
               for x in alone), alone
    assert any(x["generation"] > 0 for ls in rounds.values() for x in ls), "the restarted replica never contributed"
    s = run.summary
    assert s["samples"]["samples_committed"] == sum(hi - lo for ls in rounds.values() for x in ls
                                                    for lo, hi in x["samples"])
    assert s["samples"]["samples_skipped"] == sum(rounds[t][0]["skipped_samples"] for t in skipping)
    assert s["extra_micro_batches"] >= H and s["steps_with_extra_micro_batches"] >= H
    assert s["replicas_consistent"] is True and s["full_restarts"] == 0


def test_diloco_failed_sync_round_is_trained_again(tmp_path):
    """With --ft.min-replica-size 2, a sync needs both replicas: replica 1 hangs, and every sync of the survivor
    until it is detected, restarted and back does not commit (a kill was restarted from a warm spare before the
    survivor's next sync on an idle box: no sync failed). Each time the survivor gives the round back (data position, step
    count and schedule to its first batch) and trains it again: the committed rounds are consecutive from batch
    0, none records a skipped batch, and the run's own `regent check` proves every sample once."""
    from regent.orchestrate.invariants import check_ledger, effective_ledger

    sched = write_schedule(tmp_path / "faults.jsonl", [(6, 1, "hang", 0)])
    run = run_regent(tmp_path / "run", "--procs-per-replica", "1", "--ft.min-replica-size", "2", "--duration",
                     "25s", "--faults-file", sched)
    failed = [e for e in run.events if e["kind"] == "commit" and e.get("committed") is False and e["replica"] == 0]
    assert failed, "no sync of the survivor failed (nothing was tested)"
    ledger = [json.loads(x) for x in (run.dir / "ledger.jsonl").read_text().splitlines() if x.strip()]
    assert check_ledger(ledger, run.events) == []
    rounds = effective_ledger(ledger)
    firsts = sorted(ls[0]["round"][0] for ls in rounds.values())
    assert firsts == list(range(0, H * len(rounds), H)), firsts  # every round once, the failed ones trained again
    assert all(x["skipped_batches"] == [] for ls in rounds.values() for x in ls)
    # a round with one contributor is one the restarted replica sat out (it joined at its sync): its shard of that
    # round is recorded as skipped, and nothing else is
    assert all(x["skipped_samples"] == (H * 4 if x["participants"] == 1 else 0) for ls in rounds.values() for x in ls)
    # the final step counts committed inner steps only: the rounds given back were not counted twice
    assert {s["step"] for s in run.summary["final_states"]} == {H * len(rounds)}
    assert run.summary["replicas_consistent"] is True and run.summary["full_restarts"] == 0


def test_streaming_diloco_kill_every_sample_once_per_fragment(tmp_path):
    """Streaming DiLoCo (--ft.fragments 2, --ft.sync-every 6: a fragment syncs every 3 inner steps): replica 1 is
    killed mid-window and rejoins. Every committed fragment sync writes its contributors' lines; per fragment the
    windows follow each other from batch 0, the dead replica's samples are recorded as skipped on the fragments
    whose windows it missed (it sits out each fragment's sync until it has trained a whole window of it), the
    restarted replica then contributes again, and `regent check` proves every sample once per fragment."""
    from regent.orchestrate.invariants import check_ledger, effective_ledger, fragment_windows, ledger_totals

    sched = write_schedule(tmp_path / "faults.jsonl", [(6, 1, "kill", 0)])
    # 35 s: the restarted replica sits out each fragment's first window after it joins, then contributes whole
    run = run_regent(tmp_path / "run", "--procs-per-replica", "1", "--ft.fragments", "2", "--ft.sync-every", "6",
                     "--duration", "35s", "--faults-file", sched)
    check_fault_recovered(run, "kill")
    ledger = [json.loads(x) for x in (run.dir / "ledger.jsonl").read_text().splitlines() if x.strip()]
    assert ledger and all(x["fragments"] == 2 and x["fragment"] in (0, 1) for x in ledger)
    assert check_ledger(ledger, run.events) == []
    windows = fragment_windows(effective_ledger(ledger))
    assert all(w["problem"] is None for w in windows)
    for f in (0, 1):
        mine = [w for w in windows if w["fragment"] == f]
        assert len(mine) >= 3 and mine[0]["lo"] == 0
        assert all(a["hi"] == b["lo"] for a, b in zip(mine, mine[1:]))  # each window starts where the last ended
    assert {w["fragment"] for w in windows[:4]} == {0, 1}  # the fragments take turns
    assert any(x["generation"] > 0 and not x["sat_out"] for x in ledger), "the restarted replica never contributed"
    totals = ledger_totals(ledger)
    assert run.summary["samples"] == totals and totals["fragments"] == 2
    assert totals["samples_skipped"] > 0 and totals["samples_committed"] > 0
    assert run.summary["replicas_consistent"] is True and run.summary["full_restarts"] == 0


def test_streaming_diloco_failed_fragment_syncs_are_recorded_per_fragment(tmp_path):
    """Streaming DiLoCo with --ft.min-replica-size 2: replica 1 is killed and every fragment sync of the survivor
    fails until it is back. A failed sync drops the effect of its window on that fragment only, so nothing is
    given back: the survivor records those batches as skipped for that fragment at its next commit of it, the
    fragment's windows still follow each other, and `regent check` proves every sample once per fragment."""
    from regent.orchestrate.invariants import check_ledger, effective_ledger, fragment_windows

    # the kill comes late enough for the survivor to have trained windows of its own (on a loaded box a kill at
    # 6 s hit before the first commit, and its failed syncs had nothing to record)
    sched = write_schedule(tmp_path / "faults.jsonl", [(12, 1, "kill", 0)])
    run = run_regent(tmp_path / "run", "--procs-per-replica", "1", "--ft.fragments", "2", "--ft.sync-every", "6",
                     "--ft.min-replica-size", "2", "--duration", "40s", "--faults-file", sched)
    failed = [e for e in run.events if e["kind"] == "commit" and e.get("committed") is False and e["replica"] == 0]
    assert failed, "no fragment sync of the survivor failed (nothing was tested)"
    ledger = [json.loads(x) for x in (run.dir / "ledger.jsonl").read_text().splitlines() if x.strip()]
    assert check_ledger(ledger, run.events) == []
    assert any(x["skipped_batches"] for x in ledger), "no failed fragment sync was recorded"
    windows = fragment_windows(effective_ledger(ledger))
    for f in (0, 1):
        mine = [w for w in windows if w["fragment"] == f]
        assert mine and mine[0]["lo"] == 0 and all(a["hi"] == b["lo"] for a, b in zip(mine, mine[1:]))
    assert run.summary["samples"]["samples_skipped"] >= sum(len(w["skipped_whole"]) for w in windows) * 2 * 4
    assert run.summary["replicas_consistent"] is True
