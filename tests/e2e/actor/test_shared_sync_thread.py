"""`config.shared_asyncio_runtime` (Monarch's knob): every sync actor of a process runs on one shared thread.

Real procs (this host), several sync actors per proc (`ProcMesh.colocated`). What must hold as with a thread per
actor: each actor's endpoints and `__init__` run on one thread (thread-local state), messages to one actor stay in
order, an endpoint's error goes back to its caller, an actor that dies takes no sibling with it, stop runs
`__cleanup__`, supervision reaches a sync owner. What changes, as in Monarch: the process's sync actors no longer
run concurrently.
"""

import os
import threading
import time

import pytest

import regent.actor
from regent.actor import Actor, ActorError, SupervisionError, current_rank, endpoint, this_host
from regent.actor._config import RuntimeConfig, config

TIMEOUT = 60


@pytest.fixture
def shared_mode():
    before = config.shared_asyncio_runtime
    config.configure(shared_asyncio_runtime=True)  # read by the procs spawned below (child_env)
    try:
        yield
    finally:
        config.configure(shared_asyncio_runtime=before)


class Tls(Actor):
    def __init__(self, cleanup_file: str | None = None):
        self.local = threading.local()
        self.local.count = 0
        self.init_thread = threading.get_ident()
        self.cleanup_file = cleanup_file
        self.seen: list[int] = []

    @endpoint
    def where(self) -> tuple:
        self.local.count += 1
        return os.getpid(), threading.get_ident(), self.init_thread, self.local.count, threading.current_thread().name

    @endpoint
    def record(self, x: int) -> None:
        self.seen.append(x)

    @endpoint
    def history(self) -> list:
        return list(self.seen)

    @endpoint
    def refuse_on(self, rank: int) -> int:
        if current_rank().rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return rank

    @endpoint
    def die(self) -> None:
        raise KeyboardInterrupt("this actor dies")  # a BaseException: kills the actor, not only the call

    @endpoint
    def nap(self, seconds: float) -> float:
        start = time.monotonic()
        time.sleep(seconds)
        return start

    @endpoint
    def now(self) -> float:
        return time.monotonic()

    def __cleanup__(self, exc):
        if self.cleanup_file:
            with open(f"{self.cleanup_file}.{current_rank().rank}", "w") as f:
                f.write(str(threading.get_ident()))


def test_sync_actors_of_a_proc_share_one_thread_and_keep_their_thread_local_state(shared_mode):
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        mesh = pm.colocated("actors", 4).spawn("tls", Tls)
        mesh.where.call().get(timeout=TIMEOUT)
        rows = list(mesh.where.call().get(timeout=TIMEOUT).values())
        assert len(rows) == 8
        by_proc: dict[int, set] = {}
        for pid, ident, init_ident, count, name in rows:
            by_proc.setdefault(pid, set()).add(ident)
            assert ident == init_ident  # __init__ ran on the thread its endpoints run on
            assert count == 2  # thread-local state set in __init__ lasts across endpoints
            assert name == "actors-shared"
        assert len(by_proc) == 2 and all(len(idents) == 1 for idents in by_proc.values()), by_proc
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_order_errors_death_and_cleanup_on_the_shared_thread(shared_mode, tmp_path, monkeypatch):
    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)  # the death reaches the root
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        mesh = pm.colocated("actors", 3).spawn("tls", Tls, str(tmp_path / "cleanup"))
        for x in range(20):
            mesh.record.broadcast(x)
        assert all(h == list(range(20)) for h in mesh.history.call().get(timeout=TIMEOUT).values())
        with pytest.raises(ActorError, match="rank 1 refuses"):
            mesh.refuse_on.call(1).get(timeout=TIMEOUT)
        assert sorted(mesh.refuse_on.call(5).get(timeout=TIMEOUT).values()) == [5, 5, 5]  # all still alive
        # actor 2 dies; its siblings on the same thread answer on
        with pytest.raises(SupervisionError):
            mesh.slice(actors=2).die.call_one().get(timeout=TIMEOUT)
        assert mesh.slice(actors=0).where.call_one().get(timeout=TIMEOUT)[3] >= 1
        assert mesh.slice(actors=1).refuse_on.call_one(7).get(timeout=TIMEOUT) == 7
        with pytest.raises(SupervisionError):
            mesh.slice(actors=2).where.call_one().get(timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while not faults and time.monotonic() < deadline:
            time.sleep(0.05)
        assert faults and "this actor dies" in str(faults[0])  # its owner (here the root) was told
        mesh.slice(actors=0).stop().get(timeout=TIMEOUT)
        assert (tmp_path / "cleanup.0").exists()  # __cleanup__ ran, on the shared thread
        assert mesh.slice(actors=1).refuse_on.call_one(8).get(timeout=TIMEOUT) == 8
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_a_blocking_endpoint_holds_up_the_other_sync_actors_of_its_process(shared_mode):
    # Monarch's trade-off for the shared runtime: one thread, so the process's sync actors take turns.
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        mesh = pm.colocated("actors", 2).spawn("tls", Tls)
        mesh.where.call().get(timeout=TIMEOUT)
        napping = mesh.slice(actors=0).nap.call_one(1.0)
        time.sleep(0.2)
        answered = mesh.slice(actors=1).now.call_one().get(timeout=TIMEOUT)
        started = napping.get(timeout=TIMEOUT)
        assert answered - started >= 0.9
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_without_the_knob_every_sync_actor_has_a_thread_of_its_own():
    assert not config.shared_asyncio_runtime
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        mesh = pm.colocated("actors", 3).spawn("tls", Tls)
        idents = {row[1] for row in mesh.where.call().get(timeout=TIMEOUT).values()}
        assert len(idents) == 3
    finally:
        pm.stop().get(timeout=TIMEOUT)


def test_the_knob_is_read_from_regent_or_monarch_environment(monkeypatch):
    monkeypatch.delenv("REGENT_SHARED_ASYNCIO_RUNTIME", raising=False)
    monkeypatch.delenv("HYPERACTOR_SHARED_ASYNCIO_RUNTIME", raising=False)
    assert RuntimeConfig.from_env().shared_asyncio_runtime is False
    monkeypatch.setenv("HYPERACTOR_SHARED_ASYNCIO_RUNTIME", "true")
    assert RuntimeConfig.from_env().shared_asyncio_runtime is True
    monkeypatch.setenv("REGENT_SHARED_ASYNCIO_RUNTIME", "0")  # Regent's name wins
    assert RuntimeConfig.from_env().shared_asyncio_runtime is False
    monkeypatch.setenv("REGENT_SHARED_ASYNCIO_RUNTIME", "maybe")
    with pytest.raises(ValueError, match="not a boolean"):
        RuntimeConfig.from_env()
    cfg = RuntimeConfig()
    cfg.configure(shared_asyncio_runtime=True)
    assert cfg.child_env()["REGENT_SHARED_ASYNCIO_RUNTIME"] == "1"


class Asker(Tls):
    @endpoint
    def ask(self, other) -> float:
        return other.now.call_one().get(timeout=TIMEOUT)


def test_waiting_on_a_sibling_of_the_shared_thread_is_refused_not_hung(shared_mode):
    # Invariant: no wait is unbounded. The sibling cannot run until this endpoint returns, so get() raises.
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    other = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        mesh = pm.colocated("actors", 2).spawn("ask", Asker)
        elsewhere = other.spawn("far", Tls)
        started = time.monotonic()
        with pytest.raises(ActorError, match="would never return"):
            mesh.slice(actors=0).ask.call_one(mesh.slice(actors=1)).get(timeout=TIMEOUT)
        assert time.monotonic() - started < TIMEOUT / 2
        # an actor in another process is fine to wait for
        assert mesh.slice(actors=0).ask.call_one(elsewhere).get(timeout=TIMEOUT) > 0
    finally:
        pm.stop().get(timeout=TIMEOUT)
        other.stop().get(timeout=TIMEOUT)
