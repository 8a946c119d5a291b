"""Which samples a step covers: the constant global batch and the sample ledger's arithmetic (pure functions).

A global batch n is `replicas` replica-shards of `ranks` loader shards each; loader shard k = replica_shard *
ranks + rank reads batch n of its shard (`regent.train.data.ShardedBatches.batch`). Every loader batch is
`batch_size` sequences, so batch n of loader shard k holds the global sample indices

    [(n * replicas * ranks + k) * batch_size, (n * replicas * ranks + k + 1) * batch_size)

(the index before the epoch's shuffle: sample i is sequence `shuffled_positions(i mod epoch, ...)`), and a
replica-shard's `ranks` loader shards are one contiguous range. That is what makes the ledger compact: a
committed step is a few ranges, not one line per sample.

With a constant global batch (`ft.constant_batch`), a step whose quorum has P < replicas participants still
covers all `replicas` replica-shards of its global batch: participant q takes the shards j with
(j + n) mod P == q (rotating with the batch, so no participant always carries the extra micro-batches), and
scales its gradient by P / replicas, so that the participants' average is the mean over all the shards'
samples, as in a full quorum.

DiLoCo (`ft.mode=diloco`) commits a round of `period` inner steps at once, so the same rules apply per round:
- a round's samples are committed when the sync that closes it commits, and only those of the replicas whose
  pseudo-gradient it averaged (a replica that sat the sync out, or died in the round, contributed none);
- a round runs under the quorum of the sync that opened it (the last quorum formed: its members and their ranks
  are the same on every member); with a constant global batch every inner step of the round covers the
  replica-shards `micro_batch_shards(rank, members, replicas, batch)` says, and a replica missing from that
  quorum has its micro-batches taken by the members for the whole round. A replica that dies inside a round is
  learnt of at the round's sync: its samples of that round are recorded as skipped (`round_skipped_samples`),
  and the next round's members cover its shard;
- an inner step's gradient is the mean over its micro-batches (`inner_step_scale`: the same step size as a
  fault-free inner step), and the pseudo-gradient counts by the replica-shard micro-batches it covered per inner
  step of a whole round (`regent.ft.local_sgd.pseudo_gradient_weight`): the weighted average is over the
  configured samples, each once;
- a round whose sync did not commit (voted down, or failed after its retries) put back the last global
  parameters: its members give the round back (step count, schedule and data position go back to its first
  batch, `regent.ft.local_sgd.steps_given_back`) and train it again, so its samples count once, in the round
  that commits them.

Streaming DiLoCo (several fragments) applies them per fragment: a fragment's sync commits, on that fragment, the
samples trained since its previous sync, so every sample must appear once in each fragment's committed syncs or
be recorded as skipped for it (a sync of it that did not commit drops the effect of its window on that fragment
only: recorded as skipped, not trained again, which would count the samples twice on the other fragments).
"""

from __future__ import annotations

LEDGER_FILE = "ledger.jsonl"  # the sample ledger, in the run directory (written by orchestrate.session)


def micro_batch_shards(rank_in_quorum: int, participants: int, replicas: int, batch: int) -> list[int]:
    """The replica-shards of global batch `batch` that participant `rank_in_quorum` of `participants` covers.

    A full quorum keeps one shard each (participant q: shard q). Fewer participants share all `replicas`
    shards, disjointly and completely, a function only of (rank in the quorum, quorum size, configured
    replicas, batch): every participant computes the same split without asking the others who they are."""
    if not 1 <= participants <= replicas:
        raise ValueError(f"participants={participants} must be in [1, replicas={replicas}]")
    if not 0 <= rank_in_quorum < participants:
        raise ValueError(f"rank_in_quorum={rank_in_quorum} must be in [0, participants={participants})")
    if participants == replicas:
        return [rank_in_quorum]
    return [j for j in range(replicas) if (j + batch) % participants == rank_in_quorum]


def gradient_scale(participants: int, replicas: int) -> float:
    """The factor on a participant's summed micro-batch gradients: the participants' average (a division by
    `participants`) then equals the mean over `replicas` shards."""
    return participants / replicas


def shard_sample_range(batch: int, replica_shard: int, *, replicas: int, ranks: int, batch_size: int
                       ) -> tuple[int, int]:
    """[lo, hi) of the global sample indices that replica-shard `replica_shard` of global batch `batch` holds."""
    first = (batch * replicas * ranks + replica_shard * ranks) * batch_size
    return first, first + ranks * batch_size


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with touching ranges joined (overlapping ones are kept apart: the checker must see them)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def step_sample_ranges(batch: int, shards: list[int], *, replicas: int, ranks: int, batch_size: int
                       ) -> list[tuple[int, int]]:
    """The sample ranges of `shards` of global batch `batch`, merged."""
    return merge_ranges([shard_sample_range(batch, j, replicas=replicas, ranks=ranks, batch_size=batch_size)
                         for j in shards])


def inner_step_scale(shards: list[int]) -> float:
    """DiLoCo with a constant global batch: the factor on an inner step's summed micro-batch gradients (their
    mean: a replica covering two shards takes one step over twice the samples, not two steps)."""
    return 1.0 / max(1, len(shards))


def round_skipped_samples(weight_sum: float, *, replicas: int, period: int, ranks: int, batch_size: int) -> int:
    """DiLoCo: the samples of a committed round that no contributor's pseudo-gradient covered, from the sum of
    the contributors' weights (a replica-shard of every inner step of the round counts 1; the round holds
    `replicas` of them): the skip record of the replicas that died in the round or joined it late."""
    missing = round((replicas - weight_sum) * period)
    return max(0, missing) * ranks * batch_size


def round_sample_ranges(cover: list[tuple[int, list[int]]], *, replicas: int, ranks: int, batch_size: int
                        ) -> list[tuple[int, int]]:
    """The sample ranges of a round's inner steps, each (global batch, replica-shards covered), merged."""
    return merge_ranges([shard_sample_range(n, j, replicas=replicas, ranks=ranks, batch_size=batch_size)
                         for n, shards in cover for j in shards])
