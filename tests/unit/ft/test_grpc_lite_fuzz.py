"""Property-based fuzz of grpc_lite's HTTP/2 frame parsing and gRPC message framing, fed in memory.

Properties: a valid conversation, cut into any chunks, gets every call answered with its exact payload; arbitrary
or mutated bytes never raise out of the reader, never leave more than one frame buffered, and end (if at all) in
a GOAWAY with an HTTP/2 error code, an RST_STREAM or a gRPC status: the documented ways to refuse. The socket-level
abuse cases are in test_grpc_lite_abuse.py.

Budget: small by default; REGENT_FUZZ_EXAMPLES raises it for a longer run by hand.
"""

from __future__ import annotations

import asyncio
import os
import struct

import hpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from regent.ft import grpc_lite
from regent.ft.grpc_lite import DATA, GOAWAY, HEADERS, PREFACE, RST_STREAM, SETTINGS

EXAMPLES = int(os.environ.get("REGENT_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=10_000, suppress_health_check=[HealthCheck.too_slow],
                derandomize="REGENT_FUZZ_EXAMPLES" not in os.environ)
END_STREAM, END_HEADERS = 0x1, 0x4
ERRORS = {grpc_lite.NO_ERROR, grpc_lite.PROTOCOL_ERROR, grpc_lite.FLOW_CONTROL_ERROR, grpc_lite.FRAME_SIZE_ERROR,
          grpc_lite.COMPRESSION_ERROR, grpc_lite.ENHANCE_YOUR_CALM}


class FakeTransport:
    """What the connection writes, and whether it closed; no socket."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closing = False

    def write(self, data: bytes) -> None:
        assert not self.closing or not data, "wrote after closing"
        self.written += data

    def close(self) -> None:
        self.closing = True

    abort = close

    def write_eof(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def parse(out: bytes) -> list[tuple[int, int, int, bytes]]:
    """Frames the server wrote; they must parse to the last byte."""
    frames, pos = [], 0
    while pos < len(out):
        assert len(out) - pos >= 9
        n = int.from_bytes(out[pos:pos + 3], "big")
        frames.append((out[pos + 3], out[pos + 4], int.from_bytes(out[pos + 5:pos + 9], "big"),
                       bytes(out[pos + 9:pos + 9 + n])))
        pos += 9 + n
    assert pos == len(out)
    return frames


def request(stream_id: int, payload: bytes, encoder: hpack.Encoder, path: str = "/t.S/Echo") -> bytes:
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
    message = b"\x00" + struct.pack(">I", len(payload)) + payload
    data = b"".join(frame(DATA, 0, stream_id, message[i:i + 16_384]) for i in range(0, len(message), 16_384))
    return frame(HEADERS, END_HEADERS, stream_id, block) + data + frame(DATA, END_STREAM, stream_id)


async def _echo_later(request: bytes, deadline: float | None) -> bytes:
    await asyncio.sleep(0)
    return request


def _reply_later(request: bytes, deadline: float | None) -> grpc_lite.Reply:
    """Answered from the loop after the handler returned, as a Lighthouse front end answers from its link."""
    reply = grpc_lite.Reply()
    asyncio.get_running_loop().call_soon(lambda: reply.done() or reply.set_result(request))
    return reply


def converse(data: bytes, cuts: list[int], wrap=bytes) -> tuple[grpc_lite._Connection, FakeTransport, list]:
    """Feed `data` to a fresh connection in pieces (each as `wrap` makes it: the reads asyncio hands over are
    bytes); let later answers finish; return what it wrote."""
    async def run() -> tuple[grpc_lite._Connection, FakeTransport]:
        server = grpc_lite.Server({"/t.S/Echo": lambda req, deadline: req, "/t.S/Later": _echo_later,
                                   "/t.S/Reply": _reply_later})
        conn = grpc_lite._Connection(server)
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        sizes = [c for c in cuts if c > 0] or [max(1, len(data))]
        pos = i = 0
        while pos < len(data):
            n = sizes[i % len(sizes)]
            conn.data_received(wrap(data[pos:pos + n]))  # must not raise, whatever the bytes
            assert len(conn._buf) <= 9 + 16_384 + n  # at most one unfinished frame (plus this read) is held
            assert len(conn._streams) <= grpc_lite.MAX_CONCURRENT_STREAMS
            pos += n
            i += 1
        for _ in range(3):
            await asyncio.sleep(0)
        conn.connection_lost(None)
        return conn, transport

    conn, transport = asyncio.run(run())
    return conn, transport, parse(transport.written)


def check_refusals(frames: list) -> None:
    for kind, _, stream_id, payload in frames:
        if kind == GOAWAY:
            assert stream_id == 0 and struct.unpack(">I", payload[4:8])[0] in ERRORS
        elif kind == RST_STREAM:
            assert stream_id and len(payload) == 4


def responses(frames: list) -> dict[int, tuple[bytes, list]]:
    """stream -> (DATA bytes, decoded trailers) from the server's frames."""
    decoder = hpack.Decoder()
    out: dict[int, tuple[bytearray, list]] = {}
    for kind, flags, stream_id, payload in frames:
        if kind == DATA:
            out.setdefault(stream_id, (bytearray(), []))[0].extend(payload)
        elif kind == HEADERS:
            headers = decoder.decode(payload)
            if flags & END_STREAM:
                out.setdefault(stream_id, (bytearray(), []))[1].extend(headers)
    return {k: (bytes(v[0]), v[1]) for k, v in out.items()}


# The client's preface and SETTINGS, with windows large enough that no response waits for flow control.
START = (PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", grpc_lite.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20)) +
         frame(grpc_lite.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 24)))
cuts = st.lists(st.integers(0, 20_000), max_size=10)


@FUZZ
@given(st.lists(st.tuples(st.binary(max_size=100_000), st.sampled_from(["Echo", "Later", "Reply"])), min_size=1,
                max_size=4), cuts, st.sampled_from([bytes, bytearray, memoryview]))
def test_valid_calls_round_trip_in_any_chunks(calls: list[tuple[bytes, str]], chunking: list[int], wrap) -> None:
    encoder = hpack.Encoder()  # one encoder: later blocks refer to the dynamic table, as real clients' do
    data = START + b"".join(request(1 + 2 * i, payload, encoder, f"/t.S/{name}")
                            for i, (payload, name) in enumerate(calls))
    _, _, frames = converse(data, chunking, wrap)
    got = responses(frames)
    for i, (payload, _) in enumerate(calls):
        body, trailers = got[1 + 2 * i]
        assert ("grpc-status", "0") in trailers
        assert body == b"\x00" + struct.pack(">I", len(payload)) + payload
    assert not any(kind in (GOAWAY, RST_STREAM) for kind, *_ in frames)


@FUZZ
@given(st.binary(max_size=3000), cuts)
def test_arbitrary_bytes_after_the_preface(data: bytes, chunking: list[int]) -> None:
    _, _, frames = converse(START + data, chunking)
    check_refusals(frames)


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_instead_of_the_preface(data: bytes) -> None:
    _, transport, frames = converse(data, [])
    check_refusals(frames)
    if not PREFACE.startswith(data[:len(PREFACE)]):
        assert transport.closing and frames[-1][0] == GOAWAY


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=3), st.data(), cuts)
def test_mutated_conversation(payloads: list[bytes], data: st.DataObject, chunking: list[int]) -> None:
    encoder = hpack.Encoder()
    blob = bytearray(b"".join(request(1 + 2 * i, p, encoder) for i, p in enumerate(payloads)))
    for _ in range(data.draw(st.integers(1, 5))):
        i = data.draw(st.integers(0, len(blob) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "byte"]))
        if op == "flip":
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del blob[i:i + data.draw(st.integers(1, 20))]
        elif op == "insert":
            blob[i:i] = data.draw(st.binary(min_size=1, max_size=12))
        else:
            blob[i] = data.draw(st.sampled_from([0x00, 0x01, 0x04, 0x08, 0x20, 0x7F, 0x80, 0xFF]))
        if not blob:
            break
    _, _, frames = converse(START + bytes(blob), chunking)
    check_refusals(frames)
    for body, trailers in responses(frames).values():
        status = dict(trailers).get("grpc-status")
        assert status is not None  # every answered call ends with a status
        if status == "0":  # an OK answer echoes one well-formed message
            assert len(body) >= 5 and int.from_bytes(body[1:5], "big") == len(body) - 5


@FUZZ
@given(st.binary(max_size=200), st.booleans())
def test_grpc_message_framing(body: bytes, prefixed: bool) -> None:
    """Any request body: the handler sees exactly one well-formed message, or the call gets a gRPC status."""
    if prefixed:
        body = b"\x00" + struct.pack(">I", len(body)) + body
    encoder = hpack.Encoder()
    head = request(1, b"", encoder)
    headers_frame = head[:9 + int.from_bytes(head[:3], "big")]
    _, _, frames = converse(START + headers_frame + frame(DATA, END_STREAM, 1, body), [])
    (data, trailers), = responses(frames).values()
    status = dict(trailers)["grpc-status"]
    if len(body) >= 5 and body[0] == 0 and int.from_bytes(body[1:5], "big") == len(body) - 5:
        assert status == "0" and data == body
    else:
        assert status in ("3", "8", "12") and not data  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED


@FUZZ
@given(st.binary(max_size=600))
def test_header_block_decoding(block: bytes) -> None:
    """Arbitrary HPACK: a header list or COMPRESSION_ERROR, nothing else."""
    conn = grpc_lite._Connection(grpc_lite.Server({}))
    try:
        headers = conn._decode_headers(block)
    except grpc_lite._ConnectionError as err:
        assert err.code == grpc_lite.COMPRESSION_ERROR
        return
    assert all(isinstance(n, bytes) and isinstance(v, bytes) for n, v in headers)


@FUZZ
@given(st.binary(max_size=16), st.binary(max_size=40), st.integers(0, 50))
def test_small_parsers(timeout: bytes, block: bytes, at: int) -> None:
    seconds = grpc_lite.parse_timeout(timeout)
    assert seconds is None or 0 <= seconds <= 1e8 * 3600
    value = grpc_lite._plain_literal_value(block, at)
    assert value is None or block.endswith(value)


@FUZZ
@given(st.integers(0, 2**32), st.integers(1, 8))
def test_hpack_int_round_trips(value: int, prefix: int) -> None:
    encoded = grpc_lite.hpack_int(value, prefix)
    limit = (1 << prefix) - 1
    decoded, i = encoded[0] & limit, 1
    if decoded == limit:
        shift = 0
        while True:
            decoded += (encoded[i] & 0x7F) << shift
            shift += 7
            i += 1
            if not encoded[i - 1] & 0x80:
                break
    assert decoded == value and i == len(encoded)
