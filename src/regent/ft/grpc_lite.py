"""A small gRPC server for unary calls, written directly on asyncio (HTTP/2 per RFC 9113, HPACK per RFC 7541).

Why: the control plane (Lighthouse, ManagerServer) makes tiny unary calls whose latency is dominated by the
server's per-call overhead. grpcio's asyncio server spends ~0.5 ms of CPU per call on this kind of request;
this one parses the frames itself, decodes request headers with `hpack`, and writes responses from
pre-encoded header blocks, so a call costs a few tens of microseconds of Python.

What it supports: unary methods registered by full path (`/package.Service/Method`); a handler gets the request
bytes and the call's deadline (`time.monotonic()` seconds, or None) and returns the response bytes, either
directly or as an awaitable. It raises `RpcStatusError` to answer with a non-OK status. The `grpc-timeout`
header is honoured (DEADLINE_EXCEEDED), RST_STREAM and lost connections cancel the handler's task, unknown
methods get UNIMPLEMENTED. Flow control is honoured in both directions. No compression, no streaming methods:
the control plane needs none of them.

Security (both optional): `authenticate(path, headers, peer)` runs on every call's request headers before the
request is even read; a non-None answer ends the call with UNAUTHENTICATED and that message, and the handler
never runs (`regent.ft.rpc_security.CallVerifier` checks the job secret's proof). `ssl` (an
`ssl.SSLContext` with ALPN "h2", `TLSFiles.server_context()`) serves TLS through asyncio's own TLS transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import ipaddress
import logging
import socket
import ssl as _ssl
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import hpack

logger = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags.
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20
# Settings identifiers.
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
# Error codes.
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
DEFAULT_MAX_FRAME = 16_384
# What we advertise: a 1 MiB window per stream and per connection, refilled when half is used.
RECV_WINDOW = 1 << 20
MAX_CONCURRENT_STREAMS = 1000
MAX_HEADER_BLOCK = 64 * 1024
# Largest request message: grpcio's and tonic's default (4 MiB). Control-plane requests are a few hundred bytes;
# a larger bound only lets one caller park that much memory per stream.
DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024
HEADER_CACHE_SIZE = 64
# Only header blocks up to this size are remembered by the decode cache: real clients' blocks are 100-500 bytes,
# and caching 64 blocks of 64 KiB would cost 4 MiB per connection.
HEADER_CACHE_MAX_BLOCK = 2048

# ---- limits against hostile clients (HTTP/2 abuse: rapid reset, floods, slowloris) ----
# A real client sends its preface and first SETTINGS in its first packet; 10 s covers a loaded host (same as the
# TLS handshake timeout below). A connection that has not done so by then is closed.
HANDSHAKE_TIMEOUT_S = 10.0
# A connection with no stream open and no new stream for this long is closed with GOAWAY(NO_ERROR); clients
# (grpcio, tonic) reconnect on their next call. Replicas heartbeat every ~100 ms, so only idle or parked
# connections reach it. PINGs do not count as activity (a slowloris could otherwise keep a socket forever).
IDLE_TIMEOUT_S = 300.0
# A request must arrive in full (END_STREAM) this long after its HEADERS: 4 MiB in 60 s is ~70 kB/s, far below
# any link a replica uses; a client that trickles a body to hold a stream open is reset (RST_STREAM CANCEL).
REQUEST_TIMEOUT_S = 60.0
# A frame (at most 16 KiB) or a header block (HEADERS + CONTINUATION, at most 64 KiB) left unfinished this long
# means the client is holding the connection, not sending: GOAWAY. While a header block is open no other frame
# may arrive on the connection, so this also bounds how long one client can wedge it.
PARTIAL_FRAME_TIMEOUT_S = 30.0
# A response that the client gives no flow-control window (or a socket it stops reading) for this long is given
# up: the stream is reset, or, for a stalled socket, the connection is dropped.
SEND_STALL_TIMEOUT_S = 60.0
# How often each connection checks the timeouts above (the smallest of them over 4, at most this).
TIMER_TICK_S = 1.0
# After GOAWAY the connection is closed once our last bytes are out; a client that stops reading would keep
# it open for good, so it is aborted after this long.
GOAWAY_LINGER_S = 2.0
# Connections from one peer address. A replica group opens one or two channels to the Lighthouse; 256 leaves
# room for many groups behind one NAT address while stopping one host from holding thousands of sockets.
# Loopback peers are exempt by default: processes on this host (the scale benchmark runs 4096 simulated groups
# from 127.0.0.1) can exhaust the host by simpler means anyway.
MAX_CONNECTIONS_PER_PEER = 256
# Connections in all: each costs ~20 kB of Python objects plus a file descriptor; 32768 covers 12,800 replica
# groups (100k GPUs at 8 per group) with two channels each, as the control-plane simulator drives it.
MAX_CONNECTIONS = 32768
# Token buckets per connection (burst, then a sustained rate per second). grpcio sends a keepalive PING every
# 10 s or more and a few BDP pings per burst of data; SETTINGS once or twice per connection; RST_STREAM only
# when a call is cancelled. A client that exceeds these is flooding: GOAWAY(ENHANCE_YOUR_CALM).
PING_BURST, PING_RATE = 200, 50.0
SETTINGS_BURST, SETTINGS_RATE = 50, 5.0
# Streams the client resets (or that we refuse) while open: the CVE-2023-44487 'rapid reset' pattern costs the
# server a dispatch per HEADERS and the client nothing. 500 covers a burst of deadlines on many calls at once.
RESET_BURST, RESET_RATE = 500, 100.0
# CONTINUATION frames in one header block: 64 KiB in 16 KiB frames is 4; empty CONTINUATION frames grow the
# block by nothing, so only a count stops an endless run of them (the 2024 'CONTINUATION flood').
MAX_CONTINUATIONS = 32
# Request bytes buffered per connection (bodies not yet complete). Past it the connection window is no longer
# refilled, so the client must wait for calls to finish: 1000 streams x 4 MiB could otherwise park 4 GB.
MAX_BUFFERED_REQUEST_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    """The abuse limits of one server (defaults: the module constants above, each with its reason). Tests
    shorten the timeouts; an operator may raise a bound."""

    handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    idle_timeout: float = IDLE_TIMEOUT_S
    request_timeout: float = REQUEST_TIMEOUT_S
    partial_frame_timeout: float = PARTIAL_FRAME_TIMEOUT_S
    send_stall_timeout: float = SEND_STALL_TIMEOUT_S
    goaway_linger: float = GOAWAY_LINGER_S
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER
    limit_loopback_peers: bool = False
    max_connections: int = MAX_CONNECTIONS
    ping_burst: int = PING_BURST
    ping_rate: float = PING_RATE
    settings_burst: int = SETTINGS_BURST
    settings_rate: float = SETTINGS_RATE
    reset_burst: int = RESET_BURST
    reset_rate: float = RESET_RATE
    max_continuations: int = MAX_CONTINUATIONS
    max_buffered_request_bytes: int = MAX_BUFFERED_REQUEST_BYTES

    @property
    def tick(self) -> float:
        return min(TIMER_TICK_S, self.handshake_timeout / 4, self.idle_timeout / 4, self.request_timeout / 4,
                   self.partial_frame_timeout / 4, self.send_stall_timeout / 4)


class _Budget:
    """A token bucket: `spend()` is False once a client has used more than `burst` plus `rate` per second."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, burst: int, rate: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def spend(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False



class StatusCode(enum.IntEnum):
    """gRPC status codes (same names and numbers as `grpc.StatusCode`)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RpcStatusError(Exception):
    """Raised by a handler to end its call with `code` and `message` instead of a response."""

    def __init__(self, code: StatusCode | int, message: str = "") -> None:
        super().__init__(f"{StatusCode(code).name}: {message}")
        self.code = StatusCode(code)
        self.message = message


class Reply:
    """A response a handler gives later, without an asyncio future: the handler returns a `Reply`, and whoever
    has the answer calls `set_result(payload)` or `set_exception(err)` (an `RpcStatusError` for a status), which
    writes the response at once. If the call ends first (the client resets it, its deadline passes, the
    connection is lost, the server stops), `cancel()` runs its `on_cancel(reply)` there and then, and the call
    is answered by the server as a cancelled future's would be. Why: a Lighthouse front end answers thousands of
    Quorum calls a round from the owner's link; a future per call cost a done callback, two loop callbacks and a
    loop turn before the write (issue 37). Its methods are the subset of `asyncio.Future`'s that callers use."""

    __slots__ = ("on_cancel", "_state", "_conn", "_stream")

    def __init__(self, on_cancel: Callable[[Reply], None] | None = None) -> None:
        self.on_cancel = on_cancel
        self._state = 0  # 0 pending, 1 answered, 2 cancelled
        self._conn: _Connection | None = None
        self._stream: _Stream | None = None

    def done(self) -> bool:
        return self._state != 0

    def cancelled(self) -> bool:
        return self._state == 2

    def cancel(self) -> bool:
        if self._state:
            return False
        self._state = 2
        self._conn = self._stream = None
        if self.on_cancel is not None:
            self.on_cancel(self)
        return True

    def set_result(self, payload: bytes) -> None:
        self._settle(payload, None)

    def set_exception(self, err: BaseException) -> None:
        self._settle(b"", err)

    def _settle(self, payload: bytes, err: BaseException | None) -> None:
        if self._state:
            raise asyncio.InvalidStateError("the call was already answered or cancelled")
        self._state = 1
        conn, stream = self._conn, self._stream
        self._conn = self._stream = None
        if conn is not None and stream is not None:
            try:
                conn._replied(stream, payload, err)
            except Exception:  # a failed write of one answer must not fail the caller, who may answer many more
                logger.exception("answering a call on stream %d failed", stream.id)


Handler = Callable[[bytes, "float | None"], "bytes | Awaitable[bytes] | Reply"]
# (path, request headers, peer 'host:port') -> None to serve the call, else the UNAUTHENTICATED message.
Authenticator = Callable[[bytes, "list[tuple[bytes, bytes]]", str], "str | None"]
# headers -> seconds since the caller made this call (from an authenticated timestamp), or None if unknown
CallAge = Callable[["list[tuple[bytes, bytes]]"], "float | None"]
# Clocks of two hosts differ by this much at most (NTP keeps them within milliseconds): a call is only taken for
# older than it is when its timestamp says more than this.
CALL_AGE_SLACK_S = 0.5


# ---- encoding helpers -------------------------------------------------------------------------------------------


_FRAME_HEAD = struct.Struct(">BHBBI")  # a frame's 9-byte header: length (24 bits), type, flags, stream id


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 9-byte header + payload."""
    n = len(payload)
    return _FRAME_HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def hpack_int(value: int, prefix_bits: int, first_byte: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) with `prefix_bits` in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first_byte | value,))
    out = bytearray((first_byte | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_header(name: bytes, value: bytes) -> bytes:
    """A header as 'literal without indexing, new name' (no Huffman): it never touches the dynamic table, so a
    block can be built once and sent on any connection."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def percent_encode(message: str) -> bytes:
    """grpc-message encoding: printable ASCII except '%' as is, every other byte as %XX."""
    out = bytearray()
    for byte in message.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def _plain_literal_value(block: bytes, i: int) -> bytes | None:
    """The value of a literal header whose name ended at `i` when it is not Huffman-coded and ends the block
    exactly; else None (the block is then decoded as a whole)."""
    if i >= len(block) or block[i] & 0x80:
        return None
    length = block[i] & 0x7F
    i += 1
    if length == 0x7F:
        shift = 0
        length = 0x7F
        while True:
            if i >= len(block) or shift > 28:
                return None
            byte = block[i]
            i += 1
            length += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
    return block[i:] if i + length == len(block) else None


_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """The `grpc-timeout` header ('100m', '5S', ...) in seconds; None if malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


RESPONSE_HEADERS = (
    b"\x88"  # ':status: 200', indexed from the static table (index 8); leaves the dynamic table alone
    + literal_header(b"content-type", b"application/grpc")
)
OK_TRAILERS = literal_header(b"grpc-status", b"0")
# An OK response's bytes before its payload (HEADERS frame, then the DATA frame's header and the gRPC message
# prefix) and after it (the trailers' HEADERS frame), packed in one call each: `_Connection._respond`.
_OK_HEAD = struct.Struct(f">BHBBI{len(RESPONSE_HEADERS)}sBHBBIBI")
_OK_TAIL = struct.Struct(f">BHBBI{len(OK_TRAILERS)}s")


def trailers_block(code: StatusCode, message: str) -> bytes:
    """The trailer block for a status (pre-encoded for OK)."""
    if code == StatusCode.OK and not message:
        return OK_TRAILERS
    block = literal_header(b"grpc-status", str(int(code)).encode())
    if message:
        block += literal_header(b"grpc-message", percent_encode(message))
    return block


# ---- the server -------------------------------------------------------------------------------------------------


class _Stream:
    __slots__ = (
        "id", "path", "deadline", "body", "send_window", "recv_unacked", "task", "timer", "pending", "trailers",
        "expired", "ended", "opened_at", "stalled_at", "volatile",
    )

    def __init__(self, stream_id: int, send_window: int, now: float) -> None:
        self.id = stream_id
        self.path = b""
        self.deadline: float | None = None
        self.body = bytearray()
        self.send_window = send_window
        self.recv_unacked = 0
        self.task: asyncio.Future | Reply | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.pending = b""  # response DATA not yet sent for lack of flow-control credit
        self.trailers = b""
        self.expired = False
        self.ended = False  # the request is complete (END_STREAM received)
        self.opened_at = now
        self.stalled_at = 0.0  # when a response last waited for window (0: not waiting)
        self.volatile: bytes | None = None  # the value of the server's `volatile_header` (the call's proof)


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        # the counter it goes to (`Server.counters`); by default the error code's name
        self.reason = reason or _ERROR_NAMES.get(code, f"error_{code}")


_ERROR_NAMES = {
    PROTOCOL_ERROR: "protocol_error", FLOW_CONTROL_ERROR: "flow_control_error", FRAME_SIZE_ERROR: "frame_size_error",
    COMPRESSION_ERROR: "compression_error", ENHANCE_YOUR_CALM: "enhance_your_calm",
}


# What `_Connection` reads from a request's headers: (:path, grpc-timeout in seconds or None, the server's
# `volatile_header` value or None, None to serve the call or (status, message) to refuse it).
RequestInfo = tuple[bytes, "float | None", "bytes | None", "tuple[StatusCode, str] | None"]


def request_info(headers: list[tuple[bytes, bytes]], volatile_header: bytes) -> RequestInfo:
    """Read a request's headers in order, as a call is served from them: the first bad `grpc-timeout` or
    unsupported `grpc-encoding` refuses it; then it must be a gRPC POST. Pure, and the same for the same block,
    so a connection remembers it with the decoded block (`_Connection._decode_cached`)."""
    path = method = content_type = b""
    seconds: float | None = None
    volatile: bytes | None = None
    for name, value in headers:
        if name == b":path":
            path = value
        elif name == b":method":
            method = value
        elif name == b"content-type":
            content_type = value
        elif name == b"grpc-timeout":
            parsed = parse_timeout(value)
            if parsed is None:
                return path, seconds, volatile, (StatusCode.INVALID_ARGUMENT, f"bad grpc-timeout {value!r}")
            seconds = parsed
        elif name == volatile_header:
            volatile = value
        elif name == b"grpc-encoding" and value != b"identity":
            return path, seconds, volatile, (StatusCode.UNIMPLEMENTED, f"compression {value.decode(errors='replace')}")
    if method != b"POST" or not content_type.startswith(b"application/grpc"):
        return path, seconds, volatile, (StatusCode.INVALID_ARGUMENT,
                                         "not a gRPC request (POST, content-type application/grpc)")
    return path, seconds, volatile, None


class _Connection(asyncio.Protocol):
    """One client connection: frame parsing, per-stream state, dispatch, flow-controlled writes."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface_seen = False
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_BLOCK
        self._streams: dict[int, _Stream] = {}
        self._last_stream_id = 0
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._recv_window = RECV_WINDOW
        self._recv_unacked = 0
        self._blocked: list[_Stream] = []
        self._headers_stream = 0  # nonzero while a header block continues in CONTINUATION frames
        self._headers_block = bytearray()
        self._headers_end_stream = False
        self._table_update = b""  # a dynamic-table-size update owed at the start of our next header block
        self._header_cache: dict[tuple[int, bytes], list[tuple[bytes, bytes]]] = {}
        self._table_generation = 0
        self._closing = False
        self._peer = "?"
        self._host = "?"
        limits = server.limits
        self._limits = limits
        self._pings = _Budget(limits.ping_burst, limits.ping_rate)
        self._settings = _Budget(limits.settings_burst, limits.settings_rate)
        self._resets = _Budget(limits.reset_burst, limits.reset_rate)
        now = time.monotonic()
        self._opened_at = now
        self._active_at = now  # last new stream or finished call: what the idle timeout measures from
        self._handshaken = False  # preface and the client's first SETTINGS received
        self._partial_at = 0.0  # when the bytes of an unfinished frame started waiting (0: none)
        self._headers_at = 0.0  # when the open header block started
        self._continuations = 0
        self._buffered = 0  # request bytes held in unfinished bodies
        self._write_paused_at = 0.0
        self._linger: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        peername = transport.get_extra_info("peername")
        if peername:
            self._peer = f"{peername[0]}:{peername[1]}"
            self._host = str(peername[0])
        refusal = self._server._admit(self)
        if refusal:
            # Refused before any work: our GOAWAY is the whole conversation.
            transport.write(frame(SETTINGS, 0, 0) + frame(  # type: ignore[attr-defined]
                GOAWAY, 0, 0, struct.pack(">II", 0, ENHANCE_YOUR_CALM) + refusal.encode()))
            self._closing = True
            self._close_after_goaway(transport)  # type: ignore[arg-type]
            return
        self._server._by_host[self._host] += 1
        self._server._watch()
        settings = struct.pack(
            ">HIHIHI",
            SETTINGS_MAX_CONCURRENT_STREAMS, MAX_CONCURRENT_STREAMS,
            SETTINGS_INITIAL_WINDOW_SIZE, RECV_WINDOW,
            SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK,
        )
        transport.write(  # type: ignore[attr-defined]
            frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", RECV_WINDOW - DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        server = self._server
        if self in server._connections:
            server._connections.discard(self)
            server._by_host[self._host] -= 1
            if server._by_host[self._host] <= 0:
                del server._by_host[self._host]
        self._closing = True
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        for stream in list(self._streams.values()):
            self._drop(stream)
        self._streams.clear()
        self._blocked.clear()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # after GOAWAY: nothing more is read (nor buffered)
        buf = self._buf
        if buf or not self._preface_seen:
            buf += data
            source: bytes | bytearray = buf
        else:
            source = data  # nothing left from the last read (the usual case): frames are cut from it directly
        try:
            if not self._preface_seen:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(PREFACE)]
                self._preface_seen = True
            pos = 0
            end = len(source)
            unpack = _FRAME_HEAD.unpack_from
            copy = None if type(source) is bytes else bytes  # frames are cut as bytes (they key the header cache)
            while end - pos >= 9 and not self._closing:
                high, low, kind, flags, stream_id = unpack(source, pos)
                length = high << 16 | low
                if length > DEFAULT_MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds 16384")
                if end - pos < 9 + length:
                    break
                payload = source[pos + 9 : pos + 9 + length]
                pos += 9 + length
                self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, copy(payload) if copy else payload)
            if source is buf:
                del buf[:pos]
            elif pos < end:
                buf += data[pos:]  # an unfinished frame waits for the next read
            if not buf:
                self._partial_at = 0.0
            elif pos or not self._partial_at:
                self._partial_at = time.monotonic()  # a new unfinished frame starts waiting now
        except _ConnectionError as err:
            self._server._refuse(self._host, err.reason, f"closing HTTP/2 connection from {self._peer}: {err}")
            self._go_away(err.code, str(err))

    # ---- frames ------------------------------------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._headers_stream and (kind != CONTINUATION or stream_id != self._headers_stream):
            raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if not self._handshaken and kind != SETTINGS:
            raise _ConnectionError(PROTOCOL_ERROR, "the client's first frame must be SETTINGS")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            if not self._headers_stream:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._continuations += 1
            if self._continuations > self._limits.max_continuations:
                raise _ConnectionError(ENHANCE_YOUR_CALM, f"more than {self._limits.max_continuations} CONTINUATION "
                                       "frames in one header block", "continuation_flood")
            self._headers_block += payload
            if len(self._headers_block) > MAX_HEADER_BLOCK:
                raise _ConnectionError(PROTOCOL_ERROR, "header block too large", "header_block_too_large")
            if flags & FLAG_END_HEADERS:
                block = bytes(self._headers_block)
                self._headers_block = bytearray()
                self._header_block_done(self._headers_stream, block, self._headers_end_stream)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise _ConnectionError(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "bad PING")
            if not flags & FLAG_ACK:
                if not self._pings.spend():
                    raise _ConnectionError(ENHANCE_YOUR_CALM, "PING flood", "ping_flood")
                self._write(frame(PING, FLAG_ACK, 0, payload))
        elif kind == RST_STREAM:
            if len(payload) != 4:
                raise _ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM payload not 4 bytes")
            if not stream_id or stream_id > self._last_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
            stream = self._streams.pop(stream_id, None)
            if stream is not None:
                self._drop(stream)
                self._spend_reset()
        elif kind == GOAWAY:
            # The client will open no new streams; calls in flight finish normally.
            logger.debug("client sent GOAWAY (error %d)", int.from_bytes(payload[4:8], "big") if payload else -1)
        elif kind == PRIORITY:
            if not stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "PRIORITY payload not 5 bytes")
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # Unknown frame types are ignored (RFC 9113 section 4.1).

    def _unpad(self, flags: int, payload: bytes) -> bytes:
        if flags & FLAG_PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ConnectionError(PROTOCOL_ERROR, "bad padding")
            return payload[1 : len(payload) - payload[0]]
        return payload

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        flow = len(payload)
        self._recv_window -= flow
        if self._recv_window < 0:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "client overran the connection window")
        self._recv_unacked += flow
        self._refill_connection_window()
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended:
            if stream_id > self._last_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream we already answered or reset: its late DATA only counts against the window
        data = self._unpad(flags, payload)
        body: bytes | bytearray
        if flags & FLAG_END_STREAM and not stream.body:
            body = data  # the whole request in this frame (the usual case): served from it, never buffered
        else:
            stream.body += data
            self._buffered += len(data)
            body = stream.body
        limit = self._server.max_message_bytes
        # The gRPC prefix declares the message's length: refuse a too-large one at once, not after buffering it.
        declared = int.from_bytes(body[1:5], "big") if len(body) >= 5 else 0
        if declared > limit or len(body) > limit + 5:
            size = max(declared, len(body) - 5)
            self._server._refuse(self._host, "oversized_message",
                                 f"request of {size} bytes from {self._peer} refused (limit {limit})")
            self._finish(stream, StatusCode.RESOURCE_EXHAUSTED,
                         f"request of {size} bytes is larger than the server accepts ({limit})")
            return
        if flags & FLAG_END_STREAM:
            stream.ended = True
            self._dispatch(stream, body)
        else:
            stream.recv_unacked += flow
            if stream.recv_unacked >= RECV_WINDOW // 2:
                self._write(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream.recv_unacked)))
                stream.recv_unacked = 0

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload)
        if flags & FLAG_PRIORITY:
            block = block[5:]
        if len(block) > MAX_HEADER_BLOCK:
            raise _ConnectionError(PROTOCOL_ERROR, "header block too large", "header_block_too_large")
        if flags & FLAG_END_HEADERS:  # the whole block in this frame (the usual case)
            self._header_block_done(stream_id, block, bool(flags & FLAG_END_STREAM))
            return
        self._headers_stream = stream_id
        self._headers_block = bytearray(block)
        self._headers_end_stream = bool(flags & FLAG_END_STREAM)
        self._headers_at = time.monotonic()
        self._continuations = 0

    def _header_block_done(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        """A request's (or trailers') header block is complete: open the stream and read the request from it."""
        self._headers_stream = 0
        # Always decode, even for a stream we refuse: the HPACK table is shared by the connection.
        headers, info = self._decode_request_headers(block)
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client: nothing to read in them
            if not end_stream:
                raise _ConnectionError(PROTOCOL_ERROR, "request trailers without END_STREAM")
            if not stream.ended:
                stream.ended = True
                self._dispatch(stream)
            return
        if stream_id <= self._last_stream_id or not stream_id & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {stream_id} that cannot be opened")
        self._last_stream_id = stream_id
        self._active_at = now = time.monotonic()
        stream = _Stream(stream_id, self._peer_initial_window, now)
        if len(self._streams) >= MAX_CONCURRENT_STREAMS or self._server._stopping:
            # Beyond what we advertised (SETTINGS_MAX_CONCURRENT_STREAMS): refused, and it counts as a reset.
            self._server.counters["refused_stream"] += 1
            self._spend_reset()
            self._write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
            return
        self._streams[stream_id] = stream
        stream.path, seconds, stream.volatile, refusal = info
        if seconds is not None:
            stream.deadline = now + seconds
        if refusal is not None:
            self._finish(stream, *refusal)
            return
        authenticate = self._server.authenticate
        if authenticate is not None:
            refusal = authenticate(stream.path, headers, self._peer)
            if refusal is not None:
                # Before the body is read and before the handler runs: a refused call changes nothing.
                self._finish(stream, StatusCode.UNAUTHENTICATED, refusal)
                return
        call_age = self._server.call_age
        if call_age is not None and stream.deadline is not None:
            # `grpc-timeout` is relative to when the request arrives. One that sat in TCP retransmission through
            # a partition arrives after its caller gave up: counted, it would join a quorum nobody answers for.
            # The caller's signed timestamp says how old it really is (the expiry check at dispatch refuses it).
            age = call_age(headers)
            if age is not None and age > CALL_AGE_SLACK_S:
                stream.deadline -= age
        if end_stream:
            stream.ended = True
            self._dispatch(stream)

    def _decode_headers(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """HPACK-decode a header block (`_decode_request_headers`'s headers)."""
        return self._decode_request_headers(block)[0]

    def _decode_request_headers(self, block: bytes) -> tuple[list[tuple[bytes, bytes]], RequestInfo]:
        """HPACK-decode a header block and read the request from it (`request_info`), remembering blocks that
        left the dynamic table as it was, with what was read from them.

        Clients repeat the same block call after call (tonic sends byte-identical requests once its table is
        warm); decoding such a block again would give the same headers and the same table, so the cached result
        is exact. Any block that changes the table clears the cache, since later blocks may refer to it.

        A per-call header (the job secret's proof, `Server.volatile_header`) makes every block different. grpcio
        sends it last, as a literal that never touches the table and is not Huffman-coded: it is read here
        directly and the rest of the block goes through the cache as before."""
        volatile = self._server._volatile_marker
        if volatile:
            pos = block.rfind(volatile)
            if pos >= 0:
                value = _plain_literal_value(block, pos + len(volatile))
                if value is not None:
                    headers, (path, seconds, _, refusal) = self._decode_cached(block[:pos])
                    # read last, as `request_info` would read it at the end of the block
                    return [*headers, (self._server.volatile_header, value)], (path, seconds, value, refusal)
        return self._decode_cached(block)

    def _decode_cached(self, block: bytes) -> tuple[list[tuple[bytes, bytes]], RequestInfo]:
        table = self._decoder.header_table
        key = (self._table_generation, block)
        cached = self._header_cache.get(key)
        if cached is not None:
            return cached
        entries = table.dynamic_entries
        before = (len(entries), entries[0] if entries else None, table.maxsize)
        try:
            headers = self._decoder.decode(block, raw=True)
        except Exception as err:  # noqa: BLE001 - hpack raises several types for hostile blocks; each ends the connection, with its reason
            raise _ConnectionError(COMPRESSION_ERROR, f"bad header block: {err}") from None
        result = (headers, request_info(headers, self._server.volatile_header))
        entries = table.dynamic_entries
        if (len(entries), entries[0] if entries else None, table.maxsize) == before and (
            before[1] is None or entries[0] is before[1]
        ):
            if len(block) <= HEADER_CACHE_MAX_BLOCK:
                if len(self._header_cache) >= HEADER_CACHE_SIZE:
                    self._header_cache.clear()
                self._header_cache[key] = result
        else:
            self._table_generation += 1
            self._header_cache.clear()
        return result

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & FLAG_ACK:
            if payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        if not self._settings.spend():
            raise _ConnectionError(ENHANCE_YOUR_CALM, "SETTINGS flood", "settings_flood")
        self._handshaken = True
        for offset in range(0, len(payload), 6):
            ident, value = struct.unpack_from(">HI", payload, offset)
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise _ConnectionError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE overflows a stream "
                                               "window")
            elif ident == SETTINGS_ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise _ConnectionError(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_max_frame = value
            elif ident == SETTINGS_HEADER_TABLE_SIZE and value < 4096:
                # We never add to the table, but a smaller maximum must still be acknowledged in our next block.
                self._table_update = hpack_int(value, 5, 0x20)
        self._write(frame(SETTINGS, FLAG_ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise _ConnectionError(PROTOCOL_ERROR, "zero WINDOW_UPDATE")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
            self._flush_blocked()
            return
        if stream_id > self._last_stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # a closed stream: WINDOW_UPDATE may still arrive
        if not increment:
            self._reset_stream(stream, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._reset_stream(stream, FLOW_CONTROL_ERROR)
            return
        if stream.pending:
            self._flush_blocked()

    # ---- calls -------------------------------------------------------------------------------------------------

    def _dispatch(self, stream: _Stream, body: bytes | bytearray | None = None) -> None:
        """The request is complete (`body`, else what the stream buffered): decode the gRPC message and run the
        handler."""
        handler = self._server._handlers.get(stream.path)
        if handler is None:
            path = stream.path.decode(errors="replace")
            self._finish(stream, StatusCode.UNIMPLEMENTED, f"unknown method {path}")
            return
        if body is None:
            body = stream.body
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            self._finish(stream, StatusCode.INVALID_ARGUMENT, "request is not one length-prefixed gRPC message")
            return
        if body[0]:
            self._finish(stream, StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
            return
        request = bytes(body[5:])
        self._release_body(stream)
        if stream.deadline is not None and stream.deadline <= time.monotonic():
            self._finish(stream, StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the call started")
            return
        self._server.current_volatile = stream.volatile
        try:
            result = handler(request, stream.deadline)
        except RpcStatusError as err:
            self._finish(stream, err.code, err.message)
            return
        except Exception as err:
            logger.exception("handler for %s failed", stream.path.decode(errors="replace"))
            self._finish(stream, StatusCode.UNKNOWN, f"{type(err).__name__}: {err}")
            return
        if isinstance(result, (bytes, bytearray, memoryview)):
            self._respond(stream, bytes(result))
            return
        if type(result) is Reply:
            if result._state:  # answered (or cancelled) inside the handler
                raise RuntimeError("a handler returned a Reply that was already settled")
            result._conn, result._stream = self, stream
            stream.task = result
            if stream.deadline is not None:
                stream.timer = asyncio.get_running_loop().call_at(stream.deadline, self._expire, stream)
            return
        stream.task = asyncio.ensure_future(result)
        stream.task.add_done_callback(functools.partial(self._task_done, stream))
        if stream.deadline is not None:
            stream.timer = asyncio.get_running_loop().call_at(stream.deadline, self._expire, stream)

    def _expire(self, stream: _Stream) -> None:
        stream.timer = None
        task = stream.task
        if task is not None and not task.done():
            stream.expired = True
            task.cancel()
            if type(task) is Reply:  # no done callback to answer it: answered here
                stream.task = None
                if self._streams.get(stream.id) is stream:
                    self._finish(stream, StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")

    def _replied(self, stream: _Stream, payload: bytes, err: BaseException | None) -> None:
        """A `Reply` was answered: as `_task_done` does for a finished future, without a loop turn."""
        if not self._settled(stream):
            return
        if err is None:
            self._respond(stream, payload)
        elif isinstance(err, RpcStatusError):
            self._finish(stream, err.code, err.message)
        else:
            logger.error("handler for %s failed", stream.path.decode(errors="replace"), exc_info=err)
            self._finish(stream, StatusCode.UNKNOWN, f"{type(err).__name__}: {err}")

    def _settled(self, stream: _Stream) -> bool:
        """A call's handler is done: its deadline timer is dropped; False when nobody is left to answer (reset by
        the client, or the connection is gone)."""
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        stream.task = None
        return self._streams.get(stream.id) is stream

    def _task_done(self, stream: _Stream, task: asyncio.Future) -> None:
        if not self._settled(stream):
            return
        if task.cancelled():
            if stream.expired:
                self._finish(stream, StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            else:
                self._finish(stream, StatusCode.CANCELLED, "call cancelled by the server")
            return
        err = task.exception()
        if err is None:
            self._respond(stream, task.result())
        elif isinstance(err, RpcStatusError):
            self._finish(stream, err.code, err.message)
        else:
            logger.error("handler for %s failed", stream.path.decode(errors="replace"), exc_info=err)
            self._finish(stream, StatusCode.UNKNOWN, f"{type(err).__name__}: {err}")

    def _release_body(self, stream: _Stream) -> None:
        """The stream's request bytes are no longer held: give the client its window back if it was held."""
        if stream.body:
            self._buffered -= len(stream.body)
            stream.body = bytearray()
            self._refill_connection_window()

    def _refill_connection_window(self) -> None:
        # While too many request bytes are held unfinished the window stays shut: the client waits, memory holds.
        if self._recv_unacked >= RECV_WINDOW // 2 and self._buffered < self._limits.max_buffered_request_bytes:
            self._write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._recv_unacked)))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0

    def _spend_reset(self) -> None:
        if not self._resets.spend():
            raise _ConnectionError(ENHANCE_YOUR_CALM, "too many streams reset (rapid reset)", "rapid_reset")

    def _drop(self, stream: _Stream) -> None:
        """Forget a stream the client abandoned: cancel its handler and timer."""
        self._release_body(stream)
        self._active_at = time.monotonic()
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        if stream in self._blocked:
            self._blocked.remove(stream)

    def _reset_stream(self, stream: _Stream, error: int) -> None:
        self._streams.pop(stream.id, None)
        self._drop(stream)
        self._write(frame(RST_STREAM, 0, stream.id, struct.pack(">I", error)))

    def _headers_frames(self, stream_id: int, block: bytes, end_stream: bool) -> bytes:
        """A header block as HEADERS (+ CONTINUATION) frames within the peer's max frame size."""
        if self._table_update:
            block = self._table_update + block
            self._table_update = b""
        limit = self._peer_max_frame
        end_flag = FLAG_END_STREAM if end_stream else 0
        if len(block) <= limit:
            return frame(HEADERS, FLAG_END_HEADERS | end_flag, stream_id, block)
        parts = [block[i : i + limit] for i in range(0, len(block), limit)]
        out = [frame(HEADERS, end_flag, stream_id, parts[0])]
        for i, part in enumerate(parts[1:], start=2):
            out.append(frame(CONTINUATION, FLAG_END_HEADERS if i == len(parts) else 0, stream_id, part))
        return b"".join(out)

    def _finish(self, stream: _Stream, code: StatusCode, message: str) -> None:
        """Answer with a status only ('Trailers-Only': one HEADERS frame that ends the stream)."""
        if self._streams.pop(stream.id, None) is None:
            return
        self._drop(stream)
        block = RESPONSE_HEADERS + trailers_block(code, message)
        self._write(self._headers_frames(stream.id, block, end_stream=True))
        if not stream.ended:
            # The client may still be sending the request: tell it to stop (RFC 9113 section 8.1).
            self._write(frame(RST_STREAM, 0, stream.id, struct.pack(">I", NO_ERROR)))

    def _respond(self, stream: _Stream, payload: bytes) -> None:
        if self._streams.get(stream.id) is not stream:
            return
        n = len(payload) + 5
        if (n <= stream.send_window and n <= self._send_window and n <= self._peer_max_frame and not self._blocked
                and not self._table_update):
            # The common case: the whole response in one write, its frames packed around the payload (the same
            # bytes as the general path below).
            sid = stream.id
            stream.send_window -= n
            self._send_window -= n
            del self._streams[sid]
            self._write(_OK_HEAD.pack(0, len(RESPONSE_HEADERS), HEADERS, FLAG_END_HEADERS, sid, RESPONSE_HEADERS,
                                      n >> 16, n & 0xFFFF, DATA, 0, sid, 0, n - 5)
                        + payload
                        + _OK_TAIL.pack(0, len(OK_TRAILERS), HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, sid,
                                        OK_TRAILERS))
            return
        message = b"\x00" + len(payload).to_bytes(4, "big") + payload
        head = self._headers_frames(stream.id, RESPONSE_HEADERS, end_stream=False)
        trailers = self._headers_frames(stream.id, OK_TRAILERS, end_stream=True)
        n = len(message)
        if n <= stream.send_window and n <= self._send_window and n <= self._peer_max_frame and not self._blocked:
            # The common case: the whole response in one write.
            stream.send_window -= n
            self._send_window -= n
            del self._streams[stream.id]
            self._write(head + frame(DATA, 0, stream.id, message) + trailers)
            return
        self._write(head)
        stream.pending = message
        stream.trailers = trailers
        stream.stalled_at = time.monotonic()
        self._blocked.append(stream)
        self._flush_blocked()

    def _flush_blocked(self) -> None:
        """Send what flow control allows of the responses waiting for window, oldest first."""
        while self._blocked and self._send_window > 0:
            progressed = False
            for stream in list(self._blocked):
                if self._send_window <= 0:
                    break
                size = min(len(stream.pending), stream.send_window, self._send_window, self._peer_max_frame)
                if size > 0:
                    chunk, stream.pending = stream.pending[:size], stream.pending[size:]
                    stream.send_window -= size
                    self._send_window -= size
                    self._write(frame(DATA, 0, stream.id, chunk))
                    stream.stalled_at = time.monotonic()
                    progressed = True
                if not stream.pending:
                    self._blocked.remove(stream)
                    self._streams.pop(stream.id, None)
                    self._write(stream.trailers)
            if not progressed:
                break

    # ---- connection ---------------------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _go_away(self, code: int, message: str = "") -> None:
        """Say which streams were processed, then close the connection."""
        if self._closing:
            return
        self._closing = True
        self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream_id, code) + message.encode()[:256]))
        if self._transport is not None:
            self._close_after_goaway(self._transport)

    def _close_after_goaway(self, transport: asyncio.Transport) -> None:
        """Half-close, then read and drop what the client still sends until it closes or `goaway_linger`
        passes. Closing at once would make the kernel answer the client's next bytes (a flood in flight) with a
        reset, and a reset discards our GOAWAY from the client's receive buffer: it would never learn why."""
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # the client is already gone (ENOTCONN): nothing to tell it
                transport.abort()
                return
            transport.resume_reading()  # in case writes had paused it: the client's bytes must be drained
        else:  # TLS cannot half-close
            transport.close()
        self._abort_later()

    def eof_received(self) -> bool:
        """The client finished sending: after our GOAWAY (or without one) the connection is done."""
        return False

    def _abort_later(self) -> None:
        """close() waits for our buffered bytes to go out; a client that never reads would hold the socket."""
        transport = self._transport
        if transport is not None and self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(self._limits.goaway_linger, transport.abort)

    def pause_writing(self) -> None:
        """asyncio: the socket's send buffer is full. Stop reading the client until it reads what we wrote, so
        a client that sends requests (or PINGs) but never reads cannot make us queue answers without bound."""
        self._write_paused_at = time.monotonic()
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused_at = 0.0
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _check_timers(self, now: float) -> None:
        """The slowloris defences: every deadline in `Limits` is checked here, once per tick (`Server._sweep`)."""
        if self._closing:
            return
        limits = self._limits
        expired: tuple[str, int, str] | None = None
        if not self._handshaken:
            if now - self._opened_at > limits.handshake_timeout:
                expired = ("handshake_timeout", PROTOCOL_ERROR,
                           f"no connection preface and SETTINGS within {limits.handshake_timeout:g} s")
        elif self._write_paused_at and now - self._write_paused_at > limits.send_stall_timeout:
            expired = ("send_stall", ENHANCE_YOUR_CALM,
                       f"client read nothing for {limits.send_stall_timeout:g} s")
        elif self._headers_stream and now - self._headers_at > limits.partial_frame_timeout:
            expired = ("partial_frame_timeout", PROTOCOL_ERROR,
                       f"header block unfinished after {limits.partial_frame_timeout:g} s")
        elif self._partial_at and now - self._partial_at > limits.partial_frame_timeout:
            expired = ("partial_frame_timeout", PROTOCOL_ERROR,
                       f"frame unfinished after {limits.partial_frame_timeout:g} s")
        elif not self._streams and now - self._active_at > limits.idle_timeout:
            expired = ("idle_timeout", NO_ERROR, f"idle for {limits.idle_timeout:g} s")
        if expired is not None:
            reason, code, message = expired
            self._server._refuse(self._host, reason, f"closing HTTP/2 connection from {self._peer}: {message}",
                                 quiet=code == NO_ERROR)
            self._go_away(code, message)
            if self._transport is not None and reason == "send_stall":
                self._transport.abort()  # it reads nothing: the GOAWAY could not reach it anyway
            return
        for stream in list(self._streams.values()):
            if not stream.ended and now - stream.opened_at > limits.request_timeout:
                self._server._refuse(self._host, "request_timeout",
                                     f"request on stream {stream.id} from {self._peer} unfinished after "
                                     f"{limits.request_timeout:g} s: reset")
                self._reset_stream(stream, CANCEL)
            elif stream.stalled_at and now - stream.stalled_at > limits.send_stall_timeout:
                self._server._refuse(self._host, "send_stall",
                                     f"response on stream {stream.id} to {self._peer} got no window for "
                                     f"{limits.send_stall_timeout:g} s: reset")
                self._reset_stream(stream, CANCEL)

    def shut_down(self) -> None:
        """Server shutdown: answer calls in flight with UNAVAILABLE (clients retry that), then GOAWAY."""
        for stream in list(self._streams.values()):
            self._finish(stream, StatusCode.UNAVAILABLE, "server shutting down")
        self._go_away(NO_ERROR)


class Server:
    """Serves registered unary handlers on one TCP port from the running asyncio loop."""

    def __init__(
        self, handlers: dict[str, Handler] | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        authenticate: Authenticator | None = None, ssl: _ssl.SSLContext | None = None,
        volatile_header: bytes = b"", limits: Limits | None = None, call_age: CallAge | None = None,
    ) -> None:
        """`authenticate` and `ssl`: see the module docstring (both None: open, plaintext). `call_age`: how old
        an authenticated call is by its caller's clock, so that one that outlived its deadline in flight is
        refused (DEADLINE_EXCEEDED) instead of run. `volatile_header`:
        a header that differs on every call (see `_Connection._decode_headers`). `limits`: the abuse bounds
        (`Limits()`, the module's constants, by default)."""
        self.limits = limits or Limits()
        # What hostile or broken clients were refused, by reason ('ping_flood', 'rapid_reset', 'idle_timeout',
        # 'too_many_connections', ...): for tests and for an operator reading a status page.
        self.counters: Counter[str] = Counter()
        self._by_host: Counter[str] = Counter()
        self._warned: set[tuple[str, str]] = set()
        self.authenticate = authenticate
        self.call_age = call_age
        self.volatile_header = volatile_header
        # 'literal without indexing, new name' + the name: how grpcio sends a custom header
        self._volatile_marker = literal_header(volatile_header, b"")[:-1] if volatile_header else b""
        self._ssl = ssl
        self._handlers: dict[bytes, Handler] = {}
        for path, handler in (handlers or {}).items():
            self.add_unary(path, handler)
        self.max_message_bytes = max_message_bytes
        self._connections: set[_Connection] = set()
        # While a handler runs: its call's `volatile_header` value (None without one). A handler that needs the
        # proof itself (a Lighthouse front end forwards its nonce) reads it here, before it returns.
        self.current_volatile: bytes | None = None
        self._server: asyncio.AbstractServer | None = None
        self._stopping = False
        self._sweeper: asyncio.TimerHandle | None = None

    def add_unary(self, path: str, handler: Handler) -> None:
        """Serve `handler` for `path` ('/package.Service/Method'): handler(request, deadline) -> response bytes
        or an awaitable of them; raise `RpcStatusError` for a non-OK status."""
        if not path.startswith("/"):
            raise ValueError(f"method path must look like /package.Service/Method, got {path!r}")
        self._handlers[path.encode()] = handler

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on host:port (an empty host means every interface) and return the bound port. The IPv6
        wildcard `::` is dual-stack (IPv4 clients connect too), as with grpcio and TorchFT's Lighthouse.
        `reuse_port`: share the port with other SO_REUSEPORT listeners (the Lighthouse's front ends)."""
        loop = asyncio.get_running_loop()
        if host == "::":
            self._server = await loop.create_server(lambda: _Connection(self),
                                                    sock=dual_stack_socket(port, reuse_port),
                                                    backlog=1024, ssl=self._ssl, **self._tls_kwargs())
        else:
            def listen(at: int) -> Awaitable[asyncio.AbstractServer]:
                return loop.create_server(
                    lambda: _Connection(self), host or None, at, reuse_address=True, backlog=1024, ssl=self._ssl,
                    reuse_port=reuse_port or None, **self._tls_kwargs()
                )

            self._server = await listen(port)
            bound = self._server.sockets[0].getsockname()[1]
            if port == 0 and any(s.getsockname()[1] != bound for s in self._server.sockets):
                # A name with several addresses ('localhost': 127.0.0.1 and ::1) got a port each; clients dial
                # the name with one port, so every address must have it (grpcio binds them so too).
                self._server.close()
                await self._server.wait_closed()
                self._server = await listen(bound)
        return self._server.sockets[0].getsockname()[1]

    def _tls_kwargs(self) -> dict[str, float]:
        # A client that connects and never finishes its TLS handshake is dropped after this long.
        return {"ssl_handshake_timeout": 10.0} if self._ssl is not None else {}

    async def stop(self) -> None:
        """Stop listening, end calls in flight with UNAVAILABLE, and close every connection with GOAWAY."""
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.shut_down()
        # Let cancelled handlers run their cleanup before the loop goes away.
        await asyncio.sleep(0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    def _watch(self) -> None:
        """A connection was admitted: make sure the sweep of the connections' timeouts runs."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.limits.tick, self._sweep)

    def _sweep(self) -> None:
        """Check every connection's timeouts (`_Connection._check_timers`) once per tick, from one timer for the
        server: a timer per connection cost a Lighthouse front end ~15 us per connection and tick, ~0.1 s of CPU
        a second with 6,400 connections (issue 37). Each timeout still fires at most one tick late."""
        self._sweeper = None
        now = time.monotonic()
        for conn in list(self._connections):
            try:
                conn._check_timers(now)
            except Exception:  # one connection's failure must not stop the checks of the others
                logger.exception("checking the timeouts of HTTP/2 connection from %s failed", conn._peer)
        if self._connections:
            self._watch()

    def _admit(self, conn: _Connection) -> str:
        """'' to serve a new connection, else why it is refused (counted and logged)."""
        limits = self.limits
        if len(self._connections) >= limits.max_connections:
            reason, message = "too_many_connections", f"server holds {limits.max_connections} connections"
        elif self._by_host[conn._host] >= limits.max_connections_per_peer and (
                limits.limit_loopback_peers or not _is_loopback(conn._host)):
            reason, message = "too_many_connections", (f"{conn._host} holds {limits.max_connections_per_peer} "
                                                       "connections")
        else:
            self._connections.add(conn)
            return ""
        self._refuse(conn._host, reason, f"refused HTTP/2 connection from {conn._peer}: {message}")
        return message

    def _refuse(self, host: str, reason: str, message: str, quiet: bool = False) -> None:
        """Count a refusal; log the first of each kind per peer host as a warning, the rest at debug level (a
        flood must not become a log flood)."""
        self.counters[reason] += 1
        key = (host, reason)
        if quiet or key in self._warned:
            logger.debug("%s", message)
            return
        if len(self._warned) >= 4096:
            self._warned.clear()
        self._warned.add(key)
        logger.warning("%s (%s; later ones from this host are logged at debug level)", message, reason)


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8 and ::1, also as IPv4-mapped IPv6 (how a dual-stack `[::]` socket sees 127.0.0.1)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def dual_stack_socket(port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to [::]:port that also accepts IPv4 (IPV6_V6ONLY off). asyncio's create_server turns
    IPV6_V6ONLY on for every IPv6 socket it makes, so `[::]` would refuse clients that dial 127.0.0.1."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def method_table(service: str, methods: dict[str, Handler]) -> dict[str, Handler]:
    """{'Method': handler} for one service -> {'/service/Method': handler}."""
    return {f"/{service}/{name}": handler for name, handler in methods.items()}
