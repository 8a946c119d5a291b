"""grpc_lite against real clients over real sockets: grpcio's client, and hand-written HTTP/2 frames for the parts
grpcio never sends on demand (CONTINUATION, PING, a tiny peer window)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import grpc
import hpack
import pytest

from regent.ft import grpc_lite
from regent.ft.grpc_lite import RpcStatusError, StatusCode


class LoopServer:
    """A grpc_lite.Server on a background asyncio loop, with a few test handlers."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.started = threading.Event()
        self.deadlines: list[float | None] = []
        self.replies: dict[bytes, grpc_lite.Reply] = {}  # the Later calls' replies, by request
        self.reply_cancelled = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = grpc_lite.Server(
            grpc_lite.method_table(
                "test.Svc",
                {"Echo": self.echo, "Slow": self.slow, "Fail": self.fail, "Wait": self.wait, "Big": self.big,
                 "Later": self.later},
            ),
            max_message_bytes=8 * 1024 * 1024,  # above the 4 MiB default: the large-message case sends 5 MiB
        )
        self.port = self.call(self.server.start("127.0.0.1", 0))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    # handlers
    def echo(self, request: bytes, deadline: float | None) -> bytes:
        self.deadlines.append(deadline)
        return request

    async def slow(self, request: bytes, deadline: float | None) -> bytes:
        await asyncio.sleep(0.01)
        return request[::-1]

    def fail(self, request: bytes, deadline: float | None) -> bytes:
        raise RpcStatusError(StatusCode.INVALID_ARGUMENT, "bad request: ünïcode 100%")

    async def wait(self, request: bytes, deadline: float | None) -> bytes:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            self.cancelled.set()
        return b""

    def later(self, request: bytes, deadline: float | None) -> grpc_lite.Reply:
        reply = grpc_lite.Reply(lambda r: self.reply_cancelled.set())
        self.replies[request] = reply
        return reply

    def settle(self, request: bytes, payload: bytes | None = None, err: Exception | None = None) -> None:
        """Answer the Later call of `request` from the loop, as a Lighthouse front end answers from its link."""
        async def go() -> None:
            reply = self.replies[request]
            reply.set_result(payload) if err is None else reply.set_exception(err)

        self.call(go())

    def wait_replies(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.replies) < n:
            assert time.monotonic() < deadline, "the Later calls did not arrive"
            time.sleep(0.01)

    def big(self, request: bytes, deadline: float | None) -> bytes:
        return bytes(range(256)) * (int(request.decode()) // 256)


@pytest.fixture
def server():
    srv = LoopServer()
    yield srv
    srv.stop()


@pytest.fixture
def channel(server):
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as ch:
        yield ch


def method(channel: grpc.Channel, name: str):
    return channel.unary_unary(f"/test.Svc/{name}")


def test_unary_roundtrip_and_deadline_header(server, channel):
    assert method(channel, "Echo")(b"hello", timeout=5) == b"hello"
    assert method(channel, "Echo")(b"") == b""
    assert method(channel, "Slow")(b"abc", timeout=5) == b"cba"
    # grpc-timeout becomes an absolute monotonic deadline; none without a timeout.
    assert server.deadlines[0] is not None and 3 < server.deadlines[0] - time.monotonic() <= 5
    assert server.deadlines[1] is None


def test_status_error_and_unknown_method(channel):
    with pytest.raises(grpc.RpcError) as info:
        method(channel, "Fail")(b"x", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "bad request: ünïcode 100%"
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/test.Svc/Nope")(b"x", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "/test.Svc/Nope" in info.value.details()


def test_deadline_exceeded_cancels_the_handler(server, channel):
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        method(channel, "Wait")(b"", timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 3
    assert server.cancelled.wait(5)


def test_client_cancel_cancels_the_handler(server, channel):
    future = method(channel, "Wait").future(b"", timeout=30)
    assert server.started.wait(5)
    future.cancel()
    assert server.cancelled.wait(5)


def test_large_messages_both_directions(channel):
    """5 MiB each way: more than a 16 KiB frame and more than any initial flow-control window."""
    payload = bytes(range(256)) * (5 * 1024 * 1024 // 256)
    assert method(channel, "Echo")(payload, timeout=30) == payload
    size = 3 * 1024 * 1024
    reply = method(channel, "Big")(str(size).encode(), timeout=30)
    assert len(reply) == size and reply[:256] == bytes(range(256))


def test_many_concurrent_streams(channel):
    futures = [method(channel, "Slow" if i % 2 else "Echo").future(b"%d" % i, timeout=30) for i in range(300)]
    for i, future in enumerate(futures):
        expected = (b"%d" % i)[::-1] if i % 2 else b"%d" % i
        assert future.result() == expected


def test_keepalive_pings_are_accepted(server):
    options = [
        ("grpc.keepalive_time_ms", 100),
        ("grpc.keepalive_timeout_ms", 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as ch:
        for _ in range(8):
            assert method(ch, "Echo")(b"ping?", timeout=5) == b"ping?"
            time.sleep(0.15)


def test_shutdown_ends_calls_in_flight_with_unavailable(server, channel):
    future = method(channel, "Wait").future(b"", timeout=30)
    assert server.started.wait(5)
    server.call(server.server.stop())
    with pytest.raises(grpc.RpcError) as info:
        future.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.cancelled.wait(5)


# ---- raw HTTP/2 -------------------------------------------------------------------------------------------------


class RawClient:
    """Just enough of an HTTP/2 client to send frames by hand and read what comes back."""

    def __init__(self, port: int, settings: bytes = b"") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(grpc_lite.PREFACE + grpc_lite.frame(grpc_lite.SETTINGS, 0, 0, settings))
        self.buf = b""
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self) -> tuple[int, int, int, bytes]:
        while True:
            if len(self.buf) >= 9:
                length = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) >= 9 + length:
                    kind, flags = self.buf[3], self.buf[4]
                    stream_id = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
                    payload = self.buf[9 : 9 + length]
                    self.buf = self.buf[9 + length :]
                    return kind, flags, stream_id, payload
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk

    def request_headers(self, path: str) -> bytes:
        return self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
            ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "5S"),
        ])

    def read_call(self, stream_id: int) -> tuple[list, bytes, list]:
        """Frames of one call until END_STREAM: (response headers, body, trailers); acks the server's SETTINGS."""
        headers: list = []
        trailers: list = []
        body = b""
        while True:
            kind, flags, sid, payload = self.read_frame()
            if kind == grpc_lite.SETTINGS and not flags & grpc_lite.FLAG_ACK:
                self.send(grpc_lite.frame(grpc_lite.SETTINGS, grpc_lite.FLAG_ACK, 0))
            if sid != stream_id:
                continue
            if kind == grpc_lite.HEADERS:
                decoded = self.decoder.decode(payload)
                (trailers if headers else headers).extend(decoded)
            elif kind == grpc_lite.DATA:
                body += payload
            if flags & grpc_lite.FLAG_END_STREAM:
                return headers, body, trailers or headers


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def test_raw_continuation_ping_and_small_peer_window(server):
    # The client allows only 10 bytes per stream: the server must send the response in pieces as credit arrives.
    raw = RawClient(server.port, settings=struct.pack(">HI", grpc_lite.SETTINGS_INITIAL_WINDOW_SIZE, 10))
    block = raw.request_headers("/test.Svc/Echo")
    raw.send(
        grpc_lite.frame(grpc_lite.HEADERS, 0, 1, block[:5])
        + grpc_lite.frame(grpc_lite.CONTINUATION, 0, 1, block[5:12])
        + grpc_lite.frame(grpc_lite.CONTINUATION, grpc_lite.FLAG_END_HEADERS, 1, block[12:])
        + grpc_lite.frame(grpc_lite.PING, 0, 0, b"12345678")
        + grpc_lite.frame(grpc_lite.DATA, grpc_lite.FLAG_END_STREAM, 1, grpc_message(b"0123456789abcdefghij"))
    )
    seen_ping_ack = False
    data = b""
    while True:
        kind, flags, sid, payload = raw.read_frame()
        if kind == grpc_lite.PING:
            assert flags & grpc_lite.FLAG_ACK and payload == b"12345678"
            seen_ping_ack = True
        elif kind == grpc_lite.DATA:
            assert len(payload) <= 10
            data += payload
            raw.send(grpc_lite.frame(grpc_lite.WINDOW_UPDATE, 0, 1, struct.pack(">I", len(payload))))
        elif kind == grpc_lite.HEADERS and sid == 1 and flags & grpc_lite.FLAG_END_STREAM:
            assert (b"grpc-status", b"0") in raw.decoder.decode(payload, raw=True)
            break
        elif kind == grpc_lite.HEADERS:
            raw.decoder.decode(payload)
    assert seen_ping_ack
    assert data == grpc_message(b"0123456789abcdefghij")


def test_raw_bad_message_framing_and_goaway_on_shutdown(server):
    raw = RawClient(server.port)
    raw.send(
        grpc_lite.frame(grpc_lite.HEADERS, grpc_lite.FLAG_END_HEADERS, 1, raw.request_headers("/test.Svc/Echo"))
        + grpc_lite.frame(grpc_lite.DATA, grpc_lite.FLAG_END_STREAM, 1, b"\x00\x00\x00\x00\x09abc")
    )
    headers, body, trailers = raw.read_call(1)
    assert (":status", "200") in headers and body == b""
    assert ("grpc-status", str(int(StatusCode.INVALID_ARGUMENT))) in trailers
    server.call(server.server.stop())
    while True:
        kind, _, _, payload = raw.read_frame()
        if kind == grpc_lite.GOAWAY:
            last_stream, code = struct.unpack(">II", payload[:8])
            assert (last_stream, code) == (1, grpc_lite.NO_ERROR)
            break


def test_raw_not_http2_is_closed(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    # SETTINGS and WINDOW_UPDATE first (sent on accept), then GOAWAY naming the problem, then close.
    assert b"not an HTTP/2 connection preface" in received


def test_ipv6_wildcard_is_dual_stack():
    """`::` accepts IPv4 clients as well (asyncio alone would make the socket IPv6-only)."""
    if not socket.has_ipv6:
        pytest.skip("this Python was built without IPv6")
    loop = asyncio.new_event_loop()
    server = grpc_lite.Server(grpc_lite.method_table("test.Svc", {"Echo": lambda request, deadline: request}))
    try:
        try:
            port = loop.run_until_complete(server.start("::", 0))
        except OSError as err:
            pytest.skip(f"no IPv6 on this machine ({err})")
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        for host in ("127.0.0.1", "[::1]"):
            with grpc.insecure_channel(f"{host}:{port}") as channel:
                echo = channel.unary_unary("/test.Svc/Echo")
                assert echo(b"hi", timeout=10) == b"hi"
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    finally:
        loop.close()


def test_a_reply_is_answered_later_without_a_future(server, channel):
    """A handler's `Reply` (what a Lighthouse front end returns for a Quorum call): answered, with a status, or
    large enough to wait for flow-control window, each from the loop after the handler returned."""
    calls = [method(channel, "Later").future(key, timeout=30) for key in (b"a", b"b", b"c")]
    server.wait_replies(3)
    big = bytes(range(256)) * (3 * 1024 * 1024 // 256)
    server.settle(b"a", b"answer")
    server.settle(b"b", err=RpcStatusError(StatusCode.FAILED_PRECONDITION, "not now"))
    server.settle(b"c", big)
    assert calls[0].result(timeout=10) == b"answer"
    with pytest.raises(grpc.RpcError) as info:
        calls[1].result(timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and info.value.details() == "not now"
    assert calls[2].result(timeout=10) == big
    assert not server.reply_cancelled.is_set()
    with pytest.raises(asyncio.InvalidStateError):  # answered once
        server.settle(b"a", b"again")


def test_a_reply_the_client_gave_up_on_is_cancelled(server, channel):
    """Deadline: the server answers DEADLINE_EXCEEDED and cancels the reply (its on_cancel runs: a front end
    withdraws the call); a client's cancel (RST_STREAM) cancels it too. A late answer is refused, never sent."""
    with pytest.raises(grpc.RpcError) as info:
        method(channel, "Later")(b"x", timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.reply_cancelled.wait(5) and server.replies[b"x"].cancelled()
    server.reply_cancelled.clear()
    future = method(channel, "Later").future(b"y", timeout=30)
    server.wait_replies(2)
    future.cancel()
    assert server.reply_cancelled.wait(5) and server.replies[b"y"].cancelled()
    with pytest.raises(asyncio.InvalidStateError):
        server.settle(b"y", b"too late")
    assert method(channel, "Echo")(b"still serving", timeout=5) == b"still serving"


def test_shutdown_cancels_a_pending_reply(server, channel):
    future = method(channel, "Later").future(b"", timeout=30)
    server.wait_replies(1)
    server.call(server.server.stop())
    with pytest.raises(grpc.RpcError) as info:
        future.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.reply_cancelled.wait(5)
