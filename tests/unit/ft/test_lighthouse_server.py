"""Regent's Lighthouse over real gRPC sockets: quorum formation, deadlines, the dashboard, the CLI, restarts."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from regent.cli import build_parser
from regent.ft.lighthouse import LighthouseServer, parse_bind
from regent.ft.lighthouse_client import LighthouseClient, normalize_address
from regent.ports import free_port_pair

HOUR_MS = 60 * 60 * 1000


@pytest.fixture
def lighthouse():
    servers = []

    def start(**kwargs) -> LighthouseServer:
        server = LighthouseServer(**kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def post(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, method="POST", data=b"")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_single_replica_quorum_and_status(lighthouse):
    server = lighthouse(min_replicas=1, join_timeout_ms=100)
    assert server.address().startswith("http://127.0.0.1:")
    assert server.dashboard_url() == f"http://127.0.0.1:{server.port + 1}/"
    client = LighthouseClient(server.address(), connect_timeout=10)
    client.heartbeat("a")
    q = client.quorum("a", timeout=10, address="mgr:1", store_address="store:2", step=7, world_size=4,
                      data={"k": [1, 2]})
    assert q.quorum_id == 1
    (m,) = q.participants
    assert (m.replica_id, m.address, m.store_address, m.step, m.world_size, m.data) == (
        "a", "mgr:1", "store:2", 7, 4, {"k": [1, 2]},
    )
    assert q.created.tzinfo is not None

    # Same membership again: same id; a fast quorum.
    assert client.quorum("a", timeout=10, step=8).quorum_id == 1

    status = server.status()
    assert status["quorum_id"] == 1
    assert status["prev_quorum"]["participants"][0]["step"] == 8
    assert status["waiting"] == []
    assert [h["replica_id"] for h in status["heartbeats"]] == ["a"]
    assert status["heartbeats"][0]["healthy"] is True
    assert "not ready" in status["next_quorum"]["reason"]


def ask_all(client: LighthouseClient, ids: list[str], timeout: float = 20, **kwargs):
    with ThreadPoolExecutor(len(ids)) as pool:
        futures = [pool.submit(client.quorum, rid, timeout, **kwargs) for rid in ids]
        return [f.result() for f in futures]


def test_replicas_agree_sorted_and_id_bumps_on_membership(lighthouse):
    server = lighthouse(min_replicas=2, join_timeout_ms=60000)
    client = LighthouseClient(server.address())
    quorums = ask_all(client, ["r2", "r1"])
    assert all(q.quorum_id == 1 for q in quorums)
    assert all(q.replica_ids() == ["r1", "r2"] for q in quorums)

    # Rejoin of the same members: fast quorum, id unchanged.
    assert {q.quorum_id for q in ask_all(client, ["r1", "r2"])} == {1}
    # A third member is waiting when the old members return: the fast quorum takes it along; id bumps.
    with ThreadPoolExecutor(1) as pool:
        f3 = pool.submit(client.quorum, "r3", 20)
        wait_until_waiting(server, "r3")
        quorums = ask_all(client, ["r1", "r2"]) + [f3.result()]
    assert {q.quorum_id for q in quorums} == {2}
    assert quorums[0].replica_ids() == ["r1", "r2", "r3"]


def wait_until_waiting(server: LighthouseServer, rid: str) -> None:
    deadline = time.monotonic() + 10
    while not any(w["replica_id"] == rid for w in server.status()["waiting"]):
        assert time.monotonic() < deadline, f"{rid} never started waiting"
        time.sleep(0.02)


def test_commit_failures_bump_quorum_id_over_the_wire(lighthouse):
    server = lighthouse(min_replicas=2)
    client = LighthouseClient(server.address())
    assert {q.quorum_id for q in ask_all(client, ["a", "b"])} == {1}
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(client.quorum, "a", 20, commit_failures=1)
        fb = pool.submit(client.quorum, "b", 20)
        assert fa.result().quorum_id == fb.result().quorum_id == 2
        assert fa.result().participants[0].commit_failures == 1


def test_client_deadline_is_honoured_and_withdraws_the_participant(lighthouse):
    server = lighthouse(min_replicas=2)
    client = LighthouseClient(server.address())
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        client.quorum("lonely", timeout=0.5)
    assert time.monotonic() - start < 5
    # The withdrawn requester is not counted as waiting any more (it is still heartbeating, though).
    deadline = time.monotonic() + 5
    while server.status()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    status = server.status()
    assert status["waiting"] == []
    assert [h["replica_id"] for h in status["heartbeats"]] == ["lonely"]


def test_join_timeout_waits_for_heartbeating_straggler_only(lighthouse):
    server = lighthouse(min_replicas=1, join_timeout_ms=600, quorum_tick_ms=20)
    client = LighthouseClient(server.address())
    # Two heartbeating replicas, so "a" alone would fail the split-brain guard; three: a, b join, c straggles.
    for rid in ("a", "b", "c"):
        client.heartbeat(rid)
    start = time.monotonic()
    quorums = ask_all(client, ["a", "b"])
    waited = time.monotonic() - start
    assert quorums[0].replica_ids() == ["a", "b"]
    assert waited >= 0.5, f"quorum issued after {waited:.3f} s, before the join timeout"
    # A silent replica (no heartbeat) is never waited for.
    server2 = lighthouse(min_replicas=1, join_timeout_ms=60000, quorum_tick_ms=20)
    c2 = LighthouseClient(server2.address())
    start = time.monotonic()
    assert c2.quorum("x", timeout=10).replica_ids() == ["x"]
    assert time.monotonic() - start < 5


def test_a_fast_quorum_takes_along_a_healed_replica_that_arrives_a_moment_late(lighthouse):
    """Over the wire (`quorum.holders_on_their_way`): "s" trained on alone and committed step 5, "h" copied step 5
    from it and reaches the sync 0.5 s after "s": the same quorum takes both. With the grace off (TorchFT's rule),
    "s" gets a quorum of its own at once, and "h" would wait for the next one."""
    for grace, expect in ((3000, ["h:2", "s:1"]), (0, ["s:1"])):
        server = lighthouse(min_replicas=1, join_timeout_ms=HOUR_MS, quorum_tick_ms=20, holder_grace_ms=grace)
        client = LighthouseClient(server.address())
        assert client.quorum("s:1", timeout=10).replica_ids() == ["s:1"]  # the last quorum: "s" alone
        for rid in ("s:1", "h:2"):
            client.heartbeat(rid, committed=(5, 1, 0, 0))
        with ThreadPoolExecutor(2) as pool:
            survivor = pool.submit(client.quorum, "s:1", 10)
            time.sleep(0.5)
            late = pool.submit(client.quorum, "h:2", 10) if grace else None
            assert survivor.result().replica_ids() == expect
            if late is not None:
                assert late.result().replica_ids() == expect
        grace_stats = server.status()["holder_grace"]
        if grace:  # counted: one wait, ~0.5 s, and the replica came
            assert (grace_stats["waits"], grace_stats["came"], grace_stats["timed_out"]) == (1, 1, 0), grace_stats
            assert 0.3 < grace_stats["waited_s"] < 3.0, grace_stats
        else:
            assert grace_stats["waits"] == 0, grace_stats


def test_a_holder_grace_that_ends_with_nobody_is_counted(lighthouse):
    """The grace is bounded: "h" heartbeats at the committed step but never joins, so "s" gets its quorum once
    the grace is over, and the Lighthouse counts a wait that timed out."""
    server = lighthouse(min_replicas=1, join_timeout_ms=HOUR_MS, quorum_tick_ms=20, holder_grace_ms=300)
    client = LighthouseClient(server.address())
    assert client.quorum("s:1", timeout=10).replica_ids() == ["s:1"]
    for rid in ("s:1", "h:2"):
        client.heartbeat(rid, committed=(5, 1, 0, 0))
    start = time.monotonic()
    assert client.quorum("s:1", timeout=10).replica_ids() == ["s:1"]
    assert time.monotonic() - start >= 0.25
    grace_stats = server.status()["holder_grace"]
    assert (grace_stats["waits"], grace_stats["came"], grace_stats["timed_out"]) == (1, 0, 1), grace_stats


def test_a_late_member_is_left_out_over_the_wire_and_counted(lighthouse):
    """Rule 4b over the wire (`quorum.late_members`): "a", "b" and "c" were the last quorum and all three
    heartbeat; "c" does not come to the next sync. With the rule on, "a" and "b" get their quorum once they have
    waited `late_member_ms` for it (not the hour-long join timeout), and the Lighthouse counts the quorum and whom
    it left out. Off (the default, TorchFT's rules), "c" is still waited for."""
    server = lighthouse(min_replicas=1, join_timeout_ms=HOUR_MS, quorum_tick_ms=20, late_member_ms=400)
    client = LighthouseClient(server.address())
    for rid in ("a:1", "b:1", "c:1"):
        client.heartbeat(rid)  # all three first, so that none forms a quorum alone
    assert ask_all(client, ["a:1", "b:1", "c:1"])[0].replica_ids() == ["a:1", "b:1", "c:1"]
    client.heartbeat("c:1")
    start = time.monotonic()
    assert ask_all(client, ["a:1", "b:1"])[0].replica_ids() == ["a:1", "b:1"]
    assert 0.3 < time.monotonic() - start < 5.0
    assert server.status()["late_members"] == {"quorums": 1, "left_out": 1}
    assert server.status()["options"]["late_member_ms"] == 400
    off = lighthouse(min_replicas=1, join_timeout_ms=HOUR_MS, quorum_tick_ms=20)
    client = LighthouseClient(off.address())
    for rid in ("a:1", "b:1", "c:1"):
        client.heartbeat(rid)
    assert ask_all(client, ["a:1", "b:1", "c:1"])[0].replica_ids() == ["a:1", "b:1", "c:1"]
    client.heartbeat("c:1")
    with pytest.raises(Exception):  # noqa: B017 - the quorum call's deadline: nobody was left out
        client.quorum("a:1", timeout=1.0)
    assert off.status()["late_members"] == {"quorums": 0, "left_out": 0}


def test_dead_incarnations_are_not_waited_for(lighthouse):
    # heartbeat timeout of an hour: without the two rules below the survivor would wait that long
    server = lighthouse(min_replicas=1, join_timeout_ms=HOUR_MS, quorum_tick_ms=20, heartbeat_timeout_ms=HOUR_MS)
    client = LighthouseClient(server.address())
    for rid in ("a:1", "b:1"):
        client.heartbeat(rid)  # both heartbeating first, so neither forms a quorum alone
    assert ask_all(client, ["a:1", "b:1"])[0].replica_ids() == ["a:1", "b:1"]
    # a:1 dies: b:1 alone is not more than half of the two heartbeating replicas, so it waits ...
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.quorum, "b:1", 20)
        wait_until_waiting(server, "b:1")
        time.sleep(0.2)
        assert not waiting.done()
        # ... until the supervisor that saw a:1 die says so
        assert server.forget_replicas(["a:1"]) == ["a:1"]
        assert waiting.result(timeout=10).replica_ids() == ["b:1"]
    # a group's new incarnation retires the old id at its first heartbeat: c:1 "dies", c:2 comes up
    with ThreadPoolExecutor(1) as pool:  # c:1 joins; b:1's next request takes it along (fast quorum)
        joining = pool.submit(client.quorum, "c:1", 20)
        wait_until_waiting(server, "c:1")
        assert client.quorum("b:1", 20).replica_ids() == ["b:1", "c:1"] == joining.result().replica_ids()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.quorum, "b:1", 20)
        wait_until_waiting(server, "b:1")
        # the restarted group asks to join (a request is a heartbeat too): both go on together at once
        assert client.quorum("c:2", 20).replica_ids() == ["b:1", "c:2"] == waiting.result().replica_ids()
    assert sorted(h["replica_id"] for h in server.status()["heartbeats"]) == ["b:1", "c:2"]


def test_excluded_joiner_waits_for_next_quorum(lighthouse):
    server = lighthouse(min_replicas=2, join_timeout_ms=60000, quorum_tick_ms=20)
    client = LighthouseClient(server.address())
    assert ask_all(client, ["a", "b"])[0].replica_ids() == ["a", "b"]

    with ThreadPoolExecutor(3) as pool:
        fc = pool.submit(client.quorum, "c", 30)
        wait_until_waiting(server, "c")
        fa = pool.submit(client.quorum, "a", 30, shrink_only=True)
        fb = pool.submit(client.quorum, "b", 30)
        qa, qb = fa.result(), fb.result()
        assert qa.replica_ids() == qb.replica_ids() == ["a", "b"]
        assert qa.quorum_id == 1
        assert not fc.done()
        # "c" re-inserted itself; the next round includes it.
        quorums = ask_all(client, ["a", "b"])
        qc = fc.result(timeout=30)
    assert qc.replica_ids() == ["a", "b", "c"]
    assert quorums[0].quorum_id == qc.quorum_id == 2


def test_dashboard_pages(lighthouse):
    server = lighthouse(min_replicas=1)
    client = LighthouseClient(server.address())
    client.quorum("rep-0:abc", timeout=10, step=3, address="127.0.0.1:1")
    client.quorum("rep-0:abc", timeout=10, step=3, address="127.0.0.1:1")
    with urllib.request.urlopen(server.dashboard_url(), timeout=10) as resp:
        page = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/html")
    assert "status.json" in page and "recovering" in page
    status = get_json(server.dashboard_url() + "status.json")
    assert status["quorum_id"] == 1
    assert status["prev_quorum"]["participants"][0]["replica_id"] == "rep-0:abc"
    assert status["prev_quorum"]["participants"][0]["recovering"] is False
    assert status["max_step"] == 3
    code, body = post(server.dashboard_url() + "replica/nobody/kill")
    assert code == 404 and "nobody" in body["error"]
    # A member whose manager is not listening: a clear 502, not a hang.
    code, body = post(server.dashboard_url() + "replica/rep-0:abc/kill")
    assert code == 502 and "127.0.0.1:1" in body["error"]
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(server.dashboard_url() + "nope", timeout=10)


def test_recovering_member_is_flagged(lighthouse):
    server = lighthouse(min_replicas=2)
    client = LighthouseClient(server.address())
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(client.quorum, "a", 20, step=10)
        fb = pool.submit(client.quorum, "b", 20, step=4)
        fa.result(), fb.result()
    members = {m["replica_id"]: m for m in server.status()["prev_quorum"]["participants"]}
    assert members["a"]["recovering"] is False
    assert members["b"]["recovering"] is True


def test_client_unreachable_names_address_and_fix():
    port = free_port_pair()
    client = LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"Lighthouse at 127.0.0.1:{port} unreachable.*set --lighthouse"):
        client.quorum("a", timeout=30)
    assert time.monotonic() - start < 10
    with pytest.raises(ConnectionError):
        client.heartbeat("a", timeout=0.3)


def test_address_forms():
    assert normalize_address("http://h:1") == "h:1"
    assert normalize_address("h:1") == "h:1"
    assert normalize_address("http://[::1]:5/") == "[::1]:5"
    with pytest.raises(ValueError):
        normalize_address("http://")
    assert parse_bind("[::]:29510") == ("::", 29510)
    assert parse_bind("0.0.0.0:1") == ("0.0.0.0", 1)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_bind("nonsense")


def test_port_in_use_is_a_clear_error(lighthouse):
    server = lighthouse()
    with pytest.raises(OSError, match="another Lighthouse running"):
        LighthouseServer(bind=f"127.0.0.1:{server.port}")


def test_cli_accepts_both_spellings():
    parser = build_parser("lighthouse")
    a = parser.parse_args(["lighthouse", "--min_replicas", "3", "--join_timeout_ms", "5", "--quorum_tick_ms", "7",
                           "--heartbeat_timeout_ms", "9"])
    b = parser.parse_args(["lighthouse", "--min-replicas", "3", "--join-timeout-ms", "5", "--quorum-tick-ms", "7",
                           "--heartbeat-timeout-ms", "9", "--holder-grace-ms", "0"])
    assert (a.holder_grace_ms, b.holder_grace_ms) == (2000, 0)
    for args in (a, b):
        assert (args.min_replicas, args.join_timeout_ms, args.quorum_tick_ms, args.heartbeat_timeout_ms) == (3, 5, 7, 9)
        assert args.bind == "127.0.0.1:29510"
        assert callable(args.func)


def test_state_file_keeps_quorum_ids_increasing_across_restarts(tmp_path):
    state_file = tmp_path / "sub" / "lighthouse.json"
    first = LighthouseServer(min_replicas=1, state_file=state_file)
    try:
        client = LighthouseClient(first.address())
        assert client.quorum("a", timeout=10).quorum_id == 1
        assert client.quorum("a", timeout=10, commit_failures=1).quorum_id == 2
        assert client.quorum("a", timeout=10).quorum_id == 2
    finally:
        first.shutdown()
    saved = json.loads(state_file.read_text())
    assert (saved["quorum_id"], saved["members"]) == (2, ["a"])
    second = LighthouseServer(min_replicas=1, state_file=state_file)
    try:
        client = LighthouseClient(second.address())
        # the last quorum's members come back: the same id, so nobody rebuilds its process group
        assert client.quorum("a", timeout=10).quorum_id == 2
        assert client.quorum("a", timeout=10, commit_failures=1).quorum_id == 3
        assert second.status()["state_file"] == str(state_file)
    finally:
        second.shutdown()
    state_file.write_text("garbage")
    with pytest.raises(ValueError, match="delete it"):
        LighthouseServer(state_file=state_file)


def test_quorum_without_requester_is_rejected(lighthouse):
    import grpc

    from regent.ft.proto import torchft_pb2, torchft_pb2_grpc

    server = lighthouse()
    with grpc.insecure_channel(normalize_address(server.address())) as channel:
        stub = torchft_pb2_grpc.LighthouseServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Quorum(torchft_pb2.LighthouseQuorumRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "missing requester" in info.value.details()
        # The raw wire form round-trips: the generated stub decodes our pre-encoded responses.
        reply = stub.Quorum(
            torchft_pb2.LighthouseQuorumRequest(requester=torchft_pb2.QuorumMember(replica_id="w", data="not json")),
            timeout=10,
        )
        assert reply.quorum.participants[0].data == "not json"
        assert reply.quorum.HasField("created")
    assert server.status()["prev_quorum"]["participants"][0]["data"] == {"raw": "not json"}


def test_cancelled_quorum_call_withdraws_the_participant(lighthouse):
    import grpc

    from regent.ft.proto import torchft_pb2, torchft_pb2_grpc

    server = lighthouse(min_replicas=2)
    with grpc.insecure_channel(normalize_address(server.address())) as channel:
        stub = torchft_pb2_grpc.LighthouseServiceStub(channel)
        request = torchft_pb2.LighthouseQuorumRequest(requester=torchft_pb2.QuorumMember(replica_id="w"))
        call = stub.Quorum.future(request, timeout=30)
        deadline = time.monotonic() + 5
        while not server.status()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [w["replica_id"] for w in server.status()["waiting"]] == ["w"]
        call.cancel()
        while server.status()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.status()["waiting"] == []
        # A request that is not a LighthouseQuorumRequest at all: INVALID_ARGUMENT.
        garbage = channel.unary_unary("/torchft.LighthouseService/Quorum")
        with pytest.raises(grpc.RpcError) as info:
            garbage(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _dual_stack_missing() -> str | None:
    """Why a dual-stack [::] socket cannot be had here (no IPv6), or None."""
    if not socket.has_ipv6:
        return "this Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
    except OSError as err:
        return f"no dual-stack IPv6 on this machine ({err})"
    return None


def test_wildcard_ipv6_bind_serves_ipv4_clients(lighthouse):
    """TorchFT's integration tests bind the Lighthouse to [::]:0 and dial 127.0.0.1: both must work."""
    missing = _dual_stack_missing()
    if missing:
        pytest.skip(missing)
    server = lighthouse(bind="[::]:0", min_replicas=1)
    for host in ("127.0.0.1", "[::1]"):
        client = LighthouseClient(f"http://{host}:{server.port}", connect_timeout=10)
        client.heartbeat("r:1", timeout=10)
        assert client.quorum("r:1", 10).replica_ids() == ["r:1"]
        client.close()
    status = get_json(f"http://127.0.0.1:{server.port + 1}/status.json")  # the dashboard too
    assert status["quorum_id"] == 1 and status["quorums_issued"] == 2
