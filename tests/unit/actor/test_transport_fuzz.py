"""Property-based fuzz of the actor transport's reader (`regent.actor._transport.Connection`), fed in memory.

Properties: valid frames, cut into any chunks, arrive exactly once and in order (with their out-of-band buffers);
arbitrary or mutated bytes never raise out of the reader and never hang it: a bad frame closes the connection
through `FrameError` (after the handshake) or `AuthenticationError` (before it), the documented errors, and the
process carries on. The staging buffer never grows and no frame is allocated beyond the frame-size limit.

Budget: small by default; REGENT_FUZZ_EXAMPLES raises it for a longer run by hand.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from regent.actor import _transport
from regent.actor._transport import HEADER, HELLO_MAGIC, MAGIC, STAGING, Connection, encode_env, encode_header
from regent.auth import AuthenticationError

EXAMPLES = int(os.environ.get("REGENT_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=10_000, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture],
                derandomize="REGENT_FUZZ_EXAMPLES" not in os.environ)
SECRET = b"fuzz-secret"
MAX_FRAME = 1 << 20  # the reader's limit in these tests (production: REGENT_MAX_FRAME_BYTES, 10 GiB)


class FakeTransport:
    """Collects what the connection writes and whether it aborted; no socket."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.aborted = False
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.aborted or self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Reader:
    """A Connection with its callbacks recorded, already past the handshake unless `handshake` is False."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handshake: bool = True, is_server: bool = False) -> None:
        self.frames: list[tuple[bytes, bytes, list[bytes]]] = []
        self.closed: list[BaseException | None] = []
        self.transport = FakeTransport()
        self.conn = Connection(SECRET, is_server, lambda c: None, self._on_frame, lambda c, e: None, MAX_FRAME, loop)
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]
        if handshake:
            self.conn._state = "open"
            self.conn.is_open = True
        self.errors: list[BaseException] = []
        self.conn._fail = self._fail  # type: ignore[method-assign]

    def _on_frame(self, conn: Connection, env: bytes, body: memoryview, buffers: list[memoryview]) -> None:
        self.frames.append((bytes(env), bytes(body), [bytes(b) for b in buffers]))

    def _fail(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.transport.abort()
        self.conn.closed = True  # what connection_lost does when the abort lands

    def feed(self, data: bytes, cuts: list[int]) -> None:
        """Deliver `data` the way asyncio would: into get_buffer()'s view, in pieces at most `cuts` long."""
        sizes = [c for c in cuts if c > 0] or [max(1, len(data))]
        pos = i = 0
        while pos < len(data) and not self.conn.closed:
            view = self.conn.get_buffer(-1)
            assert len(view) > 0, "the reader offered no room to read into"
            n = min(len(view), sizes[i % len(sizes)], len(data) - pos)
            i += 1
            view[:n] = data[pos:pos + n]
            self.conn.buffer_updated(n)
            pos += n
        assert len(self.conn._staging) == STAGING


def encode_frame(env: bytes, body: bytes, buffers: list[bytes]) -> bytes:
    return encode_header(len(env), len(body), [len(b) for b in buffers]) + env + body + b"".join(buffers)


envs = st.tuples(st.sampled_from(["m", "r", "hello", "bye"]), st.text(max_size=20), st.integers(-2**40, 2**40),
                 st.none() | st.lists(st.integers(), max_size=3)).map(encode_env)
frames = st.tuples(envs, st.binary(max_size=300),
                   st.lists(st.one_of(st.binary(max_size=100), st.integers(64 << 10, 80 << 10).map(bytes)), max_size=3))
cuts = st.lists(st.integers(0, 70_000), max_size=12)


@FUZZ
@given(st.lists(frames, min_size=1, max_size=5), cuts)
def test_valid_frames_round_trip_in_any_chunks(loop: asyncio.AbstractEventLoop, batch: list, chunking: list[int]) -> None:
    reader = Reader(loop)
    reader.feed(b"".join(encode_frame(*f) for f in batch), chunking)
    assert not reader.errors
    assert reader.frames == [(env, body, bufs) for env, body, bufs in batch]


@FUZZ
@given(st.binary(max_size=4096), cuts)
def test_arbitrary_bytes_after_the_handshake(loop: asyncio.AbstractEventLoop, data: bytes, chunking: list[int]) -> None:
    reader = Reader(loop)
    reader.feed(data, chunking)  # must not raise
    assert all(isinstance(e, _transport.FrameError) for e in reader.errors)
    if not reader.errors:  # whatever was not rejected was a run of whole frames, maybe with one unfinished
        assert len(reader.frames) <= len(data) // HEADER.size


@FUZZ
@given(st.lists(frames, min_size=1, max_size=3), st.data(), cuts)
def test_mutated_frames(loop: asyncio.AbstractEventLoop, batch: list, data: st.DataObject, chunking: list[int]) -> None:
    blob = bytearray(b"".join(encode_frame(*f) for f in batch))
    for _ in range(data.draw(st.integers(1, 4))):
        if not blob:
            break
        i = data.draw(st.integers(0, len(blob) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "big"]))
        if op == "flip":
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del blob[i:i + data.draw(st.integers(1, 64))]
        elif i + 8 <= len(blob):  # a length field overwritten with a huge value
            blob[i:i + 8] = struct.pack("<Q", data.draw(st.integers(MAX_FRAME, 2**64 - 1)))
    reader = Reader(loop)
    reader.feed(bytes(blob), chunking)
    assert all(isinstance(e, _transport.FrameError) for e in reader.errors)
    direct = reader.conn._direct
    assert direct is None or len(direct) <= MAX_FRAME  # nothing allocated past the limit


@FUZZ
@given(st.binary(max_size=200), cuts, st.booleans())
def test_arbitrary_bytes_during_the_handshake(loop: asyncio.AbstractEventLoop, data: bytes, chunking: list[int],
                                              server: bool) -> None:
    """Before the handshake nothing is framed: bytes from a stranger end in AuthenticationError, never in a frame."""
    reader = Reader(loop, handshake=False, is_server=server)
    if not server and data and data[0] & 1:
        data = HELLO_MAGIC + data  # half the client cases get past the greeting to the proof check
    reader.feed(data, chunking)
    assert all(isinstance(e, AuthenticationError) for e in reader.errors)
    assert not reader.frames and not reader.conn.is_open  # no proof of the secret: never opened


def test_limits_are_checked_from_the_header_alone(loop: asyncio.AbstractEventLoop) -> None:
    """A header announcing too many buffers or too many bytes is refused before any payload arrives."""
    for head in (HEADER.pack(MAGIC, 60_000, 0, 0), HEADER.pack(MAGIC, 0, 0, MAX_FRAME),
                 encode_header(0, 0, [2**63, 2**63]), HEADER.pack(0x1234, 0, 0, 0)):
        reader = Reader(loop)
        reader.feed(head, [])
        assert len(reader.errors) == 1 and isinstance(reader.errors[0], _transport.FrameError)
        assert reader.conn._direct is None
