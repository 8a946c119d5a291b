"""HTTP/2 abuse suite for `regent.ft.grpc_lite`, the Lighthouse's own gRPC server (issue 16, "Bounded everything").

Every case runs a real Lighthouse on a real socket, attacks it with hand-built frames from a raw socket, and checks
four things: the abusive connection is ended with the right HTTP/2 error (GOAWAY code or RST_STREAM) within a
bounded time; a well-behaved Regent client keeps getting heartbeats and a quorum answered during the attack; the
server's memory, threads and connections stay bounded; and the refusal is counted (`Server.counters`).

The timeouts are shortened through `grpc_lite.Limits` so the suite stays fast; the floods are a few thousand
frames, not minutes. Set REGENT_ABUSE_REPORT=FILE to append one JSON line per attack (for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import hpack
import pytest

from regent.ft import grpc_lite
from regent.ft.grpc_lite import (
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
)
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient
from regent.ft.proto import torchft_pb2
from regent.ft.rpc_security import TLSFiles

END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
QUORUM = "/torchft.LighthouseService/Quorum"
# Shortened for the suite; what each bounds (and the production values) is in grpc_lite's constants.
TEST_LIMITS = dict(handshake_timeout=1.0, idle_timeout=1.5, request_timeout=1.5, partial_frame_timeout=1.0,
                   send_stall_timeout=1.0, goaway_linger=1.0)
# How long the server may take to end an abusive connection: the limit plus two timer ticks and a loaded box.
CLOSE_WITHIN_S = 5.0
RSS_GROWTH_MB = 64  # what one attack may add to this process (server + test client): leaks would be far larger


# ---- a tiny HTTP/2 client made of raw frames -------------------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame, built by hand (RFC 9113 section 4.1), so tests can send what no real client would."""
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, stream_id & 0x7FFFFFFF) + payload


def settings(*pairs: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs))


def request_block(path: str, encoder: hpack.Encoder | None = None, extra: list[tuple[str, str]] = ()) -> bytes:
    """The header block of a gRPC request (HPACK, fresh encoder by default: no dynamic-table references)."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "lighthouse"),
               ("content-type", "application/grpc"), ("te", "trailers"), *extra]
    return (encoder or hpack.Encoder()).encode(headers)


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def heartbeat_body(replica: str = "raw") -> bytes:
    return grpc_message(torchft_pb2.LighthouseHeartbeatRequest(replica_id=replica).SerializeToString())


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def error(self) -> int:
        """The error code of a GOAWAY or RST_STREAM."""
        return struct.unpack(">I", self.payload[4:8] if self.kind == GOAWAY else self.payload[:4])[0]


@dataclass
class RawH2:
    """A raw client socket: send anything, then read back frames until the server closes or time runs out."""

    port: int
    handshake: bool = True
    sock: socket.socket = field(init=False)
    _buf: bytearray = field(default_factory=bytearray)
    closed: bool = False

    def __post_init__(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        if self.handshake:
            self.send(PREFACE + settings())

    def send(self, data: bytes) -> bool:
        """False once the server has closed the connection (a flood stops there)."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def frames(self, until: float = CLOSE_WITHIN_S, stop=None) -> list[Frame]:
        """Frames read for up to `until` s, until the server closes, or until `stop(frame)` is true."""
        out: list[Frame] = []
        deadline = time.monotonic() + until
        while time.monotonic() < deadline:
            while len(self._buf) >= 9:
                length = int.from_bytes(self._buf[:3], "big")
                if len(self._buf) < 9 + length:
                    break
                f = Frame(self._buf[3], self._buf[4], int.from_bytes(self._buf[5:9], "big") & 0x7FFFFFFF,
                          bytes(self._buf[9:9 + length]))
                del self._buf[:9 + length]
                out.append(f)
                if stop is not None and stop(f):
                    return out
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
        return out

    def goaway(self, until: float = CLOSE_WITHIN_S) -> Frame | None:
        """The server's GOAWAY, reading up to the close (and checking that the close comes)."""
        found = [f for f in self.frames(until) if f.kind == GOAWAY]
        return found[0] if found else None

    def close(self) -> None:
        self.sock.close()


# ---- the server, a well-behaved client and the bounds ----------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class GoodClient:
    """A Regent LighthouseClient heartbeating from a thread through the attack; it must never fail."""

    def __init__(self, address: str) -> None:
        self.client = LighthouseClient(address, connect_timeout=10, secret=b"", tls=TLSFiles())
        self.errors: list[BaseException] = []
        self.calls = 0
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                self.client.heartbeat("good", timeout=10)
            except Exception as err:  # noqa: BLE001 - collected and asserted on by the test
                self.errors.append(err)
            self.worst = max(self.worst, time.monotonic() - start)
            self.calls += 1
            self._stop.wait(0.02)

    def __enter__(self) -> GoodClient:
        self.client.quorum("good", timeout=10)  # a real Lighthouse quorum before the attack
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if exc[0] is None:
            q = self.client.quorum("good", timeout=10)  # and after it
            assert [m.replica_id for m in q.participants] == ["good"]
        self.client.close()
        if exc[0] is None:
            assert not self.errors, f"the well-behaved client failed during the attack: {self.errors[:3]}"
            assert self.calls >= 1
            assert self.worst < CLOSE_WITHIN_S, f"a heartbeat took {self.worst:.2f} s during the attack"


@dataclass
class Target:
    lighthouse: LighthouseServer
    server: grpc_lite.Server

    @property
    def port(self) -> int:
        return self.lighthouse.port

    def wait_connections(self, at_most: int, timeout: float = CLOSE_WITHIN_S) -> int:
        deadline = time.monotonic() + timeout
        while self.server.connections > at_most and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.server.connections


def _make(monkeypatch: pytest.MonkeyPatch, **limits: object) -> Iterator[Target]:
    monkeypatch.setattr(grpc_lite, "Limits", functools.partial(grpc_lite.Limits, **{**TEST_LIMITS, **limits}))
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, secret=b"",
                                  tls=TLSFiles())
    try:
        server = lighthouse._server
        assert isinstance(server, grpc_lite.Server)
        yield Target(lighthouse, server)
    finally:
        lighthouse.shutdown()


# Cases that need longer limits than TEST_LIMITS (so that only the bound under test can end them).
LIMITS_FOR: dict[str, dict[str, object]] = {
    "test_too_many_connections_from_one_peer": dict(max_connections_per_peer=8, limit_loopback_peers=True,
                                                    handshake_timeout=30, idle_timeout=30),
    "test_request_bytes_per_connection_bounded": dict(max_buffered_request_bytes=4 << 20, request_timeout=30,
                                                      idle_timeout=30),
    "test_too_many_concurrent_streams": dict(request_timeout=30, idle_timeout=30),
}


@pytest.fixture
def target(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Target]:
    yield from _make(monkeypatch, **LIMITS_FOR.get(request.node.originalname, {}))


def server_side(target: Target, h2: RawH2) -> grpc_lite._Connection:
    """The server's connection object for a raw client (to check what it holds)."""
    port = h2.sock.getsockname()[1]
    return next(c for c in list(target.server._connections) if c._peer.endswith(f":{port}"))


def wait_for(predicate: Callable[[], bool], timeout: float = CLOSE_WITHIN_S) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def attack(target: Target, request: pytest.FixtureRequest):
    """Run the test's attack beside a good client; afterwards check threads, memory and connections."""
    threads = threading.active_count()
    rss = rss_mb()
    with GoodClient(target.lighthouse.address()) as good:
        yield good
    growth = rss_mb() - rss
    assert growth < RSS_GROWTH_MB, f"RSS grew by {growth:.0f} MB"
    assert threading.active_count() <= threads + 1, "the attack left threads behind"
    assert target.wait_connections(0) == 0, "a connection is still open after the attack"
    report = os.environ.get("REGENT_ABUSE_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"test": request.node.name, "rss_growth_mb": round(growth, 1),
                                "good_calls": good.calls, "good_worst_s": round(good.worst, 3),
                                "threads": threading.active_count() - threads,
                                "counters": dict(target.server.counters), **getattr(good, "report", {})}) + "\n")


def timed_close(good: GoodClient, start: float, what: str) -> float:
    elapsed = time.monotonic() - start
    good.report = {"close_s": round(elapsed, 3), "what": what}  # type: ignore[attr-defined]
    assert elapsed < CLOSE_WITHIN_S + 5, f"{what}: closed after {elapsed:.1f} s"
    return elapsed


# ---- floods ----------------------------------------------------------------------------------------------------


def test_rapid_reset(target: Target, attack: GoodClient) -> None:
    """CVE-2023-44487: open a stream and reset it at once, thousands of times; each costs the server a dispatch."""
    h2 = RawH2(target.port)
    block = request_block(QUORUM)
    start = time.monotonic()
    for i in range(5000):
        sid = 1 + 2 * i
        if not h2.send(frame(HEADERS, END_HEADERS, sid, block) + frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL))):
            break
    away = h2.goaway()
    assert away is not None and away.error == ENHANCE_YOUR_CALM
    timed_close(attack, start, "rapid reset")
    assert h2.closed
    assert target.server.counters["rapid_reset"] == 1
    last_stream = struct.unpack(">I", away.payload[:4])[0]
    assert last_stream < 2 * 5000 - 1, "the whole flood was served"


def test_ping_flood(target: Target, attack: GoodClient) -> None:
    """PINGs sent faster than any keepalive, without reading the ACKs: refused, not answered without end."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    for i in range(5000):
        if not h2.send(frame(PING, 0, 0, struct.pack(">Q", i))):
            break
    got = h2.frames()
    acks = [f for f in got if f.kind == PING and f.flags & ACK]
    away = [f for f in got if f.kind == GOAWAY]
    assert away and away[0].error == ENHANCE_YOUR_CALM
    timed_close(attack, start, "PING flood")
    assert len(acks) <= grpc_lite.PING_BURST + 10  # answered up to the budget, then cut off
    assert target.server.counters["ping_flood"] == 1


def test_settings_flood(target: Target, attack: GoodClient) -> None:
    """SETTINGS frames, each owed an ACK, thousands at once."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    for _ in range(3000):
        if not h2.send(settings((grpc_lite.SETTINGS_INITIAL_WINDOW_SIZE, 65535))):
            break
    got = h2.frames()
    away = [f for f in got if f.kind == GOAWAY]
    assert away and away[0].error == ENHANCE_YOUR_CALM
    timed_close(attack, start, "SETTINGS flood")
    assert sum(f.kind == SETTINGS and f.flags & ACK for f in got) <= grpc_lite.SETTINGS_BURST + 5
    assert target.server.counters["settings_flood"] == 1


def test_continuation_flood(target: Target, attack: GoodClient) -> None:
    """A header block that never ends: empty CONTINUATION frames grow nothing, so only a count stops them."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    h2.send(frame(HEADERS, 0, 1, request_block(HEARTBEAT)))
    for _ in range(10_000):
        if not h2.send(frame(CONTINUATION, 0, 1)):
            break
    away = h2.goaway()
    assert away is not None and away.error == ENHANCE_YOUR_CALM
    timed_close(attack, start, "CONTINUATION flood (empty frames)")
    assert target.server.counters["continuation_flood"] == 1


def test_continuation_block_too_large(target: Target, attack: GoodClient) -> None:
    """Full-size CONTINUATION frames: the header block is cut off at 64 KiB, not buffered without end."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    h2.send(frame(HEADERS, 0, 1, b"\x00" * 16_384))
    for _ in range(100):
        if not h2.send(frame(CONTINUATION, 0, 1, b"\x00" * 16_384)):
            break
    away = h2.goaway()
    assert away is not None and away.error == PROTOCOL_ERROR
    timed_close(attack, start, "CONTINUATION, 16 KiB each")
    assert target.server.counters["header_block_too_large"] == 1


# ---- slowloris -------------------------------------------------------------------------------------------------


def test_preface_byte_by_byte(target: Target, attack: GoodClient) -> None:
    """The preface trickled one byte every 100 ms: the handshake must finish within its timeout."""
    h2 = RawH2(target.port, handshake=False)
    start = time.monotonic()
    for byte in PREFACE:
        if not h2.send(bytes([byte])):
            break
        time.sleep(0.1)
        if time.monotonic() - start > 2 * TEST_LIMITS["handshake_timeout"] + 1:
            break
    away = h2.goaway(until=1)
    assert h2.closed and away is not None and away.error == PROTOCOL_ERROR
    elapsed = timed_close(attack, start, "preface byte by byte")
    assert elapsed < TEST_LIMITS["handshake_timeout"] + 2
    assert target.server.counters["handshake_timeout"] == 1


def test_silent_connections(target: Target, attack: GoodClient) -> None:
    """Connections that open and never send a byte are closed after the handshake timeout."""
    silent = [RawH2(target.port, handshake=False) for _ in range(50)]
    start = time.monotonic()
    assert wait_for(lambda: target.server.connections >= 51)
    for h2 in silent:
        away = h2.goaway()
        assert h2.closed and away is not None and away.error == PROTOCOL_ERROR
        h2.close()
    timed_close(attack, start, "50 silent connections")
    assert target.server.counters["handshake_timeout"] == 50


def test_idle_connection(target: Target, attack: GoodClient) -> None:
    """Preface and SETTINGS, then silence (only PINGs): GOAWAY(NO_ERROR) after the idle timeout."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    got: list[Frame] = []
    while not h2.closed and time.monotonic() - start < CLOSE_WITHIN_S:
        h2.send(frame(PING, 0, 0, b"keepaliv"))  # pings keep nothing alive
        got += h2.frames(until=0.3)
    away = [f for f in got if f.kind == GOAWAY]
    assert h2.closed and away and away[0].error == NO_ERROR
    elapsed = timed_close(attack, start, "idle connection (PINGs only)")
    # not before the timeout (20 ms of slack: the server's timer counts from its own clock reading, taken on
    # its loop a moment after this test's `start`; a run measured 1.49989 s against 1.5 s)
    assert elapsed >= TEST_LIMITS["idle_timeout"] - 0.02
    assert target.server.counters["idle_timeout"] == 1


def test_partial_frame_left_hanging(target: Target, attack: GoodClient) -> None:
    """A frame header that announces 100 bytes, 10 of them sent, then nothing."""
    h2 = RawH2(target.port)
    h2.send(frame(HEADERS, END_HEADERS, 1, request_block(HEARTBEAT)))  # a stream is open: not merely idle
    start = time.monotonic()
    h2.send(struct.pack(">BHBBI", 0, 100, DATA, 0, 1) + b"x" * 10)
    away = h2.goaway()
    assert away is not None and away.error == PROTOCOL_ERROR
    timed_close(attack, start, "partial frame left hanging")
    assert target.server.counters["partial_frame_timeout"] == 1


def test_header_block_left_hanging(target: Target, attack: GoodClient) -> None:
    """HEADERS without END_HEADERS: no other frame may come on this connection, so it must not last."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    h2.send(frame(HEADERS, 0, 1, request_block(HEARTBEAT)))
    away = h2.goaway()
    assert away is not None and away.error == PROTOCOL_ERROR
    timed_close(attack, start, "header block left unfinished")
    assert target.server.counters["partial_frame_timeout"] == 1


def test_request_body_trickle(target: Target, attack: GoodClient) -> None:
    """A request body that never finishes holds a stream: it is reset (RST_STREAM CANCEL)."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    h2.send(frame(HEADERS, END_HEADERS, 1, request_block(HEARTBEAT)) + frame(DATA, 0, 1, heartbeat_body()[:3]))
    got = h2.frames(stop=lambda f: f.kind == RST_STREAM)
    assert got and got[-1].kind == RST_STREAM and got[-1].stream_id == 1 and got[-1].error == CANCEL
    timed_close(attack, start, "request body trickle")
    assert target.server.counters["request_timeout"] == 1
    h2.close()


def test_response_never_read(target: Target, attack: GoodClient) -> None:
    """A client that gives the response no flow-control window: the stream is reset, the memory let go."""
    h2 = RawH2(target.port, handshake=False)
    h2.send(PREFACE + settings((grpc_lite.SETTINGS_INITIAL_WINDOW_SIZE, 0)))
    start = time.monotonic()
    h2.send(frame(HEADERS, END_HEADERS, 1, request_block(HEARTBEAT)) + frame(DATA, END_STREAM, 1, heartbeat_body()))
    got = h2.frames(stop=lambda f: f.kind == RST_STREAM)
    assert got and got[-1].kind == RST_STREAM and got[-1].error == CANCEL
    assert not any(f.kind == DATA for f in got)
    timed_close(attack, start, "response given no window")
    assert target.server.counters["send_stall"] == 1
    h2.close()


def test_too_many_connections_from_one_peer(target: Target, attack: GoodClient) -> None:
    """Past the per-peer bound a new connection gets GOAWAY(ENHANCE_YOUR_CALM) at once; the held ones and the
    good client are unaffected, and a slot freed is usable again."""
    held = [RawH2(target.port) for _ in range(7)]  # with the good client: 8 from 127.0.0.1
    assert wait_for(lambda: target.server.connections == 8)
    start = time.monotonic()
    extra = [RawH2(target.port) for _ in range(20)]
    for h2 in extra:
        away = h2.goaway()
        assert h2.closed and away is not None and away.error == ENHANCE_YOUR_CALM
    timed_close(attack, start, "connections beyond 8 from one peer")
    assert target.server.connections == 8
    assert target.server.counters["too_many_connections"] == 20
    held[0].close()
    assert wait_for(lambda: target.server.connections == 7)
    again = RawH2(target.port)
    again.send(frame(HEADERS, END_HEADERS, 1, request_block(HEARTBEAT)) +
               frame(DATA, END_STREAM, 1, heartbeat_body()))
    assert any(f.kind == DATA for f in again.frames(stop=lambda f: f.kind == DATA))
    for h2 in [*held, *extra, again]:
        h2.close()


# ---- malformed and oversized -----------------------------------------------------------------------------------


def test_oversized_frame(target: Target, attack: GoodClient) -> None:
    """A frame above the 16 KiB SETTINGS_MAX_FRAME_SIZE we never raised: FRAME_SIZE_ERROR from its header alone."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    h2.send(struct.pack(">BHBBI", 0x10, 0, DATA, 0, 1))  # announces 1 MiB; nothing of it needs to follow
    away = h2.goaway()
    assert away is not None and away.error == FRAME_SIZE_ERROR
    timed_close(attack, start, "oversized frame (1 MiB announced)")


def test_huge_declared_message_length(target: Target, attack: GoodClient) -> None:
    """A gRPC prefix that declares 4 GiB: RESOURCE_EXHAUSTED from the 5 bytes, before any body is buffered; the
    connection stays usable."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    h2.send(frame(HEADERS, END_HEADERS, 1, request_block(HEARTBEAT)) + frame(DATA, 0, 1, b"\x00\xff\xff\xff\xff"))
    got = h2.frames(stop=lambda f: f.kind == RST_STREAM)
    trailers = hpack.Decoder().decode(next(f.payload for f in got if f.kind == HEADERS))
    assert ("grpc-status", "8") in trailers  # RESOURCE_EXHAUSTED
    assert got[-1].kind == RST_STREAM and got[-1].stream_id == 1
    timed_close(attack, start, "gRPC prefix declaring 4 GiB")
    h2.send(frame(HEADERS, END_HEADERS, 3, request_block(HEARTBEAT)) + frame(DATA, END_STREAM, 3, heartbeat_body()))
    assert any(f.kind == DATA and f.stream_id == 3 for f in h2.frames(stop=lambda f: f.kind == DATA))
    assert target.server.counters["oversized_message"] == 1
    h2.close()


def test_request_bytes_per_connection_bounded(target: Target, attack: GoodClient) -> None:
    """Many streams with unfinished bodies: the connection window stops being refilled at the bound, so the
    bytes the server holds for one connection stop growing (the client must wait, not the server's memory)."""
    cap = target.server.limits.max_buffered_request_bytes
    h2 = RawH2(target.port)
    credit = 65_535 - 5  # the initial connection window less the prefix; the server's WINDOW_UPDATEs add to it
    streams = [1 + 2 * i for i in range(16)]
    for sid in streams:
        h2.send(frame(HEADERS, END_HEADERS, sid, request_block(HEARTBEAT)))
    h2.send(frame(DATA, 0, streams[0], b"\x00" + struct.pack(">I", 3 * 1024 * 1024)))
    sent, per_stream = 5, dict.fromkeys(streams, 0)
    chunk = b"\x00" * 16_384
    for _ in range(200):
        while credit >= len(chunk):
            sid = min(per_stream, key=per_stream.get)  # spread over the streams, each under its window
            if per_stream[sid] + len(chunk) > grpc_lite.RECV_WINDOW - 16:
                break
            h2.send(frame(DATA, 0, sid, chunk))
            per_stream[sid] += len(chunk)
            credit -= len(chunk)
            sent += len(chunk)
        updates = [f for f in h2.frames(until=0.3) if f.kind == WINDOW_UPDATE and f.stream_id == 0]
        if not updates:
            break
        credit += sum(struct.unpack(">I", f.payload)[0] for f in updates)
    conn = server_side(target, h2)
    assert cap <= sent <= cap + grpc_lite.RECV_WINDOW + 5, sent  # + the prefix
    assert conn._buffered <= cap + grpc_lite.RECV_WINDOW + 5
    timed_close(attack, time.monotonic(), f"unfinished bodies on 16 streams: {sent >> 20} MiB accepted")
    h2.close()


def test_window_update_overflow(target: Target, attack: GoodClient) -> None:
    """Windows beyond 2^31-1: the connection's is a connection error, a stream's a stream error."""
    h2 = RawH2(target.port)
    h2.send(frame(HEADERS, END_HEADERS, 1, request_block(HEARTBEAT)))
    h2.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 2**31 - 1)))
    got = h2.frames(until=2, stop=lambda f: f.kind == RST_STREAM)
    assert got and got[-1].kind == RST_STREAM and got[-1].error == FLOW_CONTROL_ERROR
    start = time.monotonic()
    h2.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)))
    away = h2.goaway()
    assert away is not None and away.error == FLOW_CONTROL_ERROR
    timed_close(attack, start, "WINDOW_UPDATE overflow")
    # and through SETTINGS_INITIAL_WINDOW_SIZE, which moves every open stream's window
    h2 = RawH2(target.port)
    h2.send(frame(HEADERS, END_HEADERS, 1, request_block(HEARTBEAT)))
    h2.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 2**31 - 65_536)))
    h2.send(settings((grpc_lite.SETTINGS_INITIAL_WINDOW_SIZE, 2**31 - 1)))
    away = h2.goaway()
    assert away is not None and away.error == FLOW_CONTROL_ERROR


@pytest.mark.parametrize("second", [3, 1, 4], ids=["reused", "decreasing", "even"])
def test_stream_id_reuse_and_order(target: Target, attack: GoodClient, second: int) -> None:
    """Client stream ids are odd and rise: a reused, lower or even id ends the connection (PROTOCOL_ERROR)."""
    h2 = RawH2(target.port)
    h2.send(frame(HEADERS, END_HEADERS, 3, request_block(HEARTBEAT)) + frame(DATA, END_STREAM, 3, heartbeat_body()))
    assert any(f.kind == DATA for f in h2.frames(stop=lambda f: f.kind == DATA))
    start = time.monotonic()
    h2.send(frame(HEADERS, END_HEADERS, second, request_block(HEARTBEAT)))
    away = h2.goaway()
    assert away is not None and away.error == PROTOCOL_ERROR
    timed_close(attack, start, f"stream id {second} after 3")


def test_too_many_concurrent_streams(target: Target, attack: GoodClient) -> None:
    """One stream past the advertised SETTINGS_MAX_CONCURRENT_STREAMS is refused (RST_STREAM REFUSED_STREAM)
    while the others stay open; a stream of them still completes."""
    h2 = RawH2(target.port)
    n = grpc_lite.MAX_CONCURRENT_STREAMS
    encoder = hpack.Encoder()
    h2.send(b"".join(frame(HEADERS, END_HEADERS, 1 + 2 * i, request_block(HEARTBEAT, encoder)) for i in range(n + 1)))
    got = h2.frames(until=2, stop=lambda f: f.kind in (RST_STREAM, GOAWAY))
    assert got and got[-1].kind == RST_STREAM and got[-1].stream_id == 1 + 2 * n and got[-1].error == REFUSED_STREAM
    h2.send(frame(DATA, END_STREAM, 1, heartbeat_body()))
    assert any(f.kind == DATA and f.stream_id == 1 for f in h2.frames(stop=lambda f: f.kind == DATA))
    assert target.server.counters["refused_stream"] == 1
    h2.close()


def test_hpack_bomb(target: Target, attack: GoodClient) -> None:
    """A 4 KB header put in the dynamic table, then referenced 16,000 times from a 16 KB block (64 MB once
    decoded): the header list bound stops it (COMPRESSION_ERROR), nothing near 64 MB is built."""
    h2 = RawH2(target.port)
    encoder = hpack.Encoder()
    first = encoder.encode([*hpack.Decoder().decode(request_block(HEARTBEAT)), ("x-bomb", "v" * 4000)])
    h2.send(frame(HEADERS, END_HEADERS, 1, first) + frame(DATA, END_STREAM, 1, heartbeat_body()))
    assert any(f.kind == DATA for f in h2.frames(stop=lambda f: f.kind == DATA))
    index = 62  # the newest dynamic-table entry: the 4 KB header
    start = time.monotonic()
    h2.send(frame(HEADERS, END_HEADERS | END_STREAM, 3, bytes([0x80 | index]) * 16_000))
    away = h2.goaway()
    assert away is not None and away.error == COMPRESSION_ERROR
    timed_close(attack, start, "HPACK bomb (64 MB from 16 KB)")


def test_hpack_table_size_above_settings(target: Target, attack: GoodClient) -> None:
    """A dynamic-table size update above the 4096 bytes allowed: COMPRESSION_ERROR."""
    h2 = RawH2(target.port)
    start = time.monotonic()
    h2.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, grpc_lite.hpack_int(1 << 30, 5, 0x20) + b"\x83"))
    away = h2.goaway()
    assert away is not None and away.error == COMPRESSION_ERROR
    timed_close(attack, start, "HPACK table size 1 GiB")


def test_big_header_blocks_are_not_cached(target: Target, attack: GoodClient) -> None:
    """The per-connection decode cache keeps only small blocks: 64 distinct 30 KB blocks leave it small."""
    h2 = RawH2(target.port)
    lit = grpc_lite.literal_header  # literals without indexing: blocks that leave the table alone are cacheable
    for i in range(64):
        sid = 1 + 2 * i
        block = (b"\x83\x86" + lit(b":path", HEARTBEAT.encode()) + lit(b":authority", b"lh") +
                 lit(b"content-type", b"application/grpc") + lit(b"x-pad", b"%05d" % i + b"p" * 30_000))
        h2.send(frame(HEADERS, 0, sid, block[:16_000]) + frame(CONTINUATION, END_HEADERS, sid, block[16_000:]) +
                frame(DATA, END_STREAM, sid, heartbeat_body()))
    got = h2.frames(until=10, stop=lambda f: f.kind == HEADERS and f.stream_id == 127 and f.flags & END_STREAM)
    assert sum(f.kind == DATA for f in got) == 64
    conn = server_side(target, h2)
    assert sum(len(block) for _, block in conn._header_cache) <= grpc_lite.HEADER_CACHE_SIZE * \
        grpc_lite.HEADER_CACHE_MAX_BLOCK
    h2.close()
    timed_close(attack, time.monotonic(), "64 header blocks of 30 KB (cache bound)")
