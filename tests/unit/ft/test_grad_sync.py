"""Per-step gradient averaging overlapped with backward: bucket plan (pure), and real Gloo averaging between
two replicas (threads), checked against the average computed by hand."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from regent.ft.grad_sync import OverlappedAllreduce, plan_buckets
from regent.ft.process_group import ReplicatedGroup
from tests.support.ft_harness import gloo_groups

CPU = torch.device("cpu")


def test_plan_buckets_fills_up_to_the_limit_and_splits_on_dtype():
    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [(40, f32, CPU), (40, f32, CPU), (40, f32, CPU), (200, f32, CPU), (8, bf16, CPU), (8, f32, CPU)]
    assert plan_buckets(sizes, 100) == [[0, 1], [2], [3], [4], [5]]
    assert plan_buckets(sizes, 10_000) == [[0, 1, 2, 3], [4], [5]]
    assert plan_buckets([], 100) == []


class _GroupAverager:
    """What `Manager.allreduce` does for a participating replica: sum over the group, divide by its size."""

    def __init__(self, group: ReplicatedGroup) -> None:
        self.group = group
        self.launched: list[int] = []

    def allreduce(self, t: torch.Tensor) -> torch.futures.Future:
        self.launched.append(t.numel())
        return self.group.allreduce([t], dist.ReduceOp.SUM).then(lambda f: t.div_(2))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_buckets_average_gradients_across_replicas_and_launch_during_backward():
    inputs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    expected = [(a + b) / 2 for a, b in zip(_grads(_model(0), inputs[0]), _grads(_model(0), inputs[1]))]

    models = [_model(0), _model(0)]  # built here: torch's global RNG is not for two threads at once

    def replica(r: int) -> tuple[list[torch.Tensor], int, int, list[int]]:
        model = models[r]
        averager = _GroupAverager(groups[r])
        sync = OverlappedAllreduce(averager, model.parameters(), bucket_bytes=16 * 17 * 4)
        out = []
        launched_before_finish = 0
        for _ in range(2):  # twice: buffers and counters are reused across steps
            model.zero_grad(set_to_none=True)
            model(inputs[r]).pow(2).sum().backward()
            launched_before_finish = len(averager.launched)
            sync.finish()
            out = [p.grad.clone() for p in model.parameters()]
            averager.launched.clear()
        sync.remove()
        return out, launched_before_finish, sync.num_buckets, [p.numel() for p in model.parameters()]

    with gloo_groups(timeout=10) as groups, ThreadPoolExecutor(2) as pool:
        results = list(pool.map(replica, range(2)))
    for grads, launched, buckets, _ in results:
        assert buckets == 3
        assert launched == buckets  # every bucket was handed to the all-reduce inside backward
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)


def test_sharded_parameters_are_refused():
    p = torch.nn.Parameter(torch.zeros(2))
    p.placements = ()  # what a DTensor parameter carries
    with pytest.raises(ValueError, match="FSDP"):
        OverlappedAllreduce(object(), [p])


def test_a_constant_batch_step_accumulates_and_overlaps_only_its_last_micro_batch():
    """Two participants of three replicas (a constant global batch): participant 0 covers shards 0 and 2, 1 covers
    shard 1, each scaling by 2/3. The earlier micro-batch's backward launches nothing (its gradients would be
    partial); the last one's launches every bucket during backward, and the average is the mean over the three
    shards, as a full quorum's would be."""
    from regent.ft.step import FaultTolerantStep

    shards = [torch.randn(5, 8, generator=torch.Generator().manual_seed(10 + j)) for j in range(3)]
    per_shard = [_grads(_model(0), x) for x in shards]
    expected = [sum(g) / 3 for g in zip(*per_shard)]
    cover = {0: [0, 2], 1: [1]}
    models = [_model(0), _model(0)]

    def replica(r: int) -> tuple[list[torch.Tensor], list[int], int]:
        model = models[r]
        averager = _GroupAverager(groups[r])
        sync = OverlappedAllreduce(averager, model.parameters(), bucket_bytes=16 * 17 * 4)
        step = FaultTolerantStep(averager, per_step=True, overlapped=sync)
        model.zero_grad(set_to_none=True)
        launched_after = []
        for n, j in enumerate(cover[r]):
            step.micro_batch_backward(last=n == len(cover[r]) - 1)
            (model(shards[j]).pow(2).sum() * (2 / 3)).backward()
            launched_after.append(len(averager.launched))
        sync.finish()
        return [p.grad.clone() for p in model.parameters()], launched_after, sync.num_buckets

    with gloo_groups(timeout=10) as groups, ThreadPoolExecutor(2) as pool:
        results = list(pool.map(replica, range(2)))
    assert results[0][1] == [0, results[0][2]]  # nothing during the first micro-batch, every bucket in the last
    assert results[1][1] == [results[1][2]]
    for grads, _, _ in results:
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)
