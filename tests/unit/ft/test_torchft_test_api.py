"""The pieces of TorchFT's API its own integration tests lean on: the error-injecting group wrapper, the
documented coordination classes, timedelta timeouts with TorchFT's deadline wording, and the Manager's state
in TorchFT's layout. Real Gloo groups and a real Lighthouse, in this process."""

from __future__ import annotations

import datetime
import inspect
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from regent.ft import coordination
from regent.ft.lighthouse import LighthouseServer
from regent.ft.manager import Manager
from regent.ft.process_group import FakeProcessGroupWrapper, ProcessGroupWrapper, ReplicatedGroup


def _wrapped_pair() -> tuple[dist.TCPStore, list[FakeProcessGroupWrapper]]:
    """Two wrapped Gloo groups (ranks 0 and 1) configured at one store, the way the Manager configures them."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    groups = [FakeProcessGroupWrapper(ReplicatedGroup("gloo", timeout=5, connect_timeout=30)) for _ in range(2)]
    _configure(groups, f"127.0.0.1:{store.port}/regent/1/0")
    return store, groups


def _configure(groups: list[FakeProcessGroupWrapper], addr: str) -> None:
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: groups[r].configure(addr, f"r{r}", r, 2), range(2)))


def test_injected_error_fails_only_the_next_allreduce_future():
    store, groups = _wrapped_pair()
    try:
        assert groups[0].size() == 2 and groups[1].rank() == 1  # everything else is the wrapped group's
        groups[0].report_future_error(RuntimeError("injected"))
        tensors = [torch.full((3,), float(r + 1)) for r in range(2)]
        works = [g.allreduce([t]) for g, t in zip(groups, tensors)]
        with pytest.raises(RuntimeError, match="injected"):
            works[0].wait()
        assert works[1].wait()[0].tolist() == [3.0, 3.0, 3.0]  # the collective ran: the peer was not left waiting
        assert tensors[0].tolist() == [3.0, 3.0, 3.0]
        assert groups[0].errored() is None  # the group itself is healthy
        # the error was used up: the next allreduce succeeds on both
        works = [g.allreduce(torch.ones(2)) for g in groups]
        assert [w.wait()[0].tolist() for w in works] == [[2.0, 2.0], [2.0, 2.0]]
    finally:
        for g in groups:
            g.shutdown()
        del store


def test_a_new_quorum_drops_an_unused_error():
    store, groups = _wrapped_pair()
    try:
        groups[1].report_future_error(RuntimeError("never used"))
        _configure(groups, f"127.0.0.1:{store.port}/regent/2/0")
        works = [g.allreduce(torch.ones(1)) for g in groups]
        assert [w.wait()[0].item() for w in works] == [2.0, 2.0]
    finally:
        for g in groups:
            g.shutdown()
        del store


def test_plain_wrapper_builds_and_forwards():
    wrapper = ProcessGroupWrapper(timeout=3)
    assert isinstance(wrapper.parent, ReplicatedGroup) and wrapper.parent.timeout == 3
    with pytest.raises(RuntimeError, match="not configured"):
        wrapper.allreduce(torch.zeros(1))
    assert "ProcessGroupWrapper(pg=" in repr(wrapper)


def test_coordination_classes_document_their_arguments():
    for cls in (coordination.ManagerClient, coordination.ManagerServer, coordination.LighthouseServer,
                coordination.LighthouseClient, coordination.Quorum, coordination.QuorumMember):
        assert "Args:" in (inspect.getdoc(cls) or ""), cls


def test_timedelta_quorum_timeout_uses_torchfts_wording_and_state_layout():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    w = torch.zeros(2)
    manager = Manager(load_state_dict=lambda sd: w.copy_(sd["w"]), state_dict=lambda: {"w": w},
                      use_async_quorum=False, timeout=5, connect_timeout=5, lighthouse_addr=lighthouse.address(),
                      replica_id="alone")
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match='status: Cancelled, message: "Timeout expired"'):
            manager.start_quorum(timeout=datetime.timedelta(seconds=0.2))
        assert time.monotonic() - start < 5
        state = manager._manager_state_dict()
        assert set(state) == {"user", "torchft"} and state["torchft"]["step"] == 0
        state["user"]["default"] = {"w": torch.ones(2)}
        state["torchft"] = {"step": 3, "batches_committed": 6}
        manager.load_full_state_dict(state)  # TorchFT's layout loads too
        assert manager.current_step() == 3 and w.tolist() == [1.0, 1.0]
    finally:
        manager.shutdown()
        lighthouse.shutdown()
