"""Lighthouse front ends (`regent.ft.frontends`): the pure pieces (link framing, heartbeat batching and
merging), then real processes and sockets: front ends serve heartbeats and quorums, a killed front end is
replaced, a killed owner takes its front ends with it: the cases that start processes (the others:
tests/unit/ft/test_lighthouse_frontends.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from regent.ft import frontends
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient, normalize_address
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.rpc_security import AUTH_KEY, TLSFiles, make_token
from regent.ft.simulate import SimConfig, run_simulation

linux_only = pytest.mark.skipif(frontends.reuse_port_available() is not None, reason="needs Linux SO_REUSEPORT")


def wait_for(condition: Callable[[], object], what: str, within_s: float = 60.0) -> object:
    """Poll until `condition()` is truthy (a bound against hanging, not a timing assertion)."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for {what} after {within_s:.0f} s")
        time.sleep(0.02)


def test_front_ends_are_refused_clearly_without_linux_reuseport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frontends.sys, "platform", "darwin")
    with pytest.raises(ValueError, match="SO_REUSEPORT.*--frontends 0"):
        LighthouseServer(frontends=2, secret=b"", tls=TLSFiles())


@linux_only
def test_with_a_secret_a_replay_is_refused_whichever_front_end_it_reaches() -> None:
    """Front ends check proofs; the owner spends nonces: a recorded call replayed on fresh connections (which the
    kernel spreads over both front ends) is refused every time, and never refreshes liveness."""
    secret = bytes(range(32))
    server = LighthouseServer(min_replicas=1, quorum_tick_ms=20, secret=secret, tls=TLSFiles(), frontends=2)
    try:
        with LighthouseClient(server.address(), 30, secret=secret, tls=TLSFiles()) as client:
            client.heartbeat("ok:1")
            assert client.quorum("ok:1", 30).quorum_id == 1
        assert "ok:1" in server.counted_live()
        assert _raw_heartbeat(server.address(), "nobody:1", []).code() == grpc.StatusCode.UNAUTHENTICATED
        token = make_token(secret, "/torchft.LighthouseService/Heartbeat")
        assert _raw_heartbeat(server.address(), "recorded:1", [(AUTH_KEY, token)]) is None
        for _ in range(6):  # new connections each time: both front ends get some
            replay = _raw_heartbeat(server.address(), "replayed:1", [(AUTH_KEY, token)])
            assert replay is not None and replay.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "replayed proof" in replay.details()
        live = server.counted_live()
        assert "recorded:1" in live and "replayed:1" not in live and "nobody:1" not in live
    finally:
        server.shutdown()


def _raw_heartbeat(address: str, replica_id: str, metadata: list) -> grpc.RpcError | None:
    with grpc.insecure_channel(normalize_address(address)) as channel:
        try:
            torchft_pb2_grpc.LighthouseServiceStub(channel).Heartbeat(
                torchft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id), timeout=30, metadata=metadata)
        except grpc.RpcError as err:
            return err
    return None


@linux_only
def test_two_front_ends_serve_heartbeats_and_a_quorum_of_real_clients() -> None:
    server = LighthouseServer(min_replicas=2, quorum_tick_ms=20, secret=b"", tls=TLSFiles(), frontends=2)
    try:
        pids = server.frontend_pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids
        clients = [LighthouseClient(server.address(), 30, secret=b"", tls=TLSFiles()) for _ in range(4)]
        for i, client in enumerate(clients):
            client.heartbeat(f"g{i}:1")
        wait_for(lambda: server.counted_live() >= {f"g{i}:1" for i in range(4)}, "the batched heartbeats")
        with ThreadPoolExecutor(4) as pool:
            quorums = list(pool.map(lambda ic: ic[1].quorum(f"g{ic[0]}:1", 30, step=ic[0]), enumerate(clients)))
        assert len({q.quorum_id for q in quorums}) == 1
        assert {m.replica_id for m in quorums[0].participants} == {f"g{i}:1" for i in range(4)}
        assert server.frontend_stats()["heartbeat_apply_lag"]["count"] >= 4
        for client in clients:
            client.close()
    finally:
        server.shutdown()
    assert not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids)


@linux_only
def test_a_killed_front_end_is_replaced_and_its_clients_come_back() -> None:
    server = LighthouseServer(min_replicas=1, quorum_tick_ms=20, secret=b"", tls=TLSFiles(), frontends=2)
    try:
        clients = [LighthouseClient(server.address(), 60, secret=b"", tls=TLSFiles()) for _ in range(8)]
        for i, client in enumerate(clients):
            client.heartbeat(f"k{i}:1")
        victim = server.frontend_pids()[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: server.frontend_stats()["restarted"] >= 1 and len(server.frontend_pids()) == 2,
                 "the owner to restart the killed front end")
        assert victim not in server.frontend_pids()
        for i, client in enumerate(clients):  # those that were on the dead front end reconnect (client retries)
            client.heartbeat(f"k{i}:1", timeout=60)
            assert client.quorum(f"k{i}:1", 60).quorum_id >= 1
        for client in clients:
            client.close()
        # a fresh connection finds a listening front end
        with LighthouseClient(server.address(), 60, secret=b"", tls=TLSFiles()) as late:
            late.heartbeat("late:1")
        wait_for(lambda: "late:1" in server.counted_live(), "the late client's heartbeat")
    finally:
        server.shutdown()


@linux_only
def test_the_owner_dying_ends_its_front_ends() -> None:
    from regent.ports import free_port_pair

    # the Lighthouse serves its dashboard at port + 1: a port from the ephemeral range often had that one taken
    # by some connection's source port (the owner then exited at once, with nothing on stdout)
    port = free_port_pair()
    env = dict(os.environ, REGENT_FT_RPC_AUTH="0", PYTHONPATH=os.pathsep.join(
        p for p in (str(Path(frontends.__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p))
    owner = subprocess.Popen([sys.executable, "-m", "regent.cli", "lighthouse", "--bind", f"127.0.0.1:{port}",
                              "--frontends", "2", "--log-level", "WARNING"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().startswith("Lighthouse gRPC:")
        children = wait_for(lambda: _children(owner.pid) if len(_children(owner.pid)) == 2 else None,
                            "two front-end processes")
        with LighthouseClient(f"127.0.0.1:{port}", 30, secret=b"", tls=TLSFiles()) as client:
            client.heartbeat("o:1")
        owner.kill()
        owner.wait()
        wait_for(lambda: all(not Path(f"/proc/{pid}").exists() or _state(pid) == "Z" for pid in children),
                 "the front ends to exit after their owner")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


@linux_only
def test_front_ends_refuse_a_port_held_by_another_server() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError, match="could not bind the Lighthouse"):
            LighthouseServer(bind=f"127.0.0.1:{held.getsockname()[1]}", secret=b"", tls=TLSFiles(), frontends=2)


@linux_only
def test_simulated_groups_through_two_front_ends() -> None:
    """The simulator's clients against front ends: no crashed or hung group still counted live past the
    timeout, no live one dropped, quorum rounds complete, and the batched heartbeats reached the table."""
    cfg = SimConfig(groups=64, workers=1, duration_s=5.0, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5,
                    quorum_every_s=0.7, join_timeout_ms=500, faults_per_s=1.0, down_s=1.0, warmup_s=1.5,
                    compact=True, frontends=2, seed=5)
    report = run_simulation(cfg)
    assert report["faults"] > 0 and report["liveness_polls"] > 0
    assert report["missed_failures"] == [] and report["false_failures"] == [], report
    assert report["counters"]["bad_answers"] == 0
    assert report["quorum"]["rounds"] > 0
    assert report["frontends"]["frontends"] == 2
    assert report["frontends"]["heartbeat_apply_lag"]["count"] > cfg.groups


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
