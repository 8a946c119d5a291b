"""Property-based fuzz of what peer state transfer reads from the network (`regent.ft.wire`, `regent.ft.transfer`).

Properties: bytes from a peer, arbitrary or a valid description mutated, never crash, never hang and never make
the healer allocate more than the bytes it was sent; they are refused with `WireFormatError` (the documented
error) or accepted as a well-formed description; valid states round-trip exactly.

The budget is small so the suite stays fast (REGENT_FUZZ_EXAMPLES raises it for a longer run by hand, e.g. 20000).
"""

from __future__ import annotations

import math
import os
import socket
import struct
import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from regent.ft import transfer, wire
from regent.ft.transfer import StateMeta, TensorMeta
from regent.ft.wire import WireFormatError

EXAMPLES = int(os.environ.get("REGENT_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=10_000, suppress_health_check=[HealthCheck.too_slow],
                derandomize="REGENT_FUZZ_EXAMPLES" not in os.environ)
LEAF = transfer._TENSOR

# ---- strategies ------------------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
keys = st.one_of(st.text(max_size=10), st.integers(-1000, 1000), st.booleans(), st.none(),
                 st.floats(allow_nan=False))
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.uint8])
leaves = st.one_of(scalars, st.just(LEAF), dtypes, st.lists(st.integers(0, 1 << 20), max_size=4).map(torch.Size))
states = st.recursive(
    leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
                            st.dictionaries(keys, inner, max_size=4)),
    max_leaves=30,
)
# Arbitrary JSON: what a hostile donor's description could be after parsing.
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=12), st.sampled_from(["T", "d", "l", "t", "y", "s", "f", "nan", "float32"])),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=12,
)


def same(a: object, b: object) -> bool:
    """Structural equality where nan equals nan and list/tuple, int/bool stay distinct."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(ka, kb) and same(a[ka], b[kb]) for ka, kb in zip(a, b))
    return a == b


def mutate(blob: bytes, data: st.DataObject) -> bytes:
    """Flip, cut, insert or overwrite bytes of a valid encoding (where real corruption and forgery start)."""
    out = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "set"]))
        i = data.draw(st.integers(0, max(0, len(out) - 1)))
        if op == "flip" and out:
            out[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del out[i:i + data.draw(st.integers(1, 16))]
        elif op == "insert":
            out[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif out:
            out[i] = data.draw(st.sampled_from(b'[]{}",:0123456789-eE.ntfTdlsyx\\'))
    return bytes(out)


def meta(shape: list[int], dtype: torch.dtype, path: str) -> TensorMeta:
    return TensorMeta(path, tuple(shape), dtype, math.prod(shape) * dtype.itemsize)


metas = st.lists(st.builds(meta, st.lists(st.integers(0, 64), max_size=3), dtypes, st.text(min_size=1, max_size=12)),
                 max_size=6)

# ---- wire: the state description -------------------------------------------------------------------------------


@FUZZ
@given(states)
def test_state_structure_round_trips(state: object) -> None:
    blob = wire.dumps(wire.encode_tree(state, LEAF))
    tree, leaves = wire.decode_tree(wire.loads(blob), LEAF)
    assert same(tree, state) or (tree is LEAF and state is LEAF)
    assert leaves == blob.count(b'["T"]')


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_as_description(blob: bytes) -> None:
    try:
        data = wire.loads(blob)
    except WireFormatError:
        return
    with _maybe_refused():
        wire.decode_tree(data, LEAF)


class _maybe_refused:
    """Like `pytest.raises(WireFormatError)` but the block may also succeed."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        return kind is None or issubclass(kind, WireFormatError)


@FUZZ
@given(json_values)
def test_arbitrary_json_as_structure(data: object) -> None:
    with _maybe_refused():
        wire.decode_tree(data, LEAF)


@FUZZ
@given(states, st.data())
def test_mutated_structure(state: object, data: st.DataObject) -> None:
    blob = mutate(wire.dumps(wire.encode_tree(state, LEAF)), data)
    with _maybe_refused():
        wire.decode_tree(wire.loads(blob), LEAF)


def test_deep_nesting_and_huge_sizes_are_refused() -> None:
    """The edges a random search is unlikely to hit, both found while writing this suite: a 600-deep list
    escaped as RecursionError (the depth bound was 500, two frames a level), and torch.Size raised a plain
    ValueError on a dimension of 2**63."""
    with pytest.raises(WireFormatError):
        wire.loads(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(WireFormatError):
        wire.decode_tree(wire.loads(b'["l",' * 600 + b"1" + b"]" * 600), LEAF)
    within_bound = wire.loads(b'["l",' * 190 + b"1" + b"]" * 190)
    assert wire.decode_tree(within_bound, LEAF)[1] == 0
    with pytest.raises(WireFormatError):  # the same, called from deep in a stack: refused, not RecursionError
        _deep_call(800, lambda: wire.decode_tree(within_bound, LEAF))
    with pytest.raises(WireFormatError):
        wire.decode_tree(["s", 2**63], LEAF)
    with pytest.raises(WireFormatError):
        wire.decode_metas({"paths": ["w"], "shapes": [[2**62, 4]], "dtypes": ["float32"], "nbytes": [2**66],
                           "specs": [None]}, TensorMeta)
    with pytest.raises(WireFormatError):
        wire.loads(b"[" + b"0," * 100 + b"0]", max_bytes=64)


def _deep_call(depth: int, fn: Callable[[], object]) -> object:
    return fn() if depth == 0 else _deep_call(depth - 1, fn)


# ---- wire: tensor descriptions ---------------------------------------------------------------------------------


@FUZZ
@given(metas)
def test_tensor_descriptions_round_trip(ms: list[TensorMeta]) -> None:
    blob = wire.dumps(wire.encode_metas(ms))
    assert wire.decode_metas(wire.loads(blob), TensorMeta) == ms


@FUZZ
@given(metas, st.data())
def test_mutated_tensor_descriptions(ms: list[TensorMeta], data: st.DataObject) -> None:
    blob = mutate(wire.dumps(wire.encode_metas(ms)), data)
    try:
        decoded = wire.decode_metas(wire.loads(blob), TensorMeta)
    except WireFormatError:
        return
    for m in decoded:  # accepted only if self-consistent: its byte size is what shape and dtype take
        assert m.nbytes == math.prod(m.shape) * m.dtype.itemsize and m.nbytes < 2**63


@FUZZ
@given(st.dictionaries(st.sampled_from(["paths", "shapes", "dtypes", "nbytes", "specs", "x"]),
                       st.lists(json_values, max_size=4), max_size=6))
def test_arbitrary_tensor_description_columns(data: dict) -> None:
    with _maybe_refused():
        wire.decode_metas(data, TensorMeta)


@FUZZ
@given(st.lists(st.lists(st.integers(-3, 10), max_size=4), max_size=4),
       st.lists(st.integers(0, 100), min_size=0, max_size=8))
def test_index_lists(lists: list, sizes: list[int]) -> None:
    seen: set[int] = set()
    try:
        wire.check_index_lists(lists, "packs", sizes, seen)
    except WireFormatError:
        return
    flat = [i for run in lists for i in run]
    assert len(flat) == len(set(flat)) and all(0 <= i < len(sizes) and sizes[i] for i in flat)


# ---- transfer: the served description, the request, the group header, the length prefix -----------------------


@FUZZ
@given(states, metas, st.integers(-2**63, 2**63 - 1), st.data())
def test_served_description(state: object, ms: list[TensorMeta], step: int, data: st.DataObject) -> None:
    encoded = wire.encode_tree(state, LEAF)
    ms = ms + [meta([2], torch.float32, f"in_state{i}") for i in range(wire.dumps(encoded).count(b'["T"]'))]
    skeleton = ["d", "model", encoded, "t", ["t", *[["T"]] * (len(ms) - wire.dumps(encoded).count(b'["T"]'))]]
    blob = wire.dumps({"step": step, "skeleton": skeleton, "tensors": wire.encode_metas(ms)})
    got = transfer._decode_served(blob, wire.MAX_HEADER_BYTES)
    assert got.step == step and got.tensors == ms
    bad = mutate(blob, data)
    try:
        served = transfer._decode_served(bad, wire.MAX_HEADER_BYTES)
    except WireFormatError:
        return
    assert isinstance(served, StateMeta) and isinstance(served.step, int)


@FUZZ
@given(st.one_of(st.binary(max_size=300), json_values.map(lambda v: wire.dumps(v) if _finite(v) else b"")))
def test_transfer_request(blob: bytes) -> None:
    """What a donor reads from any connecting healer (after the handshake)."""
    try:
        request = transfer._parse_request(blob)
    except WireFormatError:
        return
    assert request["what"] in ("meta", "chunk") and type(request["step"]) is int
    if request["what"] == "chunk":
        assert 0 <= request["chunk"] < request["of"]


def _finite(v: object) -> bool:
    try:
        wire.dumps(v)
        return True
    except ValueError:
        return False


@FUZZ
@given(st.binary(max_size=600), st.data())
def test_group_state_structure(blob: bytes, data: st.DataObject) -> None:
    """GroupTransport's [skeleton, packs, runs] blob, arbitrary and mutated from a valid one."""
    for candidate in (blob, mutate(wire.dumps([["d", "w", ["T"]], [[0]], []]), data)):
        try:
            skeleton, packs, runs, leaves = transfer._decode_state(candidate, wire.MAX_HEADER_BYTES)
        except WireFormatError:
            continue
        assert leaves >= 0


@FUZZ
@given(st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_length_prefix_is_checked_before_allocating(announced: int, rest: bytes) -> None:
    """A length prefix above the bound is refused from its 8 bytes alone (no buffer of that size is made); one
    within it reads exactly that many bytes or fails on the closed connection."""
    a, b = socket.socketpair()
    try:
        a.settimeout(2)
        b.settimeout(2)
        sender = threading.Thread(target=lambda: (b.sendall(struct.pack("!Q", announced) + rest), b.close()))
        sender.start()
        try:
            got = transfer._recv_frame(a, 1 << 20, "state description")
        except WireFormatError:
            assert announced > 1 << 20
        except ConnectionError:
            assert len(rest) < announced <= 1 << 20
        else:
            assert len(got) == announced and got == rest[:announced]
        sender.join(5)
    finally:
        a.close()
        b.close()
