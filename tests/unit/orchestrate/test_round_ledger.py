"""The sample ledger in DiLoCo mode on crafted ledgers: a line per contributor per committed round
(`round_ledger_line`), and the run checker's verdicts: a sample twice, a skip without a record, a non-committed
round's batches recorded as skipped or consumed again (once, not twice), a round given back and trained again, a
late joiner's tail, a lost line."""

from __future__ import annotations

from regent.orchestrate.invariants import check_ledger, ledger_totals
from regent.orchestrate.session import round_ledger_line
from regent.train.coverage import micro_batch_shards

R, W, B, H = 3, 1, 2, 4  # replicas, ranks per replica, sequences per micro-batch, inner steps per round
SPAN = R * W * B  # samples of one global batch


def line(step: int, first: int, replica: int, *, members: int = R, rank: int | None = None, steps: int = H,
         weight_sum: float | None = None, contributors: int | None = None, constant: bool = False,
         skipped_batches: list[list[int]] | None = None, t: float | None = None) -> dict:
    """Replica `replica`'s line of the round committed as `step`, whose batches it trained are the last `steps`
    of [first, first + H): its own shard, or with `constant` the shards its rank among `members` covers."""
    rank = replica if rank is None else rank
    batches = range(first + H - steps, first + H)
    cover = [(n, micro_batch_shards(rank, members, R, n) if constant else [replica]) for n in batches]
    out = round_ledger_line(step=step, cover=cover, replica=replica, generation=0,
                            contributors=members if contributors is None else contributors,
                            weight_sum=float(members if weight_sum is None else weight_sum), period=H, replicas=R,
                            ranks=W, batch_size=B, skipped_batches=skipped_batches or [])
    out["time"] = float(step) if t is None else t
    return out


def full_round(step: int, first: int) -> list[dict]:
    return [line(step, first, r) for r in range(R)]


def test_a_line_is_compact_and_names_its_round():
    x = line(5, 8, 1)
    assert x["round"] == [8, 12] and x["batches"] == [8, 12] and x["micro_batches"] == H
    assert x["samples"] == [[n * SPAN + B, n * SPAN + 2 * B] for n in range(8, 12)]  # shard 1 of each batch
    assert x["skipped_samples"] == 0 and x["skipped_batches"] == []
    alone = line(5, 8, 0, members=1, rank=0, constant=True, weight_sum=R)  # one member covers every shard
    assert alone["samples"] == [[8 * SPAN, 12 * SPAN]] and alone["micro_batches"] == R * H


def test_fault_free_rounds_hold():
    lines = [x for k in range(3) for x in full_round(k + 1, k * H)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 3 * H * SPAN, "samples_skipped": 0}


def test_members_covering_a_missing_replica_hold():
    # replica 2 is missing from the quorum that opened round 2: the two members cover its shard all round
    covered = [line(2, H, r, members=2, constant=True, weight_sum=R) for r in range(2)]
    lines = full_round(1, 0) + covered + full_round(3, 2 * H)
    assert check_ledger(lines) == []
    assert sum(x["micro_batches"] for x in covered) == R * H
    assert ledger_totals(lines)["samples_skipped"] == 0


def test_a_sample_twice_is_caught():
    # both members cover shard 0 (a wrong split): shard 0 of every batch of the round is consumed twice
    lines = full_round(1, 0) + [line(2, H, 0, members=2, rank=0, constant=True, weight_sum=R),
                                line(2, H, 1, members=2, rank=0, constant=True, weight_sum=R)]
    assert any("consumed twice" in v for v in check_ledger(lines))


def test_two_rounds_consuming_the_same_batches_are_caught():
    found = check_ledger(full_round(1, 0) + full_round(2, 0))
    assert any("consumed by committed steps [1] and 2" in v for v in found), found


def test_a_replica_that_died_in_the_round_is_a_recorded_skip():
    # replica 2 died in round 2: the two contributors' weights sum to 2, so its shard's samples are recorded
    lines = full_round(1, 0) + [line(2, H, r, members=2, weight_sum=2.0) for r in range(2)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 2 * H * SPAN - H * W * B, "samples_skipped": H * W * B}


def test_a_skip_without_a_record_is_caught():
    # the same round, but the contributors claim the whole round was covered (weights 3): a silent gap
    lines = full_round(1, 0) + [line(2, H, r, members=2, weight_sum=3.0) for r in range(2)]
    assert any("silent gap" in v for v in check_ledger(lines))


def test_a_late_joiner_covers_the_rounds_tail():
    # replica 2 joined round 2 for its last 1 step: weight 1/4; the 3 steps of its shard before are recorded
    lines = full_round(1, 0) + [line(2, H, r, weight_sum=2.25) for r in range(2)] + [line(2, H, 2, steps=1,
                                                                                            weight_sum=2.25)]
    assert check_ledger(lines) == []
    assert lines[-1]["batches"] == [2 * H - 1, 2 * H] and lines[-1]["round"] == [H, 2 * H]
    assert ledger_totals(lines)["samples_skipped"] == 3 * W * B


def test_a_non_committed_rounds_batches_are_recorded_as_skipped():
    # round [H, 2H) did not commit; its members record it at their next commit, which consumes [2H, 3H)
    nxt = [line(2, 2 * H, r, skipped_batches=[[H, 2 * H]]) for r in range(R)]
    lines = full_round(1, 0) + nxt
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 2 * H * SPAN, "samples_skipped": H * SPAN}
    # without the record, the batches of the round that did not commit are a silent gap
    found = check_ledger(full_round(1, 0) + full_round(2, 2 * H))
    assert any("global batch(es) 4, 5, 6, 7 " in v for v in found), found


def test_a_round_one_replica_failed_and_the_others_committed_counts_once():
    # replica 2 was left out of round 2's quorum (late): its sync did not commit, the others' did, without it
    # (weights 2: its shard of the round recorded skipped by them). It records the round's batches as skipped
    # whole at its next commit: those batches count as consumed (by the others) and as skipped once, not twice
    lines = full_round(1, 0) + [line(2, H, r, weight_sum=2.0) for r in range(2)]
    lines += [line(3, 2 * H, r, skipped_batches=[[H, 2 * H]] if r == 2 else None) for r in range(R)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 3 * H * SPAN - H * W * B, "samples_skipped": H * W * B}


def test_a_non_committed_rounds_batches_consumed_again_count_once():
    # a lineage reset (backstop restore) re-commits step 2 on [H, 2H), the batches its lost lines had recorded
    # as skipped: the later lines replace the lost ones, so those batches are consumed once and skipped by none
    lines = full_round(1, 0) + [line(2, 2 * H, r, skipped_batches=[[H, 2 * H]]) for r in range(R)]
    lines += [dict(x, time=10.0) for x in full_round(2, H)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 2 * H * SPAN, "samples_skipped": 0}
    # consumed again twice (two committed rounds on the batches of the one that did not commit): caught
    twice = full_round(1, 0) + [line(2, 2 * H, r, skipped_batches=[[H, 2 * H]]) for r in range(R)]
    twice += full_round(3, H) + full_round(4, H)
    found = check_ledger(twice)
    assert any("consumed by committed steps [3] and 4" in v for v in found), found


def test_different_rounds_in_one_commit_are_caught():
    lines = full_round(1, 0)[:2] + [line(1, 1, 2)]
    assert any("different rounds" in v for v in check_ledger(lines))


def test_a_line_lost_with_its_killed_writer_is_accepted_only_with_that_failure():
    lines = full_round(1, 0)[:2] + full_round(2, H)
    died = [{"kind": "failure_detected", "replica": 2, "time": 1.5}]
    assert check_ledger(lines, died) == []
    assert any("silent gap" in v for v in check_ledger(lines, []))
    assert any("silent gap" in v for v in check_ledger(lines, [{**died[0], "time": 500.0}]))


def test_per_step_and_round_lines_keep_their_own_rules():
    # a per-step line names one batch and counts skipped replica-shards; a round line's skip is in samples
    from regent.orchestrate.session import ledger_line

    per_step = ledger_line(step=1, batch=0, replica=0, generation=0, shards=[0], participants=1, replicas=R,
                           ranks=W, batch_size=B, constant_batch=False)
    assert per_step["skipped"] == 2 and "round" not in per_step
    assert ledger_totals([per_step])["samples_skipped"] == 2 * W * B


def test_a_round_that_did_not_commit_is_recorded_at_the_next_commit_this_replica_contributes_to():
    from regent.orchestrate.session import round_outcome

    cover = [(n, [0]) for n in range(H, 2 * H)]
    write, pending = round_outcome(cover, {"committed": False, "weight": 1.0}, [])
    assert write is None and pending == [[H, 2 * H]]  # not committed: nothing written, the round to record
    nxt = [(n, [0]) for n in range(2 * H, 3 * H)]
    # a committed sync it sat out (weight 0) writes nothing and keeps the record for later
    assert round_outcome(nxt, {"committed": True, "weight": 0.0}, pending) == (None, [[H, 2 * H]])
    # a committed sync that averaged its pseudo-gradient writes a line carrying the record, then clears it
    write, pending = round_outcome(nxt, {"committed": True, "weight": 1.5}, pending)
    assert write == [[H, 2 * H]] and pending == []
    assert round_outcome([], {"committed": False}, []) == (None, [])  # nothing trained: nothing to record


def test_a_round_lost_to_a_checkpoint_restart_is_trained_again_not_twice():
    """Seen with `--recovery restart`: a survivor committed round 3 alone, then the whole job restarted from the
    checkpoint of step 2; its first sync committed step 3 with no samples, and round [H, 2H) was trained again as
    step 4. The lost step 3's line is void (the `state_lost` restored step 2 after it), so each sample counts once."""
    lost = [line(3, H, 1, members=1, contributors=1, weight_sum=1.0, t=3.0)]
    lines = full_round(2, 0) + lost + [x | {"time": 6.0} for x in full_round(4, H)]
    reset = {"kind": "state_lost", "time": 5.0, "replica": 0, "lost_step": 3, "restored_step": 2}
    assert check_ledger(lines, [reset]) == []
    assert ledger_totals(lines, [reset]) == {"samples_committed": 2 * H * SPAN, "samples_skipped": 0}
    # without the reset the same lines are a sample twice: the void line is what made it hold
    assert any("consumed twice" in v for v in check_ledger(lines))


def test_a_round_given_back_records_nothing_and_is_trained_again():
    from regent.orchestrate.session import round_outcome

    cover = [(n, [0]) for n in range(H, 2 * H)]
    # plain DiLoCo's sync did not commit and gave the round back: nothing to record, nothing pending
    assert round_outcome(cover, {"committed": False, "weight": 1.0, "given_back": H}, []) == (None, [])
    # the same batches trained again commit in the next round, which carries no skip record
    write, pending = round_outcome(cover, {"committed": True, "weight": 1.0, "given_back": 0}, [])
    assert write == [] and pending == []


def test_a_round_trained_again_after_a_failed_sync_counts_once():
    # the sync closing [H, 2H) failed (step 2 not committed); every replica went back to batch H and trained the
    # round again, committed as step 2 on the same batches: each sample once, nothing skipped
    lines = full_round(1, 0) + [dict(x, time=10.0 + x["time"]) for x in full_round(2, H)] + full_round(3, 2 * H)
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 3 * H * SPAN, "samples_skipped": 0}
    # a replica that did not give its round back would train the next batches instead: the retrained round then
    # names different rounds on different replicas, and the round it skipped is a silent gap
    ahead = full_round(1, 0) + [line(2, H, r) for r in range(2)] + [line(2, 2 * H, 2)]
    found = check_ledger(ahead)
    assert any("different rounds" in v for v in found), found
