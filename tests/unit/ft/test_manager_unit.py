"""Manager pieces tested in one process: quorum timeout, env timeouts, config validation, server barrier."""

from __future__ import annotations

import time

import pytest
import torch

from regent.ft.config import FTConfig, env_timeout
from regent.ft.lighthouse import LighthouseServer
from regent.ft.manager import Manager


def test_env_timeouts_win_and_accept_torchft_names():
    assert env_timeout("timeout", 60, {}) == 60
    assert env_timeout("timeout", 60, {"TORCHFT_TIMEOUT_SEC": "5"}) == 5
    assert env_timeout("quorum_timeout", 60, {"REGENT_FT_QUORUM_TIMEOUT_SEC": "7", "TORCHFT_QUORUM_TIMEOUT_SEC": "9"}) == 7
    with pytest.raises(ValueError, match="REGENT_FT_CONNECT_TIMEOUT_SEC"):
        env_timeout("connect_timeout", 60, {"REGENT_FT_CONNECT_TIMEOUT_SEC": "soon"})


def test_ftconfig_validation_names_the_field():
    FTConfig().validate()
    FTConfig(fragments=4, sync_every=20, fragment_sync_delay=4).validate()
    with pytest.raises(ValueError, match="multiple of ft.fragments"):
        FTConfig(fragments=3, sync_every=20).validate()
    with pytest.raises(ValueError, match="fragment_sync_delay"):
        FTConfig(fragments=2, sync_every=20, fragment_sync_delay=10).validate()
    with pytest.raises(ValueError, match="fragment_update_alpha"):
        FTConfig(fragment_update_alpha=2).validate()


def test_missing_lighthouse_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("REGENT_FT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="Lighthouse"):
        Manager(group_world_size=1, group_rank=0)


def test_group_of_two_needs_a_store(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="store_port"):
        Manager(group_world_size=2, group_rank=0, lighthouse_addr="127.0.0.1:1")


def test_quorum_timeout_sync_raises_and_async_reports():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    w = torch.zeros(3)
    manager = Manager(
        load_state_dict=lambda sd: w.copy_(sd["w"]), state_dict=lambda: {"w": w},
        use_async_quorum=False, quorum_timeout=1.0, connect_timeout=5, timeout=5,
        lighthouse_addr=lighthouse.address(), replica_id="lonely",
    )
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="quorum"):
            manager.start_quorum()
        assert time.monotonic() - start < 10
        manager.use_async_quorum = True
        manager.start_quorum(timeout=1.0)
        fut = manager.allreduce(torch.ones(2))
        assert fut.wait().tolist() == [1.0, 1.0]  # never raises; the input comes back untouched
        assert isinstance(manager.errored(), TimeoutError)
        assert manager.should_commit() is False
        assert manager.current_step() == 0
    finally:
        manager.shutdown()
        lighthouse.shutdown()


def test_single_replica_steps_and_max_retries():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    events = []
    manager = Manager(
        min_replica_size=2, max_retries=1, lighthouse_addr=lighthouse.address(), replica_id="solo",
        on_event=lambda kind, d: events.append((kind, d)), timeout=5, quorum_timeout=10,
    )
    try:
        manager.start_quorum()
        t = torch.full((2,), 4.0)
        manager.allreduce(t).wait()
        assert t.tolist() == [4.0, 4.0]  # average over one participant
        assert manager.num_participants() == 1 and manager.is_participating()
        assert manager.should_commit() is False  # min_replica_size=2 not met
        manager.start_quorum()
        with pytest.raises(RuntimeError, match="max_retries"):
            manager.should_commit()
        kinds = [k for k, _ in events]
        assert kinds.count("commit") == 2 and "quorum" in kinds
        assert manager.replica_id.startswith("solo:")
        assert manager.state_dict() == {"step": 0, "batches_committed": 0}
    finally:
        manager.shutdown()
        lighthouse.shutdown()


@pytest.mark.interop
def test_regent_manager_against_torchft_lighthouse():
    """Regent's Manager speaks TorchFT's wire protocol: two replicas (threads) quorum through
    `torchft_lighthouse` (TorchFT's Rust server), average, and commit."""
    coordination = pytest.importorskip("torchft.coordination")
    import threading

    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=200)
    results: dict[str, object] = {}

    def replica(name: str, value: float) -> None:
        w = torch.zeros(2)
        manager = Manager(
            load_state_dict=lambda sd: w.copy_(sd["w"]), state_dict=lambda: {"w": w}, use_async_quorum=False,
            lighthouse_addr=server.address(), replica_id=name, timeout=10, quorum_timeout=30,
        )
        try:
            for _ in range(2):
                manager.start_quorum()
                t = torch.full((2,), value)
                manager.allreduce(t).wait()
                committed = manager.should_commit()
            results[name] = (t.tolist(), committed, manager.current_step(), manager.num_participants())
        except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
            results[name] = err
        finally:
            manager.shutdown()

    threads = [threading.Thread(target=replica, args=(n, v)) for n, v in (("a", 1.0), ("b", 3.0))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        server.shutdown()
    assert results["a"] == ([2.0, 2.0], True, 2, 2), results
    assert results["b"] == ([2.0, 2.0], True, 2, 2), results


def test_rank0_shares_an_existing_store_at_its_port():
    """With MASTER_PORT already served (e.g. by the trainer's own process group), the Manager joins it."""
    import datetime

    import torch.distributed as dist

    existing = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    manager = Manager(lighthouse_addr=lighthouse.address(), replica_id="shared", store_port=existing.port,
                      timeout=5, quorum_timeout=10)
    try:
        assert existing.get("regent/replica_id").decode() == manager.replica_id
        manager.start_quorum()
        assert manager.should_commit() and manager.current_step() == 1
    finally:
        manager.shutdown()
        lighthouse.shutdown()


def test_a_peer_reported_dead_during_the_rendezvous_ends_the_wait():
    # Two replicas form a quorum; one freezes before it reaches the group's rendezvous (killed right after
    # the quorum). Its supervisor's report must end the survivor's wait at once, not after connect_timeout.
    import threading
    import time

    from regent.ft.process_group import ReplicatedGroup

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
    frozen = threading.Event()

    class FrozenGroup(ReplicatedGroup):
        def configure(self, *args, **kwargs) -> None:
            frozen.wait(60)
            raise RuntimeError("frozen replica released")

    managers = [
        Manager(pg=pg, min_replica_size=1, use_async_quorum=False, lighthouse_addr=lighthouse.address(),
                replica_id=name, timeout=5, quorum_timeout=20, connect_timeout=60, init_sync=False)
        for name, pg in (("alive", ReplicatedGroup("gloo", timeout=5, connect_timeout=60)),
                         ("dead", FrozenGroup("gloo", timeout=5, connect_timeout=60)))
    ]
    alive, dead = managers
    stuck = threading.Thread(target=dead.start_quorum, daemon=True)
    try:
        stuck.start()
        reporter = threading.Timer(1.5, lambda: alive.peer_failed("dead:"))
        reporter.start()
        start = time.monotonic()
        alive.start_quorum()  # returns once the rendezvous is given up
        assert time.monotonic() - start < 15
        assert alive.should_commit() is False
        assert "given up" in str(alive.errored())
    finally:
        frozen.set()
        stuck.join(10)
        for m in managers:
            m.shutdown()
        lighthouse.shutdown()


def test_a_replica_whose_group_fails_tells_its_peers_in_the_same_quorum():
    """A `comm` fault: replica a's group is aborted but no process dies. Its Manager announces the failure
    ("group_failed", with the quorum id); passed to b's `peer_failed` (the orchestrator's part, wired here by
    hand), b's allreduce that waits for a fails with that reason instead of waiting out b's timeout."""

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
    events: list[tuple[str, dict]] = []
    managers: dict[str, Manager] = {}

    def on_event(kind: str, details: dict) -> None:
        events.append((kind, details))
        if kind == "group_failed":  # what the orchestrator does with it
            for name, other in managers.items():
                if not details["replica_id"].startswith(f"{name}:"):
                    other.peer_failed(details["replica_id"].split(":")[0] + ":", "lost its replicated group",
                                      group=details["group"])

    for name in ("a", "b"):
        managers[name] = Manager(min_replica_size=1, use_async_quorum=False, lighthouse_addr=lighthouse.address(),
                                 replica_id=f"{name}:0", timeout=5, quorum_timeout=30, init_sync=False,
                                 on_event=on_event)
    a, b = managers["a"], managers["b"]
    try:
        _in_threads(a.start_quorum, b.start_quorum)
        quorum_id, build = a._quorum_key[0], a._group
        assert b._group == build
        # a notice about another build of the group (an earlier one, reported late): ignored
        assert b.peer_failed("a:", group=f"{quorum_id}/s0f1") is False
        pending = b.allreduce(torch.ones(4))  # waits for a, which will never join it
        a.pg.abort(RuntimeError("injected communication failure"))
        a.allreduce(torch.ones(4)).wait()  # fails at once on a's aborted group: a announces
        aborted = time.monotonic()
        pending.wait()
        assert "lost its replicated group" in str(b.errored())  # not b's own timeout
        # a announces; b, aborted on that report, announces too (for a's other group ranks, if it had any)
        assert sorted((d["replica_id"][0], d["group"]) for k, d in events if k == "group_failed") == [
            ("a", build), ("b", build)]
        # b dropped its group with a; then a, told of b's announcement, dropped its own (already failed) one
        assert [d["replica_id"].split(":")[0] for k, d in events if k == "peer_abort"] == ["b", "a"]
        assert a.should_commit() is False and b.should_commit() is False
        # Gloo's own operation on b's dropped communicator ends with b's timeout: let it, so that this
        # process (pytest) never exits with it pending (see ReplicatedGroup.abort).
        time.sleep(max(0.0, aborted + 6 - time.monotonic()))
    finally:
        for m in (a, b):
            m.shutdown()
        lighthouse.shutdown()


def test_a_peer_reported_dead_after_the_steps_allreduce_completed_does_not_undo_the_commit():
    """Replica a commits a step and dies; the supervisor's notice reaches b after b's allreduce of that step
    completed and before b's vote. b's results are valid and a committed the same step: b must commit it too,
    or the run's newest committed step lives only in the dead replica (seen in a full test run, a lineage
    reset). Its next operation on the aborted group fails, and the next quorum rebuilds the group."""
    import threading

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
    managers = {name: Manager(min_replica_size=1, use_async_quorum=False, lighthouse_addr=lighthouse.address(),
                              replica_id=f"{name}:0", timeout=5, quorum_timeout=30, init_sync=False)
                for name in ("a", "b")}
    a, b = managers["a"], managers["b"]
    try:
        _in_threads(a.start_quorum, b.start_quorum)
        assert a.num_participants() == b.num_participants() == 2
        results = {}
        _in_threads(*[lambda n=n, m=m: results.__setitem__(n, m.allreduce(torch.ones(4)).wait())
                       for n, m in managers.items()])
        assert all(torch.equal(r, torch.ones(4)) for r in results.values())
        votes = {}
        vote_a = threading.Thread(target=lambda: votes.__setitem__("a", a.should_commit()))
        vote_a.start()
        assert b.peer_failed("a:") is True  # a is "dead" now, after the allreduce and before b's vote
        votes["b"] = b.should_commit()
        vote_a.join(30)
        assert votes == {"a": True, "b": True}
        assert a.current_step() == b.current_step() == 1
        start = time.monotonic()
        b.allreduce(torch.ones(4)).wait()  # the next operation on the aborted build fails at once, reported
        assert time.monotonic() - start < 2 and "reported failed" in str(b.errored())
    finally:
        for m in (a, b):
            m.shutdown()
        lighthouse.shutdown()


def _in_threads(*fns) -> None:
    """Run `fns` at once (each on its own thread) and wait for all: the replicas' side of a collective step."""
    import threading

    threads = [threading.Thread(target=fn) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
