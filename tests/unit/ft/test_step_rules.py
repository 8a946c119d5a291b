"""The rules of one fault-tolerant step (`regent.ft.step`), as pure functions: the order around a change of the
weights, what the backstop copies, a constant batch's coverage; and that the step's owner is the only place that
hooks an optimizer. The class that executes them runs with real processes in tests/ft (TorchFT-style loops,
DiLoCo) and tests/orchestrate (the session)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from regent.ft.step import (
    ENTER,
    LEAVE,
    LOCK,
    PUBLISH,
    SYNC,
    UNLOCK,
    WAIT_COPY,
    WITHDRAW,
    backstop_copies,
    coverage_plan,
    update_plan,
)
from regent.train.coverage import gradient_scale, micro_batch_shards

SRC = Path(__file__).resolve().parents[3] / "src" / "regent"


def test_per_step_with_early_heal_and_a_backstop():
    before, after = update_plan(serve_live=True, wait_copy=True, sync=False)
    # locked before the served state is withdrawn; the backstop's copy is done before the weights change
    assert before == (ENTER, LOCK, WITHDRAW, WAIT_COPY)
    # published only once the lock is released and the new state is whole
    assert after == (UNLOCK, PUBLISH, LEAVE)


def test_diloco_counts_the_inner_step_after_the_lock_is_released():
    before, after = update_plan(serve_live=False, wait_copy=False, sync=True)
    assert before == (ENTER, LOCK)
    # the sync heals and is served from: the state must be readable; still inside the update (mid-step marks)
    assert after == (UNLOCK, SYNC, LEAVE)


@pytest.mark.parametrize("serve_live", [False, True])
@pytest.mark.parametrize("wait_copy", [False, True])
@pytest.mark.parametrize("sync", [False, True])
def test_every_plan_is_bracketed_by_enter_and_leave_and_the_lock(serve_live, wait_copy, sync):
    before, after = update_plan(serve_live=serve_live, wait_copy=wait_copy, sync=sync)
    assert before[:2] == (ENTER, LOCK) and after[0] == UNLOCK and after[-1] == LEAVE
    assert (WITHDRAW in before) == (PUBLISH in after) == serve_live
    assert (WAIT_COPY in before) == wait_copy and (SYNC in after) == sync


def test_only_diloco_with_early_heal_copies_the_committed_state_apart():
    assert backstop_copies(sync=True, early_heal=True) == "committed"
    assert backstop_copies(sync=True, early_heal=False) == "full"
    assert backstop_copies(sync=False, early_heal=True) == "full"
    assert backstop_copies(sync=False, early_heal=False) == "full"


def _cover(replicas):
    return lambda index, rank, participants: (micro_batch_shards(rank, participants, replicas, index),
                                              gradient_scale(participants, replicas))


def test_a_constant_batch_covers_the_missing_shards_only_for_a_usable_quorum():
    cover = _cover(3)
    # a lone survivor of 3 covers all 3 shards with factor 1/3
    assert coverage_plan(0, participating=True, rank=0, participants=1, replicas=3, cover=cover) == \
        ([0, 1, 2], pytest.approx(1 / 3))
    # a healer (not participating), no rank, or a quorum of 0 or more than configured: its own shard only
    assert coverage_plan(0, participating=False, rank=0, participants=1, replicas=3, cover=cover) is None
    assert coverage_plan(0, participating=True, rank=None, participants=1, replicas=3, cover=cover) is None
    assert coverage_plan(0, participating=True, rank=0, participants=0, replicas=3, cover=cover) is None
    assert coverage_plan(0, participating=True, rank=0, participants=4, replicas=3, cover=cover) is None


def test_only_the_step_owner_hooks_an_optimizer():
    hook = re.compile(r"register_step_(pre|post)_hook|register_(load_)?state_dict_(pre|post)_hook")
    found = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if hook.search(line)]
    assert found and all(f.startswith("ft/step.py:") for f in found), found
