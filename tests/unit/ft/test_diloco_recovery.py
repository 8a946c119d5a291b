"""DiLoCo / Streaming DiLoCo with real replicas: late joiners get the global params and outer momentum;
a failed sync rolls back and retries the same fragment; plain DiLoCo gives the failed round's inner steps back
(they are trained again), Streaming DiLoCo does not (the other fragments keep their effect)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from regent.ft.lighthouse import LighthouseServer
from regent.ft.local_sgd import (
    ARRIVE_EARLY_STEPS,
    DiLoCo,
    LocalSGD,
    contributor_step,
    fragment_bounds,
    model_fragments,
    pseudo_gradient_weight,
    steps_given_back,
)
from regent.ft.manager import Manager


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    yield server
    server.shutdown()


def _solo_manager(lh: LighthouseServer, model: torch.nn.Module) -> Manager:
    return Manager(
        load_state_dict=model.load_state_dict, state_dict=model.state_dict, use_async_quorum=False,
        lighthouse_addr=lh.address(), replica_id="solo", timeout=5, quorum_timeout=10,
    )


def test_diloco_outer_step_math_single_replica(lighthouse):
    """lr=1, no momentum: new global = old global - (old global - local) = local; alpha mixes nothing more."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        with DiLoCo(manager, [model], inner, outer, sync_every=2) as diloco:
            for _ in range(2):
                inner.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                inner.step()
            # alone with a whole round: weight 1, the contributors' weights sum to 1 (nothing of the round skipped)
            assert diloco.last_sync == {"fragment": 0, "fragments": 1, "committed": True, "step": 1, "weight": 1.0,
                                        "weight_sum": 1.0, "contributors": 1, "given_back": 0}
        # Inner SGD on a linear model: two identical steps; outer lr 1 reproduces the local result.
        for n, p in model.named_parameters():
            grad = torch.ones(1, 4) * 3 if n == "weight" else torch.tensor([3.0])
            assert torch.allclose(p, start[n] - 0.2 * grad, atol=1e-6)
            assert torch.equal(diloco.fragments[0].original[n], p.detach())
    finally:
        manager.shutdown()


def test_a_mid_round_joiners_weight_cancels_in_the_average(lighthouse):
    """Alone in its quorum, a replica that joined mid-round (weight 5/10: five of ten inner steps) gets its own
    pseudo-gradient back from the weighted average, (w * pg) / w: with outer lr 1 the new global parameters are
    its local ones. A pseudo-gradient sent unweighted, or averaged without dividing by the weight, is not. The
    holder is 3 steps into the round; the joiner starts ARRIVE_EARLY_STEPS (2) further on, to reach the sync
    before the holders' quorum forms."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        steps: list[int] = []
        with DiLoCo(manager, [model], inner, outer, sync_every=10, on_contributor_step=steps.append) as diloco:
            diloco._round_info = {"at": time.time() - 0.25, "step_s": 0.1}  # a holder 3 steps into the round
            assert ARRIVE_EARLY_STEPS == 2
            assert not diloco.join_now() and diloco.joined_mid_round == {"round_position": 5, "period": 10}
            assert steps == [5] and diloco.local_step == 5
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            for _ in range(5):
                inner.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                inner.step()
            assert diloco.last_sync["committed"] and diloco._pending_weight == 5 / 10
        # five identical inner SGD steps on a linear model (the sync ran inside the fifth)
        for n, p in model.named_parameters():
            grad = torch.ones(1, 4) * 3 if n == "weight" else torch.tensor([3.0])
            assert torch.allclose(p, start[n] - 0.5 * grad, atol=1e-6), n
    finally:
        manager.shutdown()


def test_every_rank_of_a_replica_takes_group_rank_0s_round_position(lighthouse, monkeypatch):
    """The ranks of one replica must join the round at the same inner step (or all sit out): each rank's own
    estimate reads its own clock. Here this rank's clock says the round is nearly over (sit out), group rank 0
    decided to join 5 steps in: this rank joins 5 steps in too."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    asked: list[str] = []

    def rank0_decided(key, decide):
        asked.append(key)
        decide()  # this rank's own estimate is made (it consumes the round clock), then rank 0's value is taken
        return {"taken": 3}

    monkeypatch.setattr(manager, "group_agree", rank0_decided)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        with DiLoCo(manager, [model], inner, outer, sync_every=10) as diloco:
            diloco._round_info = {"at": time.time() - 0.85, "step_s": 0.1}  # its own clock: 9 steps in
            assert not diloco.join_now() and diloco.joined_mid_round == {"round_position": 5, "period": 10}
            assert diloco.local_step == 5 and asked == ["regent/diloco/join/1"]
    finally:
        manager.shutdown()


def test_a_sit_out_lines_up_with_a_mid_round_joiner_when_nobody_took_the_whole_round():
    # averaged sums over 3 members: two whole-round contributors at step 740 and a sit-out
    assert contributor_step(2 * 740 / 3, 2 / 3, 0.0, 0.0) == 740
    # the soak's case: one mid-round joiner at the round's end (740), two sit-outs (720): they move to 740
    assert contributor_step(0.0, 0.0, 740 / 3, 1 / 3) == 740
    # whole-round contributors win over a joiner (whose estimate of the round could be off)
    assert contributor_step(740 / 3, 1 / 3, 745 / 3, 1 / 3) == 740
    assert contributor_step(0.0, 0.0, 0.0, 0.0) is None  # nobody trained: nothing to line up with


def test_a_pseudo_gradient_counts_by_the_round_share_and_the_micro_batches_it_covered():
    assert pseudo_gradient_weight(trained=None, full=10, micro_batches=10, steps=10) == 1.0  # a whole round
    assert pseudo_gradient_weight(trained=4, full=10, micro_batches=4, steps=4) == 0.4  # joined for 4 of 10
    # a constant global batch: 1 survivor of 2 covers both shards every step; 2 of 3 cover 15 of 30 in 10 steps
    assert pseudo_gradient_weight(trained=None, full=10, micro_batches=20, steps=10) == 2.0
    assert pseudo_gradient_weight(trained=None, full=10, micro_batches=15, steps=10) == 1.5
    assert pseudo_gradient_weight(trained=0, full=10, micro_batches=0, steps=0) == 0.1  # never below one step


def test_a_survivors_weight_above_one_cancels_in_the_average(lighthouse):
    """A constant global batch: alone in its quorum, a replica that covered 2 micro-batches per inner step
    (weight 2) gets its own pseudo-gradient back from the weighted average, (2 pg) / 2, so with outer lr 1 the new
    global parameters are its local ones. The old rule (divide only by weights below 1) doubled the outer step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        with DiLoCo(manager, [model], inner, outer, sync_every=3) as diloco:
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            for _ in range(3):
                diloco.count_micro_batches(2)
                inner.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                inner.step()
            sync = diloco.last_sync
            assert sync["committed"] and sync["weight"] == 2.0 and sync["weight_sum"] == 2.0
            assert sync["contributors"] == 1
        for n, p in model.named_parameters():
            grad = torch.ones(1, 4) * 3 if n == "weight" else torch.tensor([3.0])
            assert torch.allclose(p, start[n] - 0.3 * grad, atol=1e-6), n
    finally:
        manager.shutdown()


def test_a_round_nobody_trained_in_takes_no_outer_step(lighthouse):
    """A replica that sits a round out (just healed) and ends up alone in its quorum commits the round without
    an outer step: with outer momentum, a step on zero pseudo-gradients would still move its parameters, and
    the same committed state would have two values (seen at the end of a run: replicas differing)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(manager, [model], inner, outer, sync_every=2) as diloco:
            for _ in range(2):  # one trained round: the outer momentum is not zero any more
                inner.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                inner.step()
            assert diloco.last_sync["committed"] and outer.state[model.weight]["momentum_buffer"].abs().sum() > 0
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert diloco.join_now()  # a round this replica sits out, alone: committed, nothing to average
            for n, p in model.named_parameters():
                assert torch.equal(p, before[n]), n
    finally:
        manager.shutdown()


def test_diloco_validates_its_arguments(lighthouse):
    model = torch.nn.Linear(2, 2)
    manager = _solo_manager(lighthouse, model)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="multiple"):
            DiLoCo(manager, [model, model], opt, opt, sync_every=3)
        with pytest.raises(ValueError, match="fragment_sync_delay"):
            DiLoCo(manager, [model], opt, opt, sync_every=3, fragment_sync_delay=3)
        manager.use_async_quorum = True
        with pytest.raises(ValueError, match="use_async_quorum=False"):
            DiLoCo(manager, [model], opt, opt, sync_every=3)
    finally:
        manager.shutdown()


def test_local_sgd_single_replica_keeps_params(lighthouse):
    model = torch.nn.Linear(3, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with LocalSGD(manager, model, opt, sync_every=2):
            for _ in range(4):
                opt.zero_grad()
                model(torch.ones(2, 3)).sum().backward()
                before = [p.detach().clone() for p in model.parameters()]
                opt.step()
        after = list(model.parameters())
        assert manager.current_step() == 2  # two syncs committed
        assert not all(torch.equal(a, b) for a, b in zip(before, after))
    finally:
        manager.shutdown()


def _inner_steps(model: torch.nn.Module, inner: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        inner.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        inner.step()


def test_steps_given_back_only_by_plain_diloco_and_only_when_not_committed():
    assert steps_given_back(committed=False, fragments=1, local_steps=5) == 5
    assert steps_given_back(committed=True, fragments=1, local_steps=5) == 0
    # Streaming DiLoCo: the other fragments keep the samples' effect; training them again would count them twice
    assert steps_given_back(committed=False, fragments=2, local_steps=5) == 0
    assert steps_given_back(committed=False, fragments=1, local_steps=0) == 0  # a sit-out sync trained nothing


def _sync_breaker(manager: Manager) -> tuple[list[bool], Callable[[], int]]:
    """A `round_step` that, while `fail[0]` is set, reports an error to the Manager at the sync (where a broken
    collective reports it), so that sync does not commit."""
    fail = [False]

    def round_step() -> int:
        if fail[0]:
            manager.report_error(RuntimeError("injected: the sync's allreduce broke"))
        return 0

    return fail, round_step


def test_a_plain_sync_that_did_not_commit_gives_its_round_back(lighthouse):
    """The sync's allreduce breaks (the error is reported after its quorum, where a broken collective reports
    it): the sync does not commit, the parameters go back to the last global ones, and the round's 3 inner steps
    are handed to `on_round_failed` to be trained again; the next round commits as the next step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    manager = _solo_manager(lighthouse, model)
    given: list[int] = []
    fail, round_step = _sync_breaker(manager)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        with DiLoCo(manager, [model], inner, outer, sync_every=3, round_step=round_step,
                    on_round_failed=given.append) as diloco:
            _inner_steps(model, inner, 3)
            assert diloco.last_sync["committed"] and given == []
            global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
            fail[0] = True
            _inner_steps(model, inner, 3)
            assert not diloco.last_sync["committed"] and diloco.last_sync["given_back"] == 3 and given == [3]
            assert all(torch.equal(p, global_params[n]) for n, p in model.named_parameters())
            fail[0] = False
            _inner_steps(model, inner, 3)
            assert diloco.last_sync["committed"] and diloco.last_sync["step"] == 2 and given == [3]
    finally:
        manager.shutdown()


def test_a_streaming_sync_that_did_not_commit_gives_nothing_back(lighthouse):
    """Two fragments: the failed fragment goes back to its global parameters and is retried at the next sync;
    the other keeps its local progress, so nothing is given back (its samples are recorded as skipped for the
    failed fragment instead)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    manager = _solo_manager(lighthouse, model)
    given: list[int] = []
    fail, round_step = _sync_breaker(manager)
    try:
        parts = model_fragments(model, 2)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outers = [torch.optim.SGD(f.parameters(), lr=1.0) for f in parts]
        with DiLoCo(manager, parts, inner, outers, sync_every=4, round_step=round_step,
                    on_round_failed=given.append) as diloco:
            _inner_steps(model, inner, 2)
            assert diloco.last_sync["committed"] and diloco.last_sync["fragment"] == 0
            fail[0] = True
            _inner_steps(model, inner, 2)
            assert not diloco.last_sync["committed"] and diloco.last_sync["fragment"] == 1
            assert diloco.last_sync["given_back"] == 0 and given == []
            fail[0] = False
            _inner_steps(model, inner, 2)
            assert diloco.last_sync["committed"] and diloco.last_sync["fragment"] == 1  # the same one, retried
    finally:
        manager.shutdown()


def test_fragments_split_the_parameters_contiguously_by_size():
    assert fragment_bounds([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert fragment_bounds([100, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]  # never an empty fragment
    assert fragment_bounds([1, 1, 100], 2) == [(0, 2), (2, 3)]
    assert fragment_bounds([5], 1) == [(0, 1)]
    for sizes, n in (([3, 1, 4, 1, 5, 9, 2, 6], 3), ([1] * 7, 7), ([7, 1, 1, 1], 2)):
        bounds = fragment_bounds(sizes, n)
        assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError):
        fragment_bounds([1, 1], 3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    parts = model_fragments(model, 2)
    assert model_fragments(model, 1) == [model]
    shared = [p for f in parts for p in f.parameters()]
    assert len(shared) == 4 and all(a is b for a, b in zip(shared, model.parameters()))  # the model's own tensors


def test_a_streaming_joiner_restarts_its_fragments_and_sits_out_each_ones_next_sync(lighthouse):
    """Streaming DiLoCo: a replica joining a run in progress (here: `join_now` at committed step 2, with the
    trainer's step count past 0) takes every fragment's global parameters, sits out the sync it joins and the
    next sync of every other fragment (its window of that fragment began before it joined), then contributes
    whole (weight 1) to every fragment. Sitting a fragment's sync out that way, its step count is still the
    run's, and it reports it (`in_phase`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    manager = _solo_manager(lighthouse, model)
    try:
        parts = model_fragments(model, 2)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outers = [torch.optim.SGD(f.parameters(), lr=1.0) for f in parts]
        with DiLoCo(manager, parts, inner, outers, sync_every=4, round_step=lambda: 4, exactly_once=True) as diloco:
            _inner_steps(model, inner, 4)  # fragments 0 and 1 commit, whole
            assert diloco.last_sync["step"] == 2 and diloco.last_sync["weight"] == 1.0
            _inner_steps(model, inner, 1)  # local progress on both fragments, then a (re)join
            assert diloco.join_now()
            assert all(torch.equal(p, f.original[n]) for f in diloco.fragments for n, p in f.params.items())
            assert diloco.last_sync["fragment"] == 0 and diloco.last_sync["weight"] == 0.0
            _inner_steps(model, inner, 2)
            assert (diloco.last_sync["fragment"], diloco.last_sync["weight"]) == (1, 0.0)
            # sitting fragment 1's sync out, it still reported its step count (it is in phase with the run): a
            # replica joining at that sync, with every member sitting it out, lines up with it
            assert diloco.fragments[1].contributor_step == 4
            weights = []
            for _ in range(2):
                _inner_steps(model, inner, 2)
                weights.append((diloco.last_sync["fragment"], diloco.last_sync["weight"]))
            assert weights == [(0, 1.0), (1, 1.0)]
    finally:
        manager.shutdown()
