"""The run checker's sample ledger rule on crafted ledgers: a duplicate and a silent gap are caught, a
recorded skip and a re-committed step are accepted."""

from __future__ import annotations

import json

from regent.orchestrate.invariants import check_ledger, check_run, ledger_totals
from regent.orchestrate.session import ledger_line

R, W, B = 3, 1, 2  # replicas, ranks per replica, sequences per micro-batch


def line(step: int, batch: int, replica: int, shards: list[int], participants: int = R, *, constant: bool = True,
         t: float | None = None) -> dict:
    out = ledger_line(step=step, batch=batch, replica=replica, generation=0, shards=shards,
                      participants=participants, replicas=R, ranks=W, batch_size=B, constant_batch=constant)
    out["time"] = float(step) if t is None else t
    return out


def full_step(step: int, batch: int) -> list[dict]:
    return [line(step, batch, r, [r]) for r in range(R)]


def test_a_fault_free_ledger_holds():
    lines = [x for n in range(4) for x in full_step(n + 1, n)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 4 * R * W * B, "samples_skipped": 0}


def test_survivors_covering_a_dead_replica_hold():
    lines = full_step(1, 0) + [line(2, 1, 0, [0, 2], 2), line(2, 1, 1, [1], 2)] + full_step(3, 2)
    assert check_ledger(lines) == []


def test_a_sample_consumed_twice_is_caught():
    # replica 1 covers shard 0 too (a wrong split), so shard 0 of batch 1 is consumed twice
    lines = full_step(1, 0) + [line(2, 1, 0, [0, 2], 2), line(2, 1, 1, [0, 1], 2)]
    found = check_ledger(lines)
    assert any("consumed twice" in v for v in found), found


def test_a_batch_consumed_by_two_committed_steps_is_caught():
    lines = full_step(1, 0) + full_step(2, 0)
    found = check_ledger(lines)
    assert any("consumed by committed steps 1 and 2" in v for v in found), found
    assert any("consumed twice" in v for v in found), found


def test_a_silent_gap_is_caught():
    # two participants, no constant batch, yet the skip is not recorded (skipped 0): shard 2 vanished
    lines = full_step(1, 0) + [line(2, 1, 0, [0], 2), line(2, 1, 1, [1], 2)] + full_step(3, 2)
    found = check_ledger(lines)
    assert any("silent gap" in v for v in found), found


def test_a_missing_participant_line_is_a_gap():
    # the quorum had 3 participants but only 2 reported: a shard's samples are unaccounted for
    lines = full_step(1, 0)[:2]
    assert any("silent gap" in v for v in check_ledger(lines))


def test_a_line_lost_with_its_killed_writer_is_accepted_only_with_that_failure():
    """Replica 2 committed step 1 with the others and was killed before it wrote its line: with its failure
    recorded around that commit the samples are accepted (the commit was the quorum's); without it, or when
    the failure is of a replica that did write, it stays a gap."""
    lines = full_step(1, 0)[:2] + full_step(2, 1)
    died = [{"kind": "failure_detected", "replica": 2, "time": 1.5}]
    assert check_ledger(lines, died) == []
    assert any("silent gap" in v for v in check_ledger(lines, []))
    assert any("silent gap" in v for v in check_ledger(lines, [{**died[0], "replica": 1}]))
    assert any("silent gap" in v for v in check_ledger(lines, [{**died[0], "time": 500.0}]))


def test_a_batch_no_committed_step_covered_is_caught():
    lines = full_step(1, 0) + full_step(2, 2)
    found = check_ledger(lines)
    assert any("global batch(es) 1 " in v for v in found), found


def test_a_recorded_skip_is_accepted_and_counted():
    # without a constant batch, 2 of 3 participated: the third shard is recorded as skipped
    lines = full_step(1, 0) + [line(2, 1, 0, [0], 2, constant=False), line(2, 1, 1, [1], 2, constant=False)]
    assert check_ledger(lines) == []
    assert ledger_totals(lines) == {"samples_committed": 2 * R * W * B - W * B, "samples_skipped": W * B}


def test_a_step_committed_again_replaces_the_lost_one():
    # a counted reset: step 2 was lost and committed again (same batch), later in time
    lines = full_step(1, 0) + full_step(2, 1) + [dict(x, time=10.0) for x in full_step(2, 1)]
    assert check_ledger(lines) == []


def test_check_run_reads_the_ledger(tmp_path):
    (tmp_path / "events.jsonl").write_text("")
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(x) + "\n" for x in full_step(1, 0) + full_step(2, 0))
                                           + '{"torn')
    assert any("consumed twice" in v for v in check_run(tmp_path))


def test_an_overlap_hidden_behind_a_shorter_range_is_caught():
    # replica 0 claims all of batch 0; replicas 1 and 2 claim parts of it: both overlaps are found
    lines = [dict(line(1, 0, 0, [0, 1, 2]), samples=[[0, 6]]), line(1, 0, 1, [1]), line(1, 0, 2, [2])]
    found = [v for v in check_ledger(lines) if "consumed twice" in v]
    assert len(found) == 2, found
