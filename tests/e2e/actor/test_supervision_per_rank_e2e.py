"""Issue 35: procs lost together are aggregated on the wire (one report per mesh), but the API delivers what
Monarch delivers: one `MeshFailure` per failed rank, to `__supervise__` and `unhandled_fault_hook`, at once (a
failure held back for a quiet spell reached `__supervise__` after the caller had moved on): the cases that
start processes (the others: tests/unit/actor/test_supervision_per_rank.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

import regent.actor
from regent.actor import Actor, SupervisionError, endpoint, this_host
from tests.unit.actor.test_supervision_per_rank import _wait

TIMEOUT = 60


@pytest.fixture
def faults(monkeypatch):
    got = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", got.append)
    return got


class FailingInit(Actor):
    def __init__(self):
        raise ValueError("init went wrong")


class Failing(Actor):
    @endpoint
    async def fail(self) -> None:
        raise SystemExit("rank failed")

    @endpoint
    async def ok(self) -> str:
        return "ok"


class Supervisor(Actor):
    """Owns a mesh of `Failing` actors and records each `__supervise__` call."""

    def __init__(self, procs):
        self.mesh = procs.spawn("failing", Failing)
        self.seen = []
        self.enough = asyncio.Event()
        self.expected = 1

    async def __supervise__(self, failure) -> bool:
        self.seen.append((failure.crashed_ranks, str(failure)))
        if len(self.seen) >= self.expected:
            self.enough.set()
        return True

    @endpoint
    async def fail_children(self) -> None:
        await self.mesh.ok.call()
        try:
            await self.mesh.fail.call()
        except SupervisionError:
            return
        raise AssertionError("the call should have raised SupervisionError")

    @endpoint
    async def broadcast_fail_and_wait(self, expected: int) -> None:
        self.expected = expected
        self.mesh.fail.broadcast()
        await asyncio.wait_for(self.enough.wait(), timeout=30)

    @endpoint
    async def seen_failures(self) -> list:
        return list(self.seen)


def test_init_failure_on_two_procs_calls_the_hook_once_per_rank(faults):
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        pm.spawn("badinit", FailingInit)
        assert _wait(lambda: len(faults) >= 2, timeout=30)
        time.sleep(0.5)  # no aggregated report on top of them
        assert sorted(f.crashed_ranks for f in faults) == [[0], [1]]
        assert all("badinit" in str(f) and "init went wrong" in f.report() for f in faults)
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_supervise_has_run_before_the_callers_next_message():
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    children = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        sup = pm.spawn("sup", Supervisor, children)
        sup.fail_children.call_one().get(timeout=TIMEOUT)
        seen = sup.seen_failures.call_one().get(timeout=TIMEOUT)
        assert len(seen) >= 1, seen
        assert all(len(ranks) == 1 and "failing" in text for ranks, text in seen)
    finally:
        pm.stop().get(timeout=TIMEOUT)
        children.stop().get(timeout=TIMEOUT)


def test_broadcast_failing_everywhere_is_one_supervise_call_per_rank():
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    children = this_host().spawn_procs(per_host={"gpus": 4})
    try:
        sup = pm.spawn("sup", Supervisor, children)
        sup.broadcast_fail_and_wait.call_one(4).get(timeout=TIMEOUT)
        time.sleep(0.5)
        seen = sup.seen_failures.call_one().get(timeout=TIMEOUT)
        assert sorted(ranks for ranks, _ in seen) == [[0], [1], [2], [3]]
        assert all(f"crashed_ranks={ranks}" in text for ranks, text in seen)
    finally:
        pm.stop().get(timeout=TIMEOUT)
        children.stop().get(timeout=TIMEOUT)


class SlowSupervisor(Actor):
    """An async actor with a sync (so executor-run) `__supervise__` that takes a while."""

    def __init__(self, procs):
        self.mesh = procs.spawn("failing", Failing)
        self.seen = []

    def __supervise__(self, failure) -> bool:
        time.sleep(0.5)
        self.seen.append(failure.crashed_ranks)
        return True

    @endpoint
    async def get_mesh(self):
        return self.mesh

    @endpoint
    async def seen_failures(self) -> list:
        return list(self.seen)


def test_a_message_after_a_failure_waits_for_its_supervise():
    """Monarch's order: the owner handles a failure before the messages that reach it afterwards, even when
    `__supervise__` is slow (a caller holding a reference to the mesh asks the owner right after its call
    failed)."""
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    children = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        sup = pm.spawn("slow", SlowSupervisor, children)
        mesh = sup.get_mesh.call_one().get(timeout=TIMEOUT)
        with pytest.raises(SupervisionError):
            mesh.fail.call().get(timeout=TIMEOUT)
        time.sleep(0.1)  # the owner's failure report left the failed proc with the reply; let it land
        assert sup.seen_failures.call_one().get(timeout=TIMEOUT) == [[0]]
    finally:
        pm.stop().get(timeout=TIMEOUT)
        children.stop().get(timeout=TIMEOUT)
