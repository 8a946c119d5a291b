"""Interoperability with the real TorchFT package, both ways:

- TorchFT's LighthouseClient and its Rust ManagerServer/ManagerClient against Regent's Lighthouse;
- Regent's LighthouseClient against TorchFT's Rust LighthouseServer.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient

torchft_rs = pytest.importorskip("torchft._torchft")

pytestmark = pytest.mark.interop


def loopback(address: str) -> str:
    """TorchFT advertises http://<hostname>:port; dial loopback instead (the tests bind 127.0.0.1)."""
    port = address.rsplit(":", 1)[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def regent_lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60000, quorum_tick_ms=20)
    yield server
    server.shutdown()


@pytest.fixture
def torchft_lighthouse():
    server = torchft_rs.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60000, quorum_tick_ms=20, heartbeat_timeout_ms=5000
    )
    yield server
    server.shutdown()


def test_torchft_lighthouse_client_against_regent(regent_lighthouse):
    client = torchft_rs.LighthouseClient(regent_lighthouse.address(), timedelta(seconds=10))
    client.heartbeat("b:1")
    client.heartbeat("a:1", timedelta(seconds=5))
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(client.quorum, "a:1", timedelta(seconds=20), "mgr-a:1", "store-a:2", 10, 4, False,
                         {"host": "a"})
        fb = pool.submit(client.quorum, "b:1", timedelta(seconds=20), "mgr-b:1", "store-b:2", 5, 4, False, None)
        qa, qb = fa.result(), fb.result()
    assert qa.quorum_id == qb.quorum_id == 1
    assert [m.replica_id for m in qa.participants] == ["a:1", "b:1"]
    a = qa.participants[0]
    assert (a.address, a.store_address, a.step, a.world_size, a.shrink_only) == ("mgr-a:1", "store-a:2", 10, 4, False)
    assert a.data == {"host": "a"}  # TorchFT decodes the JSON, as we do
    status = regent_lighthouse.status()
    assert status["prev_quorum"]["participants"][0]["data"] == {"host": "a"}
    assert status["max_step"] == 10

    # TorchFT's client maps our deadline expiry to TimeoutError too.
    with pytest.raises(TimeoutError):
        client.quorum("c:1", timedelta(milliseconds=300))


def test_torchft_managers_against_regent(regent_lighthouse):
    """Two TorchFT ManagerServers (Rust) run the full manager quorum through Regent's Lighthouse, with healing."""
    managers = [
        torchft_rs.ManagerServer(
            replica_id=rid, lighthouse_addr=regent_lighthouse.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
            store_addr=f"127.0.0.1:{1000 + i}", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=timedelta(seconds=10), quorum_retries=0,
        )
        for i, rid in enumerate(["rep_0:u0", "rep_1:u1"])
    ]
    try:
        clients = [torchft_rs.ManagerClient(loopback(m.address()), timedelta(seconds=10)) for m in managers]

        def quorum(i: int, step: int):
            return clients[i]._quorum(
                group_rank=0, step=step, checkpoint_metadata=f"meta-{i}", shrink_only=False,
                timeout=timedelta(seconds=30), commit_failures=0, reconfigure_handle=f"h{i}", init_sync=True,
            )

        with ThreadPoolExecutor(2) as pool:
            f0, f1 = pool.submit(quorum, 0, 10), pool.submit(quorum, 1, 3)
            r0, r1 = f0.result(), f1.result()
        assert r0.quorum_id == r1.quorum_id == 1
        assert (r0.replica_rank, r1.replica_rank, r0.replica_world_size) == (0, 1, 2)
        assert r0.max_step == r1.max_step == 10
        assert not r0.heal and r1.heal  # replica 1 is behind: it heals from replica 0
        assert r0.recover_dst_replica_ranks == [1]
        assert r1.recover_src_replica_rank == 0
        assert loopback(r1.recover_src_manager_address) == loopback(managers[0].address())
        assert r0.store_address == "127.0.0.1:1000"  # the max-step replica's store is the primary
        # Newer TorchFT adds QuorumMember fields our .proto does not name; the Lighthouse passes them through.
        assert list(r0.reconfigure_handles) == ["h0", "h1"]

        # Heartbeats from the Rust managers reach our Lighthouse.
        beats = {h["replica_id"]: h["healthy"] for h in regent_lighthouse.status()["heartbeats"]}
        assert beats == {"rep_0:u0": True, "rep_1:u1": True}
    finally:
        for m in managers:
            m.shutdown()


KILLABLE_TORCHFT_MANAGER = r"""
import sys, time
from datetime import timedelta
import torchft._torchft as t
server = t.ManagerServer(
    replica_id="victim:1", lighthouse_addr=sys.argv[1], hostname="127.0.0.1", bind="127.0.0.1:0",
    store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
    connect_timeout=timedelta(seconds=10), quorum_retries=0)
client = t.ManagerClient("http://127.0.0.1:" + server.address().rsplit(":", 1)[1], timedelta(seconds=10))
r = client._quorum(group_rank=0, step=1, checkpoint_metadata="", shrink_only=False, timeout=timedelta(seconds=30),
                   commit_failures=0, reconfigure_handle="", init_sync=True)
print("joined", r.quorum_id, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_dashboard_kill_reaches_torchft_manager(tmp_path):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    script = tmp_path / "victim.py"
    script.write_text(KILLABLE_TORCHFT_MANAGER)
    proc = subprocess.Popen([sys.executable, str(script), server.address()], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline().strip() == "joined 1"
        req = urllib.request.Request(server.dashboard_url() + "replica/victim:1/kill", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        assert proc.wait(timeout=30) == 1  # TorchFT's manager exits with status 1 on Kill
    finally:
        proc.kill()
        proc.wait()
        server.shutdown()


def test_regent_client_against_torchft_lighthouse(torchft_lighthouse):
    addr = loopback(torchft_lighthouse.address())
    client = LighthouseClient(addr, connect_timeout=10)
    client.heartbeat("a:1")
    client.heartbeat("b:1", timeout=timedelta(seconds=5))
    with ThreadPoolExecutor(2) as pool:
        fb = pool.submit(client.quorum, "b:1", timedelta(seconds=20), address="mgr-b", step=2, world_size=8,
                         data={"x": 1})
        fa = pool.submit(client.quorum, "a:1", 20.0, address="mgr-a", store_address="s:1", step=7, world_size=8)
        qa, qb = fa.result(), fb.result()
    assert qa.quorum_id == qb.quorum_id == 1
    assert qa.replica_ids() == ["a:1", "b:1"]
    assert qa.participants[0].store_address == "s:1"
    assert qa.participants[1].data == {"x": 1}
    assert qa.participants[1].step == 2
    assert qa.created.year >= 2025

    # Same membership with a commit failure: TorchFT bumps the id, as we do.
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(client.quorum, "a:1", 20, commit_failures=1)
        fb = pool.submit(client.quorum, "b:1", 20)
        assert fa.result().quorum_id == fb.result().quorum_id == 2

    start = time.monotonic()
    with pytest.raises(TimeoutError):
        client.quorum("c:1", timeout=0.3)
    assert time.monotonic() - start < 10


def test_regent_client_reconnects_to_restarted_torchft_lighthouse():
    """Our client's reconnect also works against TorchFT's server restarted on the same port."""
    first = torchft_rs.LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    port = int(first.address().rsplit(":", 1)[1])
    client = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=30)
    assert client.quorum("a", timeout=10).quorum_id == 1
    first.shutdown()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.quorum, "a", 30)
        time.sleep(0.5)
        second = torchft_rs.LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=100)
        try:
            assert pending.result(timeout=30).replica_ids() == ["a"]
        finally:
            second.shutdown()
