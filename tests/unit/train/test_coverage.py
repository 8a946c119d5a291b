"""A constant global batch and the sample ledger's arithmetic: pure functions, and the Trainer's weighted
gradient accumulation over a missing replica's micro-batches (one process, no Manager)."""

from __future__ import annotations

import itertools

import pytest
import torch

from regent.train.config import TrainConfig
from regent.train.coverage import (
    gradient_scale,
    merge_ranges,
    micro_batch_shards,
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
    record = survivor.train_step(Rules(
        reduce=lambda grads: seen.append(_grads(survivor)), commit=False,
        plan=lambda index: (micro_batch_shards(0, 1, 3, index), gradient_scale(1, 3))))
    assert record["micro_batches"] == 3 and record["extra_micro_batches"] == 2
    assert survivor.last_coverage == (0, [0, 1, 2])
    for got, want in zip(seen[0], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert survivor.dataloader.batches_consumed == 0  # not committed: the batch is given back
