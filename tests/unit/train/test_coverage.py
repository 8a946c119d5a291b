"""A constant global batch and the sample ledger's arithmetic: pure functions, and the Trainer's weighted
gradient accumulation over a missing replica's micro-batches (one process, no Manager)."""

from __future__ import annotations

import itertools

import pytest
import torch

from regent.train.config import TrainConfig
from regent.train.coverage import (
    gradient_scale,
    inner_step_scale,
    merge_ranges,
    micro_batch_shards,
    round_sample_ranges,
    round_skipped_samples,
    shard_sample_range,
    step_sample_ranges,
)
from regent.train.trainer import Trainer
from tests.support.step_rules import Rules

torch.set_num_threads(1)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 7])
def test_every_quorum_size_covers_every_shard_exactly_once(replicas):
    for participants, batch in itertools.product(range(1, replicas + 1), range(12)):
        covered = [j for q in range(participants) for j in micro_batch_shards(q, participants, replicas, batch)]
        assert sorted(covered) == list(range(replicas)), (participants, batch)
        loads = [len(micro_batch_shards(q, participants, replicas, batch)) for q in range(participants)]
        assert max(loads) - min(loads) <= 1  # the extra micro-batches are spread evenly


def test_full_quorum_keeps_one_shard_each_and_no_extra_work():
    assert [micro_batch_shards(q, 4, 4, 9) for q in range(4)] == [[0], [1], [2], [3]]
    assert gradient_scale(4, 4) == 1.0


def test_extra_micro_batches_rotate_with_the_batch():
    # 2 survivors of 3: the one carrying two shards changes from batch to batch
    heavy = [next(q for q in range(2) if len(micro_batch_shards(q, 2, 3, n)) == 2) for n in range(4)]
    assert heavy == [0, 1, 0, 1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        micro_batch_shards(0, 4, 3, 0)
    with pytest.raises(ValueError):
        micro_batch_shards(2, 2, 3, 0)


def test_sample_ranges_tile_the_global_batches():
    replicas, ranks, bs = 3, 2, 4
    ranges = [shard_sample_range(n, j, replicas=replicas, ranks=ranks, batch_size=bs)
              for n in range(5) for j in range(replicas)]
    assert merge_ranges(ranges) == [(0, 5 * replicas * ranks * bs)]
    assert step_sample_ranges(1, [0, 2], replicas=replicas, ranks=ranks, batch_size=bs) == [(24, 32), (40, 48)]
    assert step_sample_ranges(1, [2, 1, 0], replicas=replicas, ranks=ranks, batch_size=bs) == [(24, 48)]
    assert merge_ranges([(0, 4), (2, 6)]) == [(0, 4), (2, 6)]  # an overlap stays visible


def _grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in trainer.params]


def test_survivor_gradient_is_the_mean_over_the_configured_global_batch():
    """One survivor of 3 replicas (quorum of 1) covering all 3 shards with factor 1/3 gets the gradient that
    the full quorum's average of 3 one-shard gradients is."""
    cfg = dict(seq_len=32, batch_size=2, warmup_steps=2, max_steps=50, data_max_bytes=300_000)
    per_shard = []
    for j in range(3):
        t = Trainer(TrainConfig(**cfg), replica_index=j, num_replicas=3)
        t.train_step(Rules(reduce=lambda grads, store=per_shard, t=t: store.append(_grads(t)), commit=False))
    expected = [sum(g) / 3 for g in zip(*per_shard)]

    survivor = Trainer(TrainConfig(**cfg), replica_index=1, num_replicas=3)
    seen: list[list[torch.Tensor]] = []
    rules = Rules(reduce=lambda grads: seen.append(_grads(survivor)), commit=False,
                  plan=lambda index: (micro_batch_shards(0, 1, 3, index), gradient_scale(1, 3)))
    record = survivor.train_step(rules)
    assert record["micro_batches"] == 3 and record["extra_micro_batches"] == 2
    assert rules.backwards == [False, False, True]  # only the last backward may start the overlapped allreduce
    assert survivor.last_coverage == (0, [0, 1, 2])
    for got, want in zip(seen[0], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert survivor.dataloader.batches_consumed == 0  # not committed: the batch is given back


# -- DiLoCo: a round of inner steps under the quorum that opened it -------------------------------------------

@pytest.mark.parametrize("replicas,members,period", [(3, 2, 4), (3, 2, 5), (3, 1, 3), (4, 3, 6), (2, 1, 4)])
def test_a_rounds_members_cover_every_shard_of_every_inner_step_once(replicas, members, period):
    """The members of a round's quorum, each rank following micro_batch_shards per inner step, cover every
    replica-shard of each of the round's global batches exactly once; their total micro-batches (what their
    pseudo-gradients are weighted by) sum to replicas x period, and differ by at most one inner step's extra."""
    first = 7  # the round's first global batch
    covers = {q: [(n, micro_batch_shards(q, members, replicas, n)) for n in range(first, first + period)]
              for q in range(members)}
    ranges = [r for q in range(members) for r in round_sample_ranges(covers[q], replicas=replicas, ranks=2,
                                                                     batch_size=3)]
    span = replicas * 2 * 3
    assert merge_ranges(ranges) == [(first * span, (first + period) * span)]  # tiled: none twice, none left
    totals = [sum(len(shards) for _, shards in covers[q]) for q in range(members)]
    assert sum(totals) == replicas * period
    assert max(totals) - min(totals) <= -(-replicas // members) - replicas // members


def test_an_inner_step_takes_the_mean_of_its_micro_batches():
    assert inner_step_scale([2]) == 1.0 and inner_step_scale([0, 2]) == 0.5 and inner_step_scale([0, 1, 2]) == 1 / 3


def test_a_round_alone_covering_everything_is_one_range():
    # 1 survivor of 2 covers both shards of every batch: the round's ledger line is one range
    cover = [(n, micro_batch_shards(0, 1, 2, n)) for n in range(10, 20)]
    assert round_sample_ranges(cover, replicas=2, ranks=1, batch_size=4) == [(80, 160)]


def test_the_rounds_skip_record_comes_from_the_contributors_weights():
    # 3 replicas, rounds of 10 steps, 2 ranks x 4 sequences per micro-batch
    kw = dict(replicas=3, period=10, ranks=2, batch_size=4)
    assert round_skipped_samples(3.0, **kw) == 0  # all three took the whole round (or covered it: 1.5 + 1.5)
    assert round_skipped_samples(2.0, **kw) == 10 * 2 * 4  # one died in the round: its shard, every step
    assert round_skipped_samples(2.0 + 3 / 10, **kw) == 7 * 2 * 4  # it rejoined for the last 3 steps
    assert round_skipped_samples(2 * (0.1 + 0.2), **kw) == round((3 - 0.6) * 10) * 8  # float sums round exactly
    assert round_skipped_samples(3.0000001, **kw) == 0


def test_a_diloco_survivors_inner_step_gradient_is_the_mean_of_its_micro_batches():
    """DiLoCo: the member of a 1-replica round quorum of 2 configured covers both shards with factor 1/2: its
    inner step's gradient is the mean of the two shards' gradients (one step over twice the samples)."""
    cfg = dict(seq_len=32, batch_size=2, warmup_steps=2, max_steps=50, data_max_bytes=300_000)
    per_shard = []
    for j in range(2):
        t = Trainer(TrainConfig(**cfg), replica_index=j, num_replicas=2)
        t.train_step(Rules(reduce=lambda grads, store=per_shard, t=t: store.append(_grads(t)), commit=False))
    expected = [sum(g) / 2 for g in zip(*per_shard)]
    survivor = Trainer(TrainConfig(**cfg), replica_index=0, num_replicas=2)
    seen: list[list[torch.Tensor]] = []

    def plan(index: int) -> tuple[list[int], float]:
        shards = micro_batch_shards(0, 1, 2, index)
        return shards, inner_step_scale(shards)

    record = survivor.train_step(Rules(reduce=lambda grads: seen.append(_grads(survivor)), commit=False, plan=plan))
    assert record["extra_micro_batches"] == 1 and survivor.last_coverage == (0, [0, 1])
    for got, want in zip(seen[0], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
