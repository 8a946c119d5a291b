"""Authenticated, framed, bidirectional connections over Unix or TCP sockets.

Handshake (before any frame, so nothing is unpickled from a peer that does not know the job secret):
    server -> client : b"RGNT" + 32-byte nonce_s
    client -> server : HMAC(secret, b"client" + nonce_s) + 32-byte nonce_c
    server -> client : HMAC(secret, b"server" + nonce_c)          (only if the client's proof was right)
Either side closes the connection on a wrong proof, so both ends prove knowledge of the secret. The proofs,
the nonces and the secret's source are `regent.auth`'s (shared with the state transfer of `regent.ft`).

Frame:  header `<HHIQ` = magic 0x5247, number of out-of-band buffers, envelope length, body length,
        then one `<Q` length per buffer, then envelope, body and buffers back to back.
The envelope is a small marshal-encoded tuple (routing); the body and buffers are the user payload, unpickled later by its
receiver. Small frames are parsed out of a staging buffer (many frames per read); a large frame is read
straight into one bytearray that its buffers then view, so a big tensor is copied once, kernel to array.
Writes made during one event-loop iteration are flushed together.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import marshal
import mmap
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from regent import settings
from regent.auth import MAC, NONCE, AuthenticationError, new_nonce
from regent.auth import proof as _mac

logger = logging.getLogger("regent.actor.transport")

MAGIC = 0x5247
HEADER = struct.Struct("<HHIQ")
BUFLEN = struct.Struct("<Q")
MAX_BUFFERS = 4096
HELLO_MAGIC = b"RGNT"
STAGING = 256 * 1024
DIRECT_MIN = 64 * 1024
# From this size on a direct-read buffer is an anonymous mapping: its pages are supplied (zeroed) by the
# kernel as the socket data lands in them, where a bytearray would first be zero-filled by hand (an extra
# pass over memory: ~1 ms per MB here).
MAPPED_MIN = 1024 * 1024
_JOIN_MAX = 256 * 1024


def direct_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of `nbytes` for one large frame, not written to before the socket fills it."""
    return mmap.mmap(-1, nbytes) if nbytes >= MAPPED_MIN else bytearray(nbytes)


def encode_env(env: tuple) -> bytes:
    """Envelopes (routing data: tuples of str, int, None, lists and dicts) use marshal: several times
    cheaper than pickle, and its format for these types is stable across Python 3 versions."""
    return marshal.dumps(env)


decode_env = marshal.loads


def _peer_timeout() -> float | None:
    return settings.REGENT_PEER_TIMEOUT.get()


# A peer cut off by the network (a pulled cable, a partition, a host that lost power) sends no FIN or RST: a
# TCP connection to it stays open, for good while idle and ~15 minutes while data waits for retransmission, so
# nothing waiting on that process would ever fail and supervision would never report it. Keepalive probes an
# idle connection and TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged: either closes the
# connection after about this many seconds of silence from the peer's kernel (env REGENT_PEER_TIMEOUT; 'none'
# turns it off). A live peer's kernel acknowledges on its own, however busy the peer process is.
PEER_TIMEOUT_S = _peer_timeout()


def detect_dead_peer(sock: Any, timeout: float | None) -> None:
    """Make a TCP socket fail (ETIMEDOUT) once its peer has been unreachable for about `timeout` seconds."""
    if timeout is None:
        return
    idle = max(1, int(timeout / 2))
    interval = max(1, int(timeout / 6))
    probes = max(1, int((timeout - idle) / interval))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; macOS has only TCP_KEEPALIVE (idle) and defaults
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout * 1000))
    except OSError as exc:
        logger.debug("could not set dead-peer detection on a TCP socket: %s", exc)


class FrameError(Exception):
    """A peer sent bytes that are not a valid frame; the connection is closed, the process carries on."""


def encode_header(env_len: int, body_len: int, buffer_lens: list[int]) -> bytes:
    head = HEADER.pack(MAGIC, len(buffer_lens), env_len, body_len)
    if buffer_lens:
        head += b"".join(BUFLEN.pack(n) for n in buffer_lens)
    return head


def frame_size(env_len: int, body_len: int, buffer_lens: list[int]) -> int:
    return HEADER.size + BUFLEN.size * len(buffer_lens) + env_len + body_len + sum(buffer_lens)


class Connection(asyncio.BufferedProtocol):
    """One authenticated connection. Callbacks run on the event loop thread."""

    def __init__(
        self,
        secret: bytes,
        is_server: bool,
        on_open: Callable[[Connection], None],
        on_frame: Callable[[Connection, bytes | memoryview, memoryview, list[memoryview]], None],
        on_close: Callable[[Connection, BaseException | None], None],
        max_frame_bytes: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._secret = secret
        self._is_server = is_server
        self._on_open = on_open
        self._on_frame = on_frame
        self._on_close = on_close
        self._max_frame = max_frame_bytes
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None  # set by the runtime after the hello frame
        self.peername: str = "?"
        self.is_open = False
        self.closed = False
        self.close_reason: str | None = None
        self._staging = bytearray(STAGING)
        self._staging_view = memoryview(self._staging)
        self._start = 0
        self._end = 0
        self._direct: bytearray | mmap.mmap | None = None
        self._direct_view: memoryview | None = None
        self._direct_pos = 0
        self._direct_layout: tuple[int, int, list[int]] | None = None
        self._state = "auth0"
        self._nonce = new_nonce()
        self._out: list[Any] = []
        self._out_small = 0
        self._flush_scheduled = False
        self.opened = loop.create_future()

    # ---- asyncio protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peername = str(peer) if peer else "unix-socket"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            detect_dead_peer(sock, PEER_TIMEOUT_S)
        if self._is_server:
            transport.write(HELLO_MAGIC + self._nonce)  # type: ignore[attr-defined]
            self._state = "server_wait_proof"
        else:
            self._state = "client_wait_challenge"

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct_view is not None:
            return self._direct_view[self._direct_pos :]
        if self._end == len(self._staging):
            self._compact()
        return self._staging_view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct_view is not None:
                self._direct_pos += nbytes
                if self._direct_pos == len(self._direct_view):
                    self._finish_direct()
                    self._parse()
                return
            self._end += nbytes
            self._parse()
        except (FrameError, AuthenticationError) as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.is_open = False
        if not self.opened.done():
            reason = self.close_reason or (
                f"{self.peername} closed the connection during the handshake; it probably does not share this "
                "job's secret (REGENT_JOB_SECRET / --secret-file)"
            )
            self.opened.set_exception(ConnectionError(reason))
            self.opened.exception()  # marks it retrieved: on the accepting side nobody awaits it (logged above)
        self._on_close(self, exc)

    # ---- reading ----
    def _compact(self) -> None:
        if self._start == 0:
            return
        n = self._end - self._start
        self._staging[0:n] = self._staging[self._start : self._end]
        self._start, self._end = 0, n

    def _fail(self, exc: BaseException) -> None:
        self.close_reason = str(exc)
        logger.error("closing connection to %s: %s", self.peername, exc)
        if self.transport is not None:
            self.transport.abort()

    def _take(self, n: int) -> bytes | None:
        if self._end - self._start < n:
            return None
        data = bytes(self._staging[self._start : self._start + n])
        self._start += n
        return data

    def _parse(self) -> None:
        while self._state != "open":
            if not self._handshake_step():
                return
        while not self.closed:
            avail = self._end - self._start
            if avail < HEADER.size:
                break
            magic, nbufs, env_len, body_len = HEADER.unpack_from(self._staging, self._start)
            if magic != MAGIC:
                raise FrameError(
                    f"malformed frame from {self.peername}: bad magic 0x{magic:04x} (expected 0x{MAGIC:04x}); "
                    "the peer is not a regent runtime or the stream is corrupt"
                )
            if nbufs > MAX_BUFFERS:
                raise FrameError(f"malformed frame from {self.peername}: {nbufs} buffers (limit {MAX_BUFFERS})")
            head_len = HEADER.size + BUFLEN.size * nbufs
            if avail < head_len:
                if head_len > len(self._staging):
                    raise FrameError(f"malformed frame header from {self.peername}")
                break
            buf_lens = [
                BUFLEN.unpack_from(self._staging, self._start + HEADER.size + 8 * i)[0] for i in range(nbufs)
            ]
            payload = env_len + body_len + sum(buf_lens)
            if head_len + payload > self._max_frame:
                raise FrameError(
                    f"oversized frame from {self.peername}: {head_len + payload} bytes exceeds the limit of "
                    f"{self._max_frame} bytes (raise REGENT_MAX_FRAME_BYTES on the receiver if this is intended)"
                )
            if avail >= head_len + payload:
                base = self._start + head_len
                staged = self._staging_view  # slices of the view copy once (a bytearray slice would copy twice)
                env = staged[base : base + env_len].tobytes()
                body = memoryview(staged[base + env_len : base + env_len + body_len].tobytes())
                buffers = []
                off = base + env_len + body_len
                for n in buf_lens:
                    buffers.append(memoryview(bytearray(staged[off : off + n])))
                    off += n
                self._start = off
                self._on_frame(self, env, body, buffers)
                continue
            if payload >= DIRECT_MIN:
                # Large frame: read the rest straight into a buffer of its own, which the frame's buffers
                # (tensors, arrays) then view: one copy, kernel to buffer.
                self._direct = direct_buffer(payload)
                self._direct_view = memoryview(self._direct)
                have = avail - head_len
                self._direct[0:have] = self._staging[self._start + head_len : self._end]
                self._direct_pos = have
                self._direct_layout = (env_len, body_len, buf_lens)
                self._start = self._end = 0
                return
            break
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > len(self._staging) // 2:
            self._compact()

    def _finish_direct(self) -> None:
        assert self._direct_view is not None and self._direct_layout is not None
        view = self._direct_view
        env_len, body_len, buf_lens = self._direct_layout
        self._direct = None
        self._direct_view = None
        self._direct_layout = None
        env = bytes(view[:env_len])
        body = view[env_len : env_len + body_len]
        buffers = []
        off = env_len + body_len
        for n in buf_lens:
            buffers.append(view[off : off + n])
            off += n
        self._on_frame(self, env, body, buffers)

    def _handshake_step(self) -> bool:
        assert self.transport is not None
        if self._state == "client_wait_challenge":
            data = self._take(len(HELLO_MAGIC) + NONCE)
            if data is None:
                return False
            if data[:4] != HELLO_MAGIC:
                raise AuthenticationError(f"peer {self.peername} is not a regent runtime (bad greeting)")
            self.transport.write(_mac(self._secret, b"client", data[4:]) + self._nonce)
            self._state = "client_wait_proof"
            return True
        if self._state == "server_wait_proof":
            data = self._take(MAC + NONCE)
            if data is None:
                return False
            if not hmac.compare_digest(data[:MAC], _mac(self._secret, b"client", self._nonce)):
                raise AuthenticationError(
                    f"refused connection from {self.peername}: it does not know the job secret "
                    "(check REGENT_JOB_SECRET / --secret-file)"
                )
            self.transport.write(_mac(self._secret, b"server", data[MAC:]))
            self._open()
            return True
        if self._state == "client_wait_proof":
            data = self._take(MAC)
            if data is None:
                return False
            if not hmac.compare_digest(data, _mac(self._secret, b"server", self._nonce)):
                raise AuthenticationError(
                    f"server {self.peername} does not know the job secret (check REGENT_JOB_SECRET / --secret-file)"
                )
            self._open()
            return True
        return False

    def _open(self) -> None:
        self._state = "open"
        self.is_open = True
        if not self.opened.done():
            self.opened.set_result(self)
        self._on_open(self)

    # ---- writing (event loop thread only) ----
    def send(self, env: bytes, body: bytes | memoryview, buffers: list[memoryview] = ()) -> None:
        if self.closed:
            raise ConnectionError(f"connection to {self.peername} is closed")
        out = self._out
        nbody = len(body) if not isinstance(body, memoryview) else body.nbytes
        if buffers:
            out.append(encode_header(len(env), nbody, [b.nbytes for b in buffers]))
            out.append(env)
            out.append(body)
            out.extend(buffers)
            self.flush()
            return
        out.append(HEADER.pack(MAGIC, 0, len(env), nbody) + env)
        out.append(body)
        self._out_small += nbody
        if self._out_small >= _JOIN_MAX:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._out or self.transport is None or self.closed:
            self._out.clear()
            self._out_small = 0
            return
        out, self._out = self._out, []
        self._out_small = 0
        pending: list[Any] = []
        pending_size = 0
        for part in out:
            n = len(part) if not isinstance(part, memoryview) else part.nbytes
            if n >= DIRECT_MIN:
                if pending:
                    self.transport.write(b"".join(pending))
                    pending, pending_size = [], 0
                self.transport.write(part)
            else:
                pending.append(part)
                pending_size += n
        if pending:
            self.transport.write(b"".join(pending) if len(pending) > 1 else pending[0])

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.flush()
            self.transport.close()


def parse_address(address: str) -> tuple[str, Any]:
    """`tcp://host:port` -> ("tcp", (host, port)); `unix:///path` or `ipc:///path` -> ("unix", path)."""
    if address.startswith("tcp://"):
        rest = address[len("tcp://") :]
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"bad address {address!r}: expected tcp://HOST:PORT")
        host = host.strip("[]") or "127.0.0.1"
        return "tcp", (host, int(port))
    for scheme in ("unix://", "ipc://"):
        if address.startswith(scheme):
            return "unix", address[len(scheme) :]
    raise ValueError(f"bad address {address!r}: expected tcp://HOST:PORT or unix:///PATH")


def split_address(address: str) -> tuple[str, str]:
    """Monarch's worker address forms -> (the address peers dial, the address to bind).

    `URL` (both are URL), `URL@BIND` (serve on BIND, be known as URL: `tcp://fqdn:p@tcp://0.0.0.0:p`), and
    either form behind a `<proc-id>@` prefix (accepted and ignored: Regent names its processes itself)."""
    parts = address.split("@")
    first = next((i for i, part in enumerate(parts) if "://" in part), None)
    if first is None or first > 1 or len(parts) - first > 2 or not all("://" in p for p in parts[first:]):
        raise ValueError(f"bad address {address!r}: expected URL, URL@BIND_URL or PROC_ID@URL[@BIND_URL] "
                         "with URL like tcp://HOST:PORT or ipc:///PATH")
    dial = parts[first]
    bind = parts[first + 1] if len(parts) > first + 1 else dial
    parse_address(dial)
    parse_address(bind)
    return dial, bind


async def connect(
    address: str,
    factory: Callable[[], Connection],
    loop: asyncio.AbstractEventLoop,
    timeout: float = 30.0,
) -> Connection:
    kind, where = parse_address(address)
    if kind == "tcp":
        coro = loop.create_connection(factory, where[0], where[1])
    else:
        coro = loop.create_unix_connection(factory, where)
    _, conn = await asyncio.wait_for(coro, timeout)
    await asyncio.wait_for(asyncio.shield(conn.opened), timeout)
    return conn


def inherited_listener(address: str) -> tuple[str, socket.socket | None]:
    """Monarch's `tcp://HOST:fdN` (the worker was handed a bound socket as file descriptor N, which it must
    serve on) -> (the address with the socket's real port, that socket); any other address -> (it, None)."""
    head, sep, port = address.rpartition(":")
    if not (sep and address.startswith("tcp://") and port.startswith("fd") and port[2:].isdigit()):
        return address, None
    sock = socket.socket(fileno=int(port[2:]))
    if sock.type != socket.SOCK_STREAM:
        raise ValueError(f"{address!r}: file descriptor {port[2:]} is not a stream socket")
    return f"{head}:{sock.getsockname()[1]}", sock


async def listen(address: str, factory: Callable[[], Connection], loop: asyncio.AbstractEventLoop,
                 sock: socket.socket | None = None) -> tuple[Any, str]:
    """Start a listener; returns (server, actual address). Port 0 picks a free port; `sock`: serve on this
    already bound socket (see `inherited_listener`), whose address `address` names."""
    if sock is not None:
        server = await loop.create_server(factory, sock=sock, backlog=1024)
        return server, address
    kind, where = parse_address(address)
    if kind == "tcp":
        server = await loop.create_server(factory, where[0], where[1], reuse_address=True, backlog=1024)
        port = server.sockets[0].getsockname()[1]
        host = where[0]
        return server, f"tcp://{host}:{port}"
    if os.path.exists(where):
        os.unlink(where)
    server = await loop.create_unix_server(factory, where, backlog=1024)
    return server, f"unix://{where}"
