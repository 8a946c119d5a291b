"""A member whose step failed tells its build's peers (`regent.ft.build_notice`): their collectives waiting for it
fail at once instead of at the timeout. Pure rules, then real Gloo groups and real Managers in this process."""

from __future__ import annotations

import datetime
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from regent.ft import build_notice
from regent.ft.build_notice import next_read_after, suspect_after
from regent.ft.lighthouse import LighthouseServer
from regent.ft.manager import Manager
from regent.ft.process_group import FakeProcessGroupWrapper, ReplicatedGroup
from tests.support.ft_harness import gloo_groups


def test_an_operation_is_suspect_only_well_past_its_usual_time():
    assert suspect_after([], 60) == build_notice.DEFAULT_SUSPECT_S
    assert suspect_after([0.001] * 16, 60) == build_notice.MIN_SUSPECT_S  # fast collectives: the floor
    assert suspect_after([2.0, 2.1, 1.9], 60) == pytest.approx(4 * 2.0)  # slow but steady: 4x the median
    assert suspect_after([2.0, 2.0, 50.0], 60) == pytest.approx(8.0)  # one outlier does not move it
    assert suspect_after([20.0], 10) == 5.0  # never past half the timeout
    assert next_read_after(0.25, 60) == 0.5
    assert next_read_after(8.0, 20) == 5.0  # reads keep coming before the timeout


def test_a_peer_that_abandons_the_build_fails_the_waiting_collective_at_once():
    with gloo_groups(timeout=30.0) as groups:
        for _ in range(3):  # a few quick operations: the usual time is milliseconds
            works = [g.allreduce(torch.ones(2)) for g in groups]
            [w.wait() for w in works]
        start = time.monotonic()
        waiting = groups[1].allreduce(torch.ones(2))  # rank 0 will never issue its half
        time.sleep(0.3)
        assert groups[0].announce_abandoned("r0")
        with pytest.raises(RuntimeError, match="peer replica r0 abandoned this build"):
            waiting.wait()
        assert time.monotonic() - start < 10  # the timeout is 30 s
        assert groups[1].errored() is not None and groups[1].error_hit_operations()
        assert groups[0].errored() is None  # the announcer's own group is not touched


def test_the_notice_stays_with_its_build():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    groups = [ReplicatedGroup("gloo", timeout=30.0, connect_timeout=30) for _ in range(2)]
    port = store.port

    def configure(build: int) -> None:
        addr = f"127.0.0.1:{port}/regent/{build}/0"
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: groups[r].configure(addr, f"r{r}", r, 2), range(2)))

    try:
        configure(1)
        groups[0].announce_abandoned("r0")
        time.sleep(0.3)  # the write has landed under build 1's prefix
        configure(2)
        works = [g.allreduce(torch.ones(2)) for g in groups]
        time.sleep(1.5)  # a slow operation would have been read by now; these just finish
        assert [w.wait()[0].tolist() for w in works] == [[2.0, 2.0], [2.0, 2.0]]
        assert groups[1].errored() is None
    finally:
        for g in groups:
            g.shutdown()
        del store


def test_a_failed_replica_does_not_leave_its_peer_waiting_for_the_collectives_it_skips():
    """The race TorchFT's commit-failure cases hit: replica 0's first allreduce fails (injected), so it skips the
    second; replica 1 issued the second before it learned anything. Replica 1 must not wait out its 20 s
    collective timeout, which would outlast replica 0's quorum timeout."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=200)
    weights = [torch.zeros(2), torch.zeros(2)]
    groups = [FakeProcessGroupWrapper(ReplicatedGroup("gloo", timeout=20, connect_timeout=20)) for _ in range(2)]
    managers = [
        Manager(pg=groups[r], load_state_dict=lambda sd, r=r: weights[r].copy_(sd["w"]),
                state_dict=lambda r=r: {"w": weights[r]}, min_replica_size=2, use_async_quorum=False,
                timeout=20, quorum_timeout=20, connect_timeout=20, lighthouse_addr=lighthouse.address(),
                replica_id=f"rep{r}", store_addr="127.0.0.1", store_port=0)
        for r in range(2)
    ]

    def step(r: int, inject: bool) -> tuple[bool, float]:
        m = managers[r]
        m.start_quorum()
        start = time.monotonic()
        if inject:
            groups[r].report_future_error(RuntimeError("injected allreduce error"))
        first = m.allreduce(torch.ones(2))
        if inject:
            first.wait()  # the error is reported before the second: this replica skips it
        second = m.allreduce(torch.ones(2))
        first.wait()
        second.wait()
        return m.should_commit(), time.monotonic() - start

    try:
        with ThreadPoolExecutor(2) as pool:
            assert [f.result() for f in [pool.submit(step, r, False) for r in range(2)]][0][0]
            failed = [pool.submit(step, r, r == 0) for r in range(2)]
            (commit0, _), (commit1, seconds1) = [f.result(timeout=60) for f in failed]
            assert not commit0 and not commit1
            assert seconds1 < 10, f"replica 1 waited {seconds1:.1f} s for a collective replica 0 skipped"
            again = [pool.submit(step, r, False) for r in range(2)]  # the next quorum rebuilds; both train on
            assert all(f.result(timeout=60)[0] for f in again)
        assert [m.current_step() for m in managers] == [2, 2]
    finally:
        for m in managers:
            m.shutdown()
        lighthouse.shutdown()


def test_a_dropped_group_is_freed_at_once_and_its_notice_thread_ends():
    """No reference cycle through the notice: a group nobody holds is freed by reference counting, not left to the
    cyclic collector (which could destroy a live Gloo communicator during interpreter shutdown: "terminate called
    without an active exception")."""
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    with gloo_groups(timeout=1.0) as groups:
        works = [g.allreduce(torch.ones(2)) for g in groups]
        [w.wait() for w in works]
        groups[0].announce_abandoned("r0")  # starts the notice's thread
        time.sleep(1.5)  # the watchdog's entries for the operation (its timeout) have passed
        refs = [weakref.ref(g) for g in groups]
    notices = [t for t in set(threading.enumerate()) - before if t.name == "regent-ft-build-notice"]
    assert notices
    gc.disable()
    try:
        del groups, works
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
    for t in notices:
        t.join(5)
    assert not any(t.is_alive() for t in notices)
