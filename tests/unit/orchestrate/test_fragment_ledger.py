"""The sample ledger of Streaming DiLoCo on crafted ledgers: a line per contributor per committed fragment sync
(`fragment_ledger_line`), and the run checker's proof of every sample exactly once per fragment: a fragment's
window starts where its previous committed sync ended; a sample twice on one fragment, a gap, a failed fragment
sync's batches recorded (or not), a replica that died in a window, a late joiner, a lost line."""

from __future__ import annotations

from regent.orchestrate.invariants import check_ledger, effective_ledger, fragment_windows, ledger_totals
from regent.orchestrate.session import fragment_ledger_line, round_outcome

R, W, B = 3, 1, 2  # replicas, ranks per replica, sequences per micro-batch
F, P = 2, 2  # fragments, inner steps between two syncs (sync_every = F * P)
SPAN = R * W * B  # samples of one global batch


def line(step: int, fragment: int, start: int, end: int, replica: int, *, weight_sum: float = R,
         contributors: int = R, skipped: list[list[int]] | None = None, t: float | None = None,
         sat_out: bool = False) -> dict:
    """Replica `replica`'s line of fragment `fragment`'s sync committed as `step`: it trained its own shard of
    global batches [start, end) since its last sync of that fragment."""
    out = fragment_ledger_line(step=step, fragment=fragment, fragments=F, cover=[(n, [replica]) for n in
                                                                                 range(start, end)],
                               replica=replica, generation=0, contributors=contributors, weight_sum=weight_sum,
                               replicas=R, ranks=W, batch_size=B, skipped_batches=skipped or [], sat_out=sat_out)
    out["time"] = float(step) if t is None else t
    return out


def fault_free(syncs: int) -> list[dict]:
    """The initial sync commits fragment 0 as step 1 with nothing trained (no line); sync j (j >= 1) closes at
    global batch j * P, is fragment j % F, commits as step j + 1 and covers the batches since that fragment's
    previous sync."""
    return [line(j + 1, j % F, max(0, (j - F) * P), j * P, r) for j in range(1, syncs + 1) for r in range(R)]


def test_a_line_names_its_fragment_and_batches():
    x = line(4, 1, P, 3 * P, 2)
    assert x["fragment"] == 1 and x["fragments"] == F and x["batches"] == [P, 3 * P]
    assert x["samples"] == [[n * SPAN + 2 * B, n * SPAN + 3 * B] for n in range(P, 3 * P)]
    assert x["weight_sum"] == R and x["skipped_batches"] == [] and "round" not in x


def test_fault_free_syncs_hold_once_per_fragment():
    lines = fault_free(6)  # fragment 1 syncs at 2, 6, 10; fragment 0 at 4, 8, 12
    assert check_ledger(lines) == []
    windows = {w["step"]: (w["fragment"], w["lo"], w["hi"]) for w in fragment_windows(effective_ledger(lines))}
    assert windows[2] == (1, 0, P) and windows[3] == (0, 0, 2 * P) and windows[4] == (1, P, 3 * P)
    # every sample of [0, 12) on fragment 0 and of [0, 10) on fragment 1: once on each
    assert ledger_totals(lines) == {"samples_committed": (6 * P + 5 * P) * SPAN, "samples_skipped": 0,
                                    "fragments": F}


def test_a_sample_twice_on_one_fragment_is_caught():
    # replica 0 claims fragment 0's batches [0, 2P) again in its next sync of it
    lines = [x for x in fault_free(4) if not (x["step"] == 5 and x["replica"] == 0)]
    lines.append(line(5, 0, 0, 4 * P, 0))
    found = check_ledger(lines)
    assert any("outside its window" in v for v in found), found
    assert any("consumed twice on fragment 0" in v for v in found), found


def test_a_sync_whose_batches_end_before_the_fragments_previous_one_is_caught():
    lines = fault_free(4) + [line(7, 0, 2 * P, 4 * P, r) for r in range(R)]  # fragment 0 again on [2P, 4P)
    assert any("committed twice on it" in v for v in check_ledger(lines))


def test_different_ends_in_one_sync_are_caught():
    lines = fault_free(2) + [line(4, 1, P, 3 * P, r) for r in range(2)] + [line(4, 1, P, 3 * P + 1, 2)]
    assert any("different global batches" in v for v in check_ledger(lines))


def test_a_failed_fragment_sync_is_a_recorded_skip_on_that_fragment_only():
    # the sync closing [0, 2P) for fragment 0 did not commit: fragment 0 went back to its global parameters and
    # is retried at the next sync (batch 3P, step 3 again), covering [2P, 3P); its members record [0, 2P) as
    # skipped for fragment 0. Fragment 1 kept the effect of [0, 2P) and commits [P, 4P) next.
    lines = fault_free(1)
    lines += [line(3, 0, 2 * P, 3 * P, r, skipped=[[0, 2 * P]]) for r in range(R)]
    lines += [line(4, 1, P, 4 * P, r) for r in range(R)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": (P + 3 * P) * SPAN + P * SPAN,
                                    "samples_skipped": 2 * P * SPAN, "fragments": F}
    # the record comes from round_outcome: a sync that gave nothing back keeps the batches for the next commit
    cover = [(n, [0]) for n in range(0, 2 * P)]
    write, pending = round_outcome(cover, {"committed": False, "given_back": 0}, [])
    assert write is None and pending == [[0, 2 * P]]
    # without the record the dropped batches are a silent gap on fragment 0
    bare = fault_free(1) + [line(3, 0, 2 * P, 3 * P, r) for r in range(R)] + [line(4, 1, P, 4 * P, r)
                                                                             for r in range(R)]
    found = check_ledger(bare)
    assert any("fragment 0" in v and "silent gap" in v for v in found), found


def test_a_replica_that_died_in_the_window_is_a_recorded_skip():
    lines = fault_free(3) + [line(5, 0, 2 * P, 4 * P, r, weight_sum=2.0, contributors=2) for r in range(2)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines)["samples_skipped"] == 2 * P * W * B
    # the same lines claiming the whole window was covered (weights 3): a silent gap
    claimed = fault_free(3) + [line(5, 0, 2 * P, 4 * P, r, contributors=2) for r in range(2)]
    assert any("silent gap" in v for v in check_ledger(claimed))


def test_a_late_joiner_covers_the_tail_of_its_window():
    # replica 2 joined 1 inner step before fragment 0's sync: its weight is 1 / (F * P) of a whole window
    w = 2 + 1 / (F * P)
    lines = fault_free(3) + [line(5, 0, 2 * P, 4 * P, r, weight_sum=w) for r in range(2)]
    lines.append(line(5, 0, 4 * P - 1, 4 * P, 2, weight_sum=w))
    assert check_ledger(lines) == []
    assert ledger_totals(lines)["samples_skipped"] == (2 * P - 1) * W * B


def test_a_line_lost_with_its_killed_writer_is_accepted_only_with_that_failure():
    lines = [x for x in fault_free(4) if not (x["step"] == 4 and x["replica"] == 2)]
    died = [{"kind": "failure_detected", "replica": 2, "time": 4.5}]
    assert check_ledger(lines, died) == []
    assert any("silent gap" in v for v in check_ledger(lines, []))


def test_a_sync_everyone_sat_out_is_recorded_by_the_sat_out_lines():
    # replica 0 joined inside fragment 0's window [0, 2P) (at batch P) and the others died: it sits the sync out
    # (weight 0), and its line without samples tells the checker where the window ends: all of it skipped
    lines = fault_free(1) + [line(3, 0, P, 2 * P, 0, weight_sum=0.0, contributors=0, sat_out=True)]
    assert lines[-1]["samples"] == [] and lines[-1]["sat_out"] is True
    lines += [line(4, 1, P, 3 * P, 0, weight_sum=1.0, contributors=1), line(5, 0, 2 * P, 4 * P, 0,
                                                                            weight_sum=1.0, contributors=1)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines)["samples_skipped"] == 2 * P * SPAN + (R - 1) * (2 * P + 2 * P) * W * B
    # without it, the next sync of fragment 0 starts its window at 0: the dropped window shows as a silent gap
    assert any("silent gap" in v for v in check_ledger([x for x in lines if not x["sat_out"]]))
    # a sat-out line is no contributor's line: the one contributor of a sync whose line was lost with its killed
    # writer (replica 1) is still missed, and accepted with that failure
    lost = fault_free(1) + [line(3, 0, P, 2 * P, 0, weight_sum=1.0, contributors=1, sat_out=True)]
    died = [{"kind": "failure_detected", "replica": 1, "time": 3.5}]
    assert check_ledger(lost, died) == []
    assert any("silent gap" in v for v in check_ledger(lost, []))
