"""Supervision: which failures kill an actor, who hears about them, and that nothing hangs."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import regent.actor
from regent.actor import Actor, ActorError, MeshFailure, SupervisionError, endpoint, this_host

TIMEOUT = 60


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def faults(monkeypatch):
    got = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", got.append)
    return got


class Worker(Actor):
    def __init__(self, fail_init: bool = False):
        if fail_init:
            raise ValueError("init went wrong")

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def ok(self) -> str:
        return "ok"

    @endpoint
    def raise_value_error(self) -> None:
        def inner():
            raise ValueError("endpoint went wrong")

        inner()

    @endpoint
    def raise_base(self) -> None:
        raise SystemExit("base exception")

    @endpoint
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s

    @endpoint
    def hard_exit(self, code: int) -> None:
        os._exit(code)

    @endpoint
    def segfault(self) -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    @endpoint(explicit_response_port=True)
    def explicit_raises(self, port) -> None:
        raise RuntimeError("explicit port endpoint raised")


@pytest.fixture
def two():
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    yield pm
    pm.stop().get(timeout=TIMEOUT)


def test_exception_with_reply_port_is_actor_error_and_actor_survives(two, faults):
    w = two.spawn("w", Worker)
    with pytest.raises(ActorError) as info:
        w.raise_value_error.call().get(timeout=TIMEOUT)
    text = str(info.value)
    assert "Traceback of where the remote call failed" in text
    assert "endpoint went wrong" in text and "inner" in text
    assert isinstance(info.value.exception, ValueError)
    assert w.ok.call().get(timeout=TIMEOUT).values() == ["ok", "ok"]
    time.sleep(0.2)
    assert faults == []


def test_broadcast_exception_kills_actor_and_reaches_owner(two, faults):
    w = two.spawn("bw", Worker)
    w.slice(gpus=0).raise_value_error.broadcast()
    assert wait_for(lambda: faults)
    failure = faults[0]
    assert isinstance(failure, MeshFailure)
    assert failure.mesh_name == "bw" and failure.crashed_ranks == [0]
    assert "MeshFailure" in str(failure) and "crashed_ranks=[0]" in str(failure)
    assert "endpoint went wrong" in failure.report()
    # the failed rank poisons every slice that contains it, including ones made later ...
    with pytest.raises(SupervisionError, match=r'failure on mesh "bw" at rank 0 '):
        w.ok.call().get(timeout=TIMEOUT)
    with pytest.raises(SupervisionError):
        w.slice(gpus=slice(0, 1)).ok.call().get(timeout=TIMEOUT)
    # ... and slices without it keep working
    assert w.slice(gpus=1).ok.call_one().get(timeout=TIMEOUT) == "ok"
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(failure)


def test_ranks_failing_together_reach_the_owner_one_failure_per_rank(faults):
    # Issue 35: as in Monarch, a broadcast that raises on every rank reaches the owner as one MeshFailure per
    # rank (issue 18 had gathered them into one naming all ranks: Monarch programs counting failures hung).
    pm = this_host().spawn_procs(per_host={"gpus": 4})
    try:
        w = pm.spawn("all4", Worker)
        w.raise_value_error.broadcast()
        assert wait_for(lambda: len(faults) >= 4)
        time.sleep(0.5)  # anything still to come would have arrived by now
        assert sorted(f.crashed_ranks for f in faults) == [[0], [1], [2], [3]]
        assert all(f.mesh_name == "all4" and "endpoint went wrong" in f.report() for f in faults)
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_base_exception_kills_actor_even_with_reply_port(two, faults):
    w = two.spawn("base", Worker)
    with pytest.raises(SupervisionError, match=r"The actor .* and all its descendants have failed"):
        w.slice(gpus=1).raise_base.call_one().get(timeout=TIMEOUT)
    assert wait_for(lambda: faults)
    assert faults[0].crashed_ranks == [1] and "base exception" in faults[0].report()
    with pytest.raises(SupervisionError, match=r"failure on mesh .*at rank 1 "):
        w.slice(gpus=1).ok.call_one().get(timeout=TIMEOUT)


def test_explicit_port_endpoint_raising_kills_actor(two, faults):
    w = two.spawn("explicit", Worker)
    with pytest.raises(SupervisionError):
        w.slice(gpus=0).explicit_raises.call_one().get(timeout=TIMEOUT)
    assert wait_for(lambda: faults)
    assert "explicit port endpoint raised" in faults[0].report()


def test_init_failure_is_a_supervision_event(two, faults):
    w = two.spawn("badinit", Worker, True)
    with pytest.raises(SupervisionError):
        w.initialized.get(timeout=TIMEOUT)
    # both ranks failed in __init__: one MeshFailure each
    assert wait_for(lambda: sorted(f.crashed_ranks for f in faults) == [[0], [1]])
    assert all("badinit" in str(f) and "init went wrong" in str(f) for f in faults)
    with pytest.raises(SupervisionError):
        w.ok.call().get(timeout=TIMEOUT)


@pytest.mark.parametrize("how,expect", [("kill9", "Killed(sig=9)"), ("exit", "Exited(3)"),
                                        ("segv", "Killed(sig=11)")])
def test_process_death_fails_inflight_calls_and_reaches_owner(faults, how, expect):
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    w = pm.spawn("victim", Worker)
    killer = pm.spawn("killer", Worker)  # another actor on the same procs (the victim is busy)
    pid = w.slice(gpus=1).pid.call_one().get(timeout=TIMEOUT)
    inflight = w.slice(gpus=1).sleep.call_one(30)
    if how == "kill9":
        os.kill(pid, signal.SIGKILL)
    elif how == "exit":
        killer.slice(gpus=1).hard_exit.broadcast(3)
    else:
        killer.slice(gpus=1).segfault.broadcast()
    with pytest.raises(SupervisionError, match="failed") as info:
        inflight.get(timeout=TIMEOUT)
    assert expect in str(info.value)
    assert wait_for(lambda: len(faults) >= 2)
    assert {f.mesh_name for f in faults} == {"victim", "killer"}
    assert all(f.crashed_ranks == [1] for f in faults)
    assert f"the process this actor was running on failed: {expect}" in faults[0].report()
    assert w.slice(gpus=0).ok.call_one().get(timeout=TIMEOUT) == "ok"
    t0 = time.monotonic()
    pm.stop().get(timeout=TIMEOUT)  # must not hang with a dead proc
    assert time.monotonic() - t0 < 30
    again = this_host().spawn_procs(per_host={"gpus": 1})
    assert again.spawn("again", Worker).ok.call_one().get(timeout=TIMEOUT) == "ok"
    again.stop().get(timeout=TIMEOUT)


class Child(Actor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def step(self, i: int) -> int:
        if i < 0:
            raise SystemExit("child died")
        return i


class Owner(Actor):
    """Owns a child mesh; `handle` decides whether __supervise__ handles failures."""

    def __init__(self, handle: bool):
        self.handle = handle
        self.seen = []
        self.generation = 0
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.children = self.procs.spawn("child", Child)

    async def __supervise__(self, failure):
        self.seen.append((failure.mesh_name, failure.crashed_ranks, failure.report()))
        if not self.handle:
            return False
        await self.procs.stop()
        self.generation += 1
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.children = self.procs.spawn(f"child{self.generation}", Child)
        return True

    @endpoint
    async def child_pids(self) -> list:
        return list((await self.children.pid.call()).values())

    @endpoint
    async def step(self, i: int):
        try:
            return list((await self.children.step.call(i)).values())
        except SupervisionError as exc:
            return f"SupervisionError: {exc}"

    @endpoint
    async def seen_failures(self) -> list:
        return self.seen


def test_owner_supervise_handles_and_restarts(faults):
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        owner = pm.spawn("owner", Owner, True)
        pids = owner.child_pids.call_one().get(timeout=TIMEOUT)
        os.kill(pids[0], signal.SIGKILL)
        assert wait_for(lambda: owner.seen_failures.call_one().get(timeout=TIMEOUT))
        seen = owner.seen_failures.call_one().get(timeout=TIMEOUT)
        assert seen[0][0] == "child" and seen[0][1] == [0] and "Killed(sig=9)" in seen[0][2]

        def restarted():
            try:
                return set(owner.child_pids.call_one().get(timeout=TIMEOUT)).isdisjoint(pids)
            except ActorError:
                return False  # __supervise__ is still replacing the children

        assert wait_for(restarted)
        result = owner.step.call_one(-1).get(timeout=TIMEOUT)
        assert result.startswith("SupervisionError") and "child died" in result
        assert wait_for(lambda: len(owner.seen_failures.call_one().get(timeout=TIMEOUT)) >= 2)
        assert wait_for(lambda: owner.step.call_one(5).get(timeout=TIMEOUT) == [5, 5], timeout=60)
        assert faults == []
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_owner_escalates_when_supervise_returns_false(faults):
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        owner = pm.spawn("escalating", Owner, False)
        pids = owner.child_pids.call_one().get(timeout=TIMEOUT)
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: faults)
        failure = faults[0]
        assert failure.mesh_name == "escalating"
        assert "UnhandledSupervisionEvent" in failure.report() and "child" in failure.report()
        with pytest.raises(SupervisionError):
            owner.child_pids.call_one().get(timeout=TIMEOUT)
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_default_fault_hook_exits_with_code_1(tmp_path):
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent("""
        import atexit, time
        from regent.actor import Actor, endpoint, this_host

        class W(Actor):
            @endpoint
            def boom(self):
                raise ValueError("nobody handles this")

        atexit.register(lambda: print("ATEXIT-RAN", flush=True))
        pm = this_host().spawn_procs(per_host={"gpus": 1})
        pm.spawn("w", W).boom.broadcast()
        time.sleep(60)
        print("NOT-REACHED", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr
    assert "nobody handles this" in proc.stderr
    assert "ATEXIT-RAN" in proc.stdout and "NOT-REACHED" not in proc.stdout


class SyncOwner(Actor):
    def __init__(self):
        self.seen = []
        self.procs = this_host().spawn_procs(per_host={"gpus": 1})
        self.child = self.procs.spawn("sync_child", Worker)

    def __supervise__(self, failure):
        self.seen.append(failure.report())
        return True

    @endpoint
    def child_pid(self) -> int:
        return self.child.pid.call_one().get(timeout=TIMEOUT)

    @endpoint
    def seen_failures(self) -> list:
        return self.seen


def test_sync_owner_supervise(faults):
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        owner = pm.spawn("sync_owner", SyncOwner)
        os.kill(owner.child_pid.call_one().get(timeout=TIMEOUT), signal.SIGKILL)
        assert wait_for(lambda: owner.seen_failures.call_one().get(timeout=TIMEOUT))
        assert "Killed(sig=9)" in owner.seen_failures.call_one().get(timeout=TIMEOUT)[0]
        assert faults == []
    finally:
        pm.stop().get(timeout=TIMEOUT)


class BrokenController(Actor):
    def __init__(self):
        raise RuntimeError("controller cannot start")

    @endpoint
    def hello(self) -> str:
        return "hi"


def test_failed_controller_is_reported_on_next_lookup(faults):
    from regent.actor import get_or_spawn_controller

    ctl = get_or_spawn_controller("broken_ctl", BrokenController).get(timeout=TIMEOUT)
    with pytest.raises(SupervisionError):
        ctl.hello.call_one().get(timeout=TIMEOUT)

    def failed():
        try:
            get_or_spawn_controller("broken_ctl", BrokenController).get(timeout=TIMEOUT)
        except ValueError as exc:
            return "Failure on broken_ctl" in str(exc) and "controller cannot start" in str(exc)
        return False

    assert wait_for(failed)
    assert faults == []
