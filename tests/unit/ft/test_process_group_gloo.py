"""The replicated group on Gloo: a peer that stops responding makes the collective fail within the timeout,
the group reports errored(), and the next configure works. The peer is a real process, frozen with SIGSTOP."""

from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from regent.ft.process_group import ReplicatedGroup, _Watchdog, parse_store_address
from tests.support.ft_harness import gloo_groups


def test_parse_store_address():
    assert parse_store_address("127.0.0.1:29500/regent/3/1") == ("127.0.0.1", 29500, "/regent/3/1")
    assert parse_store_address("[::1]:5/x") == ("::1", 5, "/x")
    with pytest.raises(ValueError, match="host:port/prefix"):
        parse_store_address("nohost/x")


def test_watchdog_fires_and_cancels():
    dog = _Watchdog()
    fired = threading.Event()
    cancelled = threading.Event()
    dog.schedule(0.05, fired.set)
    token = dog.schedule(0.05, cancelled.set)
    dog.cancel(token)
    assert fired.wait(5)
    time.sleep(0.2)
    assert not cancelled.is_set()


def test_unconfigured_group_names_the_fix():
    group = ReplicatedGroup("gloo")
    with pytest.raises(RuntimeError, match="not configured"):
        group.allreduce(torch.zeros(1))


def test_batched_p2p_falls_back_when_the_backend_cannot_coalesce():
    """The coalesced path is NCCL's; a backend that refuses to start coalescing (Gloo here, forced onto that
    path) must still deliver the whole batch, message by message, and stop trying."""
    sent = [torch.arange(n, dtype=torch.float32) for n in (3, 5, 7)]
    got = [torch.zeros(n) for n in (3, 5, 7)]
    with gloo_groups(timeout=10) as groups, ThreadPoolExecutor(2) as pool:
        for g in groups:
            g._pg = _ClaimsCoalescing(g._pg)
        f = pool.submit(groups[0].send_many, sent, 1, 10)
        groups[1].recv_many(got, 0, 10)
        f.result()
    assert all(torch.equal(a, b) for a, b in zip(sent, got))
    assert not groups[0].coalesce_p2p and not groups[1].coalesce_p2p


class _ClaimsCoalescing:
    """The real Gloo group, claiming to coalesce, so the batch takes the coalesced path (Gloo refuses it)."""

    supports_coalescing = True

    def __init__(self, pg: dist.ProcessGroupGloo) -> None:
        self._inner = pg

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_rendezvous_with_a_peer_that_never_comes_is_given_up_on_abort_or_timeout():
    # The peer of quorum N dies between the quorum and the rendezvous: a supervisor's report (abort) ends
    # the wait at once; without one, `connect_timeout` does. Either way the group can be configured again.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    group = ReplicatedGroup("gloo", timeout=2.0, connect_timeout=20.0)
    timer = threading.Timer(0.5, lambda: group.abort(RuntimeError("peer replica r1 reported failed")))
    timer.start()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="given up: peer replica r1 reported failed"):
        group.configure(f"127.0.0.1:{store.port}/regent/1/0", "r0", 0, 2)
    assert time.monotonic() - start < 5
    assert group.errored() is not None

    impatient = ReplicatedGroup("gloo", timeout=5.0, connect_timeout=1.0)  # gloo's own wait would be 5 s
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="timed out after 1 s"):
        impatient.configure(f"127.0.0.1:{store.port}/regent/2/0", "r0", 0, 2)
    assert time.monotonic() - start < 5

    # Both can still form a group with a live peer afterwards.
    peer = ReplicatedGroup("gloo", timeout=5.0, connect_timeout=20.0)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda pair: pair[0].configure(f"127.0.0.1:{store.port}/regent/3/0", f"r{pair[1]}",
                                                     pair[1], 2), [(group, 0), (peer, 1)]))
    t = torch.ones(3)
    futures = [g.allreduce([x]) for g, x in ((group, t), (peer, torch.ones(3)))]
    for f in futures:
        f.wait()
    assert torch.equal(t, torch.full((3,), 2.0))
    for g in (group, peer, impatient):
        g.shutdown()


def test_rendezvous_whose_store_host_died_is_given_up_on_abort():
    # The quorum's primary (the store's host) dies between the quorum and the rendezvous: the store client
    # retries its connect for the whole connect timeout. A supervisor's report must end that wait too (the
    # soak saw a member stuck there for 139 s while its peers' failures were reported).
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again below: nothing listens there
    group = ReplicatedGroup("gloo", timeout=2.0, connect_timeout=10.0)
    timer = threading.Timer(0.5, lambda: group.abort(RuntimeError("peer replica r0 reported failed")))
    timer.start()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="given up: peer replica r0 reported failed"):
        group.configure(f"127.0.0.1:{dead}/regent/1/1", "r1", 1, 2)
    assert time.monotonic() - start < 5
    group.shutdown()


def test_staged_collectives_copy_back_and_reuse_their_host_buffers():
    # The path Gloo takes for GPU tensors (replicas sharing a GPU): host copies, the result copied back before
    # the future resolves, AVG divided on the host, the buffers reused (not one new copy per step). Run here on
    # CPU tensors with the staging forced; on a GPU it is benchmarks/gpu/heal_one_gpu.sh.
    with gloo_groups() as groups:
        for g in groups:
            g.stage_host_tensors = True
        for step in range(3):
            xs = [torch.full((5, 3), float(r + 1 + step)) for r in range(2)]
            ys = [torch.arange(4, dtype=torch.float64) * (r + 1) for r in range(2)]
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda r, xs=xs: groups[r].allreduce([xs[r]], dist.ReduceOp.AVG).wait(), range(2)))
                list(pool.map(lambda r, ys=ys: groups[r].allreduce(ys[r], dist.ReduceOp.AVG).wait(), range(2)))
            for r in range(2):
                assert xs[r].tolist() == [[1.5 + step + 0.0] * 3] * 5
                assert ys[r].tolist() == [0.0, 1.5, 3.0, 4.5]
            bs = [torch.full((2,), float(r * 10 + step)) for r in range(2)]
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda r, bs=bs: groups[r].broadcast(bs[r], 1).wait(), range(2)))
            assert [b.tolist() for b in bs] == [[10.0 + step] * 2] * 2
        for g in groups:  # one buffer per shape and dtype, kept for the next step
            assert sorted((str(k[0]), k[1], len(v)) for k, v in g._staging.items()) == [
                ("torch.float32", 2, 1), ("torch.float32", 15, 1), ("torch.float64", 4, 1)]


def test_an_abort_after_every_operation_completed_leaves_their_results_valid():
    # Seen in a full test run: replica 0 committed a DiLoCo sync and then died; the supervisor's notice aborted
    # replica 1's group after its allreduce of that sync had completed, and replica 1 voted no on the strength of
    # `errored()` alone: the run's newest committed step then lived only in the dead replica (a lineage reset).
    with gloo_groups(timeout=10.0) as groups:
        tensors = [torch.full((4,), float(r + 1)) for r in range(2)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: groups[r].allreduce([tensors[r]], dist.ReduceOp.SUM).wait(), range(2)))
        assert all(torch.equal(t, torch.full((4,), 3.0)) for t in tensors)
        groups[1].abort(RuntimeError("peer replica_0 reported failed"), wait=False, fail_pending=True)
        assert groups[1].errored() is not None
        assert not groups[1].error_hit_operations()  # the completed allreduce stands
        with pytest.raises(RuntimeError, match="not configured|aborted"):
            groups[1].allreduce([tensors[1]], dist.ReduceOp.SUM).wait()
        assert groups[1].error_hit_operations()  # an operation tried after the abort: the step cannot commit


def test_an_abort_with_an_operation_in_flight_reaches_it():
    with gloo_groups(timeout=10.0) as groups:
        work = groups[0].allreduce([torch.ones(4)], dist.ReduceOp.SUM)  # its peer never joins
        time.sleep(0.1)
        groups[0].abort(RuntimeError("peer replica_1 reported failed"), wait=False, fail_pending=True)
        with pytest.raises(RuntimeError, match="reported failed"):
            work.wait()
        assert groups[0].error_hit_operations()


def test_an_abort_reaches_a_point_to_point_wait_that_asked_for_it():
    """Gloo cannot cancel a posted receive; an abortable one is still released by an abort with fail_pending
    (a peer reported dead) instead of waiting out the timeout. A completed abortable transfer is unchanged."""
    with gloo_groups(timeout=10.0) as groups:
        x, y = torch.arange(6.0), torch.zeros(6)
        with ThreadPoolExecutor(2) as pool:
            sent = pool.submit(groups[0].send, [x], 1, 3, True)
            groups[1].recv([y], 0, tag=3, abortable=True)
            sent.result(timeout=10)
        assert torch.equal(x, y) and groups[1].errored() is None

        header = torch.zeros(16, dtype=torch.uint8)
        threading.Timer(0.3, lambda: groups[1].abort(RuntimeError("peer replica_2 reported failed"), wait=False,
                                                     fail_pending=True)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="reported failed"):
            groups[1].recv([header], 0, tag=4, abortable=True)  # nobody sends it
        assert time.monotonic() - start < 5  # not the 10 s timeout
        assert groups[1].error_hit_operations()  # the abort reached an operation: that step cannot commit


def test_an_abort_decided_about_one_build_does_not_hit_the_next():
    """A supervisor's notice about a dead peer is decided against the build of the group it saw. If the group
    was rebuilt meanwhile (without that peer), the abort must not give up the new build (a soak: a notice about
    quorum 36 cancelled quorum 37's rendezvous, and its other member waited 20 s in its first allreduce)."""
    with gloo_groups(timeout=10.0) as groups:
        seen = groups[1].generation()
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        addr = f"127.0.0.1:{store.port}/regent/2/0"
        with ThreadPoolExecutor(2) as pool:  # the next build
            list(pool.map(lambda r: groups[r].configure(addr, f"r{r}", r, 2), range(2)))
        assert groups[1].abort(RuntimeError("peer replica_2 reported failed"), wait=False, fail_pending=True,
                               only_generation=seen) is False
        assert groups[1].errored() is None
        xs = [torch.full((3,), float(r + 1)) for r in range(2)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: groups[r].allreduce([xs[r]], dist.ReduceOp.SUM).wait(), range(2)))
        assert torch.equal(xs[1], torch.full((3,), 3.0))
        # a notice about the current build still aborts it
        assert groups[1].abort(RuntimeError("peer replica_0 reported failed"), wait=False, fail_pending=True,
                               only_generation=groups[1].generation()) is True
        assert "reported failed" in str(groups[1].errored())
