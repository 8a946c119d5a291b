"""Nobody gets into the control plane: every gRPC call to the Lighthouse (both server implementations) and to a
ManagerServer proves the job secret, or is refused with UNAUTHENTICATED before it changes anything; replays,
proofs for another method and stale proofs are refused; refusals are logged once per peer host; TLS (and
mutual TLS) round trips; without a secret, plain TorchFT-style clients work as before. Real sockets; one test
runs the Lighthouse as its own process (`regent lighthouse`) with the secret in its environment."""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import urllib.request

import grpc
import pytest

from regent.auth import AuthenticationError
from regent.ft import rpc_security
from regent.ft.config import FTConfig
from regent.ft.coordination import ManagerClient
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient, normalize_address
from regent.ft.manager import ManagerServer
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.rpc_security import AUTH_KEY, CallVerifier, Security, TLSFiles, make_token

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
SERVERS = ("lite", "grpcio")
HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
QUORUM = "/torchft.LighthouseService/Quorum"


def _raw_heartbeat(address: str, replica_id: str, metadata: list | None = None) -> grpc.RpcError | None:
    """A heartbeat as any gRPC client sends it (no Regent client code); None if it succeeded."""
    with grpc.insecure_channel(normalize_address(address)) as channel:
        stub = torchft_pb2_grpc.LighthouseServiceStub(channel)
        try:
            stub.Heartbeat(torchft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id), timeout=5,
                           metadata=metadata)
        except grpc.RpcError as err:
            return err
    return None


def _heartbeating(lh: LighthouseServer) -> set[str]:
    return {h["replica_id"] for h in lh.status()["heartbeats"]}


@pytest.mark.parametrize("server", SERVERS)
def test_lighthouse_accepts_the_secret_and_refuses_everything_else(server, caplog):
    lh = LighthouseServer(min_replicas=1, server=server, secret=SECRET, tls=TLSFiles())
    try:
        client = LighthouseClient(lh.address(), connect_timeout=5, secret=SECRET, tls=TLSFiles())
        client.heartbeat("good")
        assert client.quorum("good", timeout=5).quorum_id == 1
        client.close()

        caplog.set_level(logging.DEBUG, logger="regent.ft.rpc_security")
        caplog.clear()
        # no metadata at all (a TorchFT client), another secret, a proof for another method, a stale proof
        refusals = {
            "none": _raw_heartbeat(lh.address(), "intruder-1"),
            "other secret": _raw_heartbeat(lh.address(), "intruder-2", [(AUTH_KEY, make_token(OTHER, HEARTBEAT))]),
            "other method": _raw_heartbeat(lh.address(), "intruder-3", [(AUTH_KEY, make_token(SECRET, QUORUM))]),
            "stale": _raw_heartbeat(lh.address(), "intruder-4",
                                    [(AUTH_KEY, make_token(SECRET, HEARTBEAT, now=time.time() - 120))]),
            "future": _raw_heartbeat(lh.address(), "intruder-5",
                                     [(AUTH_KEY, make_token(SECRET, HEARTBEAT, now=time.time() + 120))]),
            "garbage": _raw_heartbeat(lh.address(), "intruder-6", [(AUTH_KEY, "v1:1:2:3")]),
        }
        for what, err in refusals.items():
            assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED, what
            assert "job secret" in err.details(), what
        # a proof seen once is spent: replaying it is refused
        token = make_token(SECRET, HEARTBEAT)
        assert _raw_heartbeat(lh.address(), "recorded", [(AUTH_KEY, token)]) is None
        replay = _raw_heartbeat(lh.address(), "replayed", [(AUTH_KEY, token)])
        assert replay is not None and replay.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "replayed" in replay.details()
        # unknown methods do not tell an outsider which ones exist
        with grpc.insecure_channel(normalize_address(lh.address())) as channel, \
                pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/torchft.LighthouseService/Nope")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # refused calls changed nothing; the accepted ones did
        assert _heartbeating(lh) == {"good", "recorded"}
        assert lh.refused_calls == len(refusals) + 2
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per peer host, not per call
        assert SECRET.hex() not in caplog.text and OTHER.hex() not in caplog.text

        # Regent's client with the wrong secret fails at once with a clear error (not after retries)
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match="job secret"):
            LighthouseClient(lh.address(), connect_timeout=30, secret=OTHER, tls=TLSFiles()).heartbeat("x")
        assert time.monotonic() - start < 5
    finally:
        lh.shutdown()


@pytest.mark.parametrize("server", SERVERS)
def test_without_a_secret_torchft_clients_work_and_regent_clients_too(server):
    lh = LighthouseServer(min_replicas=1, server=server, secret=b"", tls=TLSFiles())
    try:
        # a client that has a secret talks to a server that has none (the extra metadata is ignored)
        with LighthouseClient(lh.address(), connect_timeout=5, secret=SECRET, tls=TLSFiles()) as client:
            client.heartbeat("regent")
            assert client.quorum("regent", timeout=5).quorum_id == 1
        assert _raw_heartbeat(lh.address(), "torchft") is None  # a plain client, no metadata
        assert _heartbeating(lh) == {"torchft", "regent"}
        assert lh.refused_calls == 0
    finally:
        lh.shutdown()


def test_manager_server_refuses_unauthenticated_calls_before_they_act():
    lh = LighthouseServer(min_replicas=1, secret=SECRET, tls=TLSFiles())
    mgr = ManagerServer(replica_id="r:1", lighthouse_addr=lh.address(), hostname="127.0.0.1",
                        store_address="127.0.0.1:1", world_size=1, heartbeat_interval=0.05,
                        secret=SECRET, tls=TLSFiles())
    try:
        with grpc.insecure_channel(mgr.address()) as channel:
            stub = torchft_pb2_grpc.ManagerServiceStub(channel)
            # Kill would end this very process (os._exit): refused, we are still here to assert
            for metadata in (None, [(AUTH_KEY, make_token(OTHER, "/torchft.ManagerService/Kill"))]):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Kill(torchft_pb2.KillRequest(msg="intruder"), timeout=5, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # a vote from outside is refused and counts for nothing (world_size=1: it would decide the round)
            token = make_token(SECRET, "/torchft.ManagerService/ShouldCommit")
            with pytest.raises(grpc.RpcError) as info:
                stub.ShouldCommit(torchft_pb2.ShouldCommitRequest(group_rank=0, step=41, should_commit=True),
                                  timeout=5, metadata=[(AUTH_KEY, token[:-1] + ("1" if token[-1] == "0" else "0"))])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert mgr.committed_step == 0
        # Regent's ManagerClient signs its calls: it gets past the check (NOT_FOUND is the handler's answer)
        client = ManagerClient(mgr.address(), connect_timeout=5, secret=SECRET, tls=TLSFiles())
        with pytest.raises(RuntimeError, match="NOT_FOUND"):
            client._checkpoint_metadata(0, timeout=5)
        assert client.should_commit(0, 41, True, timeout=5) is True
        assert mgr.committed_step == 42
        client.close()
        # and the ManagerServer's own heartbeats carried the secret to the Lighthouse
        deadline = time.monotonic() + 5
        while "r:1" not in _heartbeating(lh) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "r:1" in _heartbeating(lh) and lh.refused_calls == 0
    finally:
        mgr.shutdown()
        lh.shutdown()


def test_dashboard_kill_needs_the_secret_and_pages_never_show_it():
    lh = LighthouseServer(min_replicas=1, secret=SECRET, tls=TLSFiles())
    try:
        with LighthouseClient(lh.address(), connect_timeout=5, secret=SECRET, tls=TLSFiles()) as client:
            client.heartbeat("victim")
        base = lh.dashboard_url()
        for page in ("", "status.json"):
            with urllib.request.urlopen(base + page, timeout=5) as response:
                body = response.read().decode()
            assert SECRET.hex() not in body and "REGENT_JOB_SECRET=" not in body
        for headers in ({}, rpc_security.dashboard_kill_headers(SECRET, "someone-else"),
                        rpc_security.dashboard_kill_headers(OTHER, "victim")):
            request = urllib.request.Request(base + "replica/victim/kill", method="POST", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=5)
            assert info.value.code == 401
        # with the proof it gets through to the kill itself (no such replica in a quorum: 404)
        request = urllib.request.Request(base + "replica/victim/kill", method="POST",
                                         headers=rpc_security.dashboard_kill_headers(SECRET, "victim"))
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=5)
        assert info.value.code == 404
    finally:
        lh.shutdown()


# ---- the pieces -------------------------------------------------------------------------------------------


def test_verifier_window_replay_and_memory():
    v = CallVerifier(SECRET, window_s=10)
    now = time.time()
    t1 = make_token(SECRET, HEARTBEAT, now=now)
    assert v.verify(HEARTBEAT, t1, now=now) is None
    assert "replayed" in v.verify(HEARTBEAT, t1, now=now + 1)
    assert "wrong proof" in v.verify(QUORUM, make_token(SECRET, HEARTBEAT, now=now), now=now)
    assert "from this server's clock" in v.verify(HEARTBEAT, make_token(SECRET, HEARTBEAT, now=now - 11), now=now)
    assert "no regent-auth" in v.verify(HEARTBEAT, None)
    assert "malformed" in v.verify(HEARTBEAT, b"\xff\xfe")
    assert "malformed" in v.verify(HEARTBEAT, "v1:\u00b2\u00b2:" + "0" * 32 + ":" + "0" * 64)
    # a refused proof is not remembered (only the secret's holders fill the nonce memory) ...
    assert v.remembered == 1
    # ... and accepted nonces are forgotten once their time has left the window
    assert v.verify(HEARTBEAT, make_token(SECRET, HEARTBEAT, now=now + 25), now=now + 25) is None
    assert v.remembered == 1
    assert rpc_security.peer_host("ipv4:10.0.0.1:5555") == "10.0.0.1"
    assert rpc_security.peer_host("ipv6:[::1]:5555") == "::1"
    assert rpc_security.peer_host("10.0.0.2:80") == "10.0.0.2"


def test_security_from_environment(monkeypatch, tmp_path):
    assert Security.resolve().secret is None  # the library default: no secret
    monkeypatch.setenv("REGENT_JOB_SECRET", SECRET.hex())
    assert Security.resolve().secret == SECRET
    assert Security.resolve(secret=b"").secret is None
    monkeypatch.setenv(rpc_security.RPC_AUTH_ENV, "0")
    assert Security.resolve().secret is None
    monkeypatch.setenv(rpc_security.TLS_CERT_ENV, str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="both a certificate and its key"):
        Security.resolve()
    env = FTConfig(rpc_auth=False, tls_cert="c.pem", tls_key="k.pem").rpc_env()
    assert env[rpc_security.RPC_AUTH_ENV] == "0" and os.path.isabs(env[rpc_security.TLS_CERT_ENV])
    with pytest.raises(ValueError, match="ft.tls_"):
        FTConfig(tls_cert=str(tmp_path / "nope.pem"), tls_key=str(tmp_path / "nope.key")).validate()


def test_lite_reads_the_per_call_proof_beside_its_header_cache():
    """The lean server reads the proof (a trailing literal, as grpcio sends it) without decoding the block
    again, and falls back to a full decode whenever the block is anything else."""
    import hpack

    from regent.ft import grpc_lite

    def conn() -> grpc_lite._Connection:
        return grpc_lite._Connection(grpc_lite.Server(volatile_header=rpc_security.AUTH_KEY_BYTES))

    enc = hpack.Encoder()
    base = [(b":path", HEARTBEAT.encode()), (b":method", b"POST"), (b"content-type", b"application/grpc")]
    prefix = enc.encode(base)
    c, reference = conn(), hpack.Decoder()
    for _ in range(3):  # each call its own token; the prefix repeats
        token = make_token(SECRET, HEARTBEAT).encode()
        block = prefix + grpc_lite.literal_header(rpc_security.AUTH_KEY_BYTES, token)
        assert c._decode_headers(block) == [*reference.decode(prefix, raw=True), (rpc_security.AUTH_KEY_BYTES, token)]
        prefix = enc.encode(base)  # now fully indexed, as a warm client sends it
    # a Huffman-coded value, or the literal not at the end, or a long value: decoded as a whole, same result
    huff = hpack.Encoder().encode([*base, (rpc_security.AUTH_KEY_BYTES, b"v1:" + b"a" * 200)], huffman=True)
    assert dict(conn()._decode_headers(huff))[rpc_security.AUTH_KEY_BYTES] == b"v1:" + b"a" * 200
    long_value = b"x" * 300
    block = hpack.Encoder().encode(base) + grpc_lite.literal_header(rpc_security.AUTH_KEY_BYTES, long_value)
    assert dict(conn()._decode_headers(block))[rpc_security.AUTH_KEY_BYTES] == long_value
    middle = grpc_lite.literal_header(rpc_security.AUTH_KEY_BYTES, b"t") + hpack.Encoder().encode(base)
    assert dict(conn()._decode_headers(middle))[rpc_security.AUTH_KEY_BYTES] == b"t"
    # a hostile block of many markers costs one split, not one per marker
    marker = grpc_lite.literal_header(rpc_security.AUTH_KEY_BYTES, b"")
    hostile = marker * 1000 + grpc_lite.literal_header(rpc_security.AUTH_KEY_BYTES, b"t")
    assert conn()._decode_headers(hostile)[-1] == (rpc_security.AUTH_KEY_BYTES, b"t")
    with pytest.raises(grpc_lite._ConnectionError, match="larger than"):  # and a header list too long is refused
        conn()._decode_headers(marker * 3000 + grpc_lite.literal_header(rpc_security.AUTH_KEY_BYTES, b"t"))


def test_a_quorum_request_that_outlived_its_deadline_in_flight_is_not_counted():
    """A request delayed in the network (TCP retransmission through a partition) past its caller's deadline
    arrives with its full `grpc-timeout`: by its signed timestamp the lean server knows it is stale and refuses
    it before the Lighthouse counts it (a quorum with it would wait for a caller that already gave up)."""
    lh = LighthouseServer(min_replicas=1, join_timeout_ms=60_000, secret=SECRET, tls=TLSFiles())
    try:
        request = torchft_pb2.LighthouseQuorumRequest(requester=torchft_pb2.QuorumMember(replica_id="late:1"))
        with grpc.insecure_channel(normalize_address(lh.address())) as channel:
            stub = torchft_pb2_grpc.LighthouseServiceStub(channel)
            # signed 8 s ago with a 5 s deadline: its caller gave up 3 s ago
            with pytest.raises(grpc.RpcError) as info:
                stub.Quorum(request, timeout=5, metadata=[(AUTH_KEY, make_token(SECRET, QUORUM, now=time.time() - 8))])
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert lh.status()["waiting"] == []
            # signed 2 s ago with a 5 s deadline: still wanted, so it is served
            reply = stub.Quorum(request, timeout=5, metadata=[(AUTH_KEY, make_token(SECRET, QUORUM,
                                                                                     now=time.time() - 2))])
            assert [m.replica_id for m in reply.quorum.participants] == ["late:1"]
    finally:
        lh.shutdown()


def test_call_age_reads_the_proofs_timestamp():
    token = make_token(SECRET, QUORUM, now=1000.0).encode()
    assert rpc_security.lite_call_age([(b"x", b"y"), (rpc_security.AUTH_KEY_BYTES, token)], now=1003.5) == 3.5
    assert rpc_security.lite_call_age([(b"x", b"y")]) is None
    assert rpc_security.lite_call_age([(rpc_security.AUTH_KEY_BYTES, b"v1:abc:x:y")]) is None
