"""How peer state transfer describes a state on the wire: JSON that cannot run code (no pickle).

A state travels as its structure (the "skeleton": the state with each tensor replaced by a placeholder),
its tensor descriptions and the raw tensor bytes. This module encodes the first two for exactly the types a
training state holds, and refuses anything else with an error that names the path:

- `None`, `bool`, `int`, `float` (also nan/inf), `str`: JSON's own values;
- containers, as a JSON array whose first item is a one-letter tag (so list and tuple stay distinct):
  `["l", ...]` list, `["t", ...]` tuple, `["d", k1, v1, k2, v2, ...]` dict (keys: str, int, float, bool or
  None, so an optimizer's integer keys come back as integers);
- `["T"]` a tensor's place in the skeleton, `["y", "bfloat16"]` a torch dtype, `["s", 4, 8]` a torch.Size,
  `["f", "nan"]` a float JSON has no number for.

Tensor descriptions (`TensorMeta`) go by columns: paths, shapes, dtype names, byte sizes and, for a
DTensor's shard, its placements (Shard / Replicate / Partial / _StridedShard), global shape and stride.
Every decoded description is checked before anything is allocated: its byte size must be what its shape
and dtype take. A peer's description is at most `MAX_HEADER_BYTES` (a state of about a million tensors);
raise it per transport (`max_header_bytes=`) for a larger one.

Tensor bytes carry a checksum (`tensor_digest`, 8 bytes per tensor): cheap enough to run on every transfer
(about 3x faster than zlib's CRC-32 here) and sensitive to where each byte is, not only to what it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from typing import Any

import numpy as np
import torch

# Largest state description (structure plus tensor descriptions) accepted from a peer. A 1B-parameter
# trainer's is ~50 KB; this bound is for a hostile or broken peer, not a limit on healthy runs.
MAX_HEADER_BYTES = 64 << 20

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {d: name for name, d in sorted(_DTYPES.items(), reverse=True)}
_KEY_TYPES = (str, int, float, bool, type(None))
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class WireFormatError(ValueError):
    """A peer's state description is not valid (bad JSON, an unknown tag, inconsistent sizes, too large);
    nothing of it was loaded."""


class UnsupportedStateError(TypeError):
    """The state holds a value the transfer cannot describe (only plain data, dtypes, sizes and tensors)."""


# ---- tensor bytes ------------------------------------------------------------------------------------------

_ROW_WORDS = 512  # 4 KiB rows
DIGEST_BYTES = 8


def tensor_digest(buf: Any) -> bytes:
    """An 8-byte checksum of a buffer (a tensor's bytes), to catch corruption on the way, not forgery.

    Why not CRC-32: zlib's runs at ~2 GB/s on one core, which tripled the time of a 60 MB transfer on a
    2-core box. This one reads the bytes as 64-bit words in rows of 4 KiB and takes, with numpy (memory speed,
    GIL released): the row sums weighted by row number, the column sums weighted by column number, and their
    total (all mod 2^64); the tail shorter than a row goes through CRC-32; the length is mixed in. A changed
    word changes the total; two words swapped change a weighted sum unless they are equal; bytes swapped inside
    a word change that word. The five values are folded to 8 bytes with BLAKE2b."""
    b = np.frombuffer(buf, dtype=np.uint8)
    n = b.size
    full = n - n % (8 * _ROW_WORDS)
    m = b[:full].view(np.uint64).reshape(-1, _ROW_WORDS)
    rows = m.sum(axis=1, dtype=np.uint64)
    cols = m.sum(axis=0, dtype=np.uint64)
    by_row = int((rows * np.arange(1, rows.size + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    by_col = int((cols * np.arange(1, _ROW_WORDS + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    total = int(rows.sum(dtype=np.uint64))
    packed = struct.pack("<QQQIQ", total, by_row, by_col, zlib.crc32(b[full:]), n)
    return hashlib.blake2b(packed, digest_size=DIGEST_BYTES).digest()


# ---- encoding ---------------------------------------------------------------------------------------------


def encode_tree(node: Any, leaf: Any = None) -> Any:
    """`node` as JSON-ready data (see the module docstring); `leaf` (identity) marks a tensor's place. Raises
    `UnsupportedStateError`, naming the value's path, for anything else."""
    plain = _PLAIN
    tagged = {list: "l", tuple: "t"}

    def enc(node: Any) -> Any:
        kind = type(node)
        if node is leaf:
            return _LEAF
        if kind is dict:
            out: list[Any] = ["d"]
            for k, v in node.items():
                if type(k) not in _KEY_TYPES:
                    raise _Unsupported
                out.append(k if type(k) is not float or math.isfinite(k) else ["f", repr(k)])
                out.append(enc(v))
            return out
        if kind in plain:
            return node if kind is not float or math.isfinite(node) else ["f", repr(node)]
        tag = tagged.get(kind)
        if tag is not None:
            return [tag, *map(enc, node)]
        if kind is torch.Size:
            return ["s", *node]
        if kind is torch.dtype:
            return ["y", _DTYPE_NAMES[node]]
        raise _Unsupported

    try:
        return enc(node)
    except _Unsupported:
        raise _unsupported(node, leaf) from None


_PLAIN = frozenset({str, int, bool, float, type(None)})


class _Unsupported(Exception):
    """Raised inside `encode_tree`'s walk; `_unsupported` then finds the path (off the fast path)."""


def _unsupported(node: Any, leaf: Any, path: str = "") -> UnsupportedStateError:
    kind = type(node)
    if node is leaf or kind in _PLAIN or kind in (torch.Size, torch.dtype):
        return None  # type: ignore[return-value]
    if kind is dict:
        for k, v in node.items():
            if type(k) not in _KEY_TYPES:
                return UnsupportedStateError(f"state key {k!r} at {path or '/'} is a {type(k).__name__}; peer "
                                             "transfer takes str, int, float, bool or None keys")
            found = _unsupported(v, leaf, f"{path}/{k}")
            if found is not None:
                return found
        return None  # type: ignore[return-value]
    if kind is list or kind is tuple:
        for i, v in enumerate(node):
            found = _unsupported(v, leaf, f"{path}/{i}")
            if found is not None:
                return found
        return None  # type: ignore[return-value]
    if isinstance(node, torch.Tensor):
        return UnsupportedStateError(f"a tensor at {path or '/'} is in the structure; flatten the state first")
    return UnsupportedStateError(
        f"state value at {path or '/'} is a {kind.__module__}.{kind.__qualname__}; peer transfer carries dicts, "
        "lists, tuples, str/int/float/bool/None, torch dtypes, torch.Size and tensors only: convert it (e.g. to "
        "a dict or a tensor) in the state_dict function"
    )


_LEAF = ["T"]


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


# ---- decoding ---------------------------------------------------------------------------------------------


def loads(blob: bytes | bytearray | memoryview, what: str = "state description",
          max_bytes: int = MAX_HEADER_BYTES) -> Any:
    """Parse JSON from a peer (bounded size, no NaN tokens, no deep nesting crash)."""
    if len(blob) > max_bytes:
        raise WireFormatError(f"peer's {what} is {len(blob)} bytes, over the {max_bytes} accepted "
                              "(max_header_bytes)")
    try:
        return json.loads(bytes(blob), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise WireFormatError(f"peer's {what} is not valid JSON: {err}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"bare {name} is not JSON")


def decode_tree(data: Any, leaf: Any = None) -> tuple[Any, int]:
    """The inverse of `encode_tree`, and how many tensor places (`leaf`) it holds; raises `WireFormatError`
    on anything `encode_tree` would not have produced."""
    leaves = 0
    plain = _PLAIN
    key_types = _KEY_TYPES

    def dec(node: Any, depth: int) -> Any:
        nonlocal leaves
        kind = type(node)
        if kind is not list:
            if kind in plain:
                return node
            raise WireFormatError(f"unexpected {kind.__name__} in a state description")
        if not node or type(node[0]) is not str:
            raise WireFormatError("a container in the state description has no type tag")
        tag = node[0]
        if tag == "T" and len(node) == 1:
            leaves += 1
            return leaf
        if depth > _MAX_DEPTH:
            raise WireFormatError(f"state description nested more than {_MAX_DEPTH} deep")
        depth += 1
        if tag == "d":
            if len(node) % 2 == 0:
                raise WireFormatError("a dict in the state description has a key without a value")
            out = {}
            it = iter(node)
            next(it)
            for k in it:
                v = next(it)
                if type(k) not in key_types:
                    k = dec(k, depth)  # a non-finite float key is tagged
                    if type(k) is not float:
                        raise WireFormatError("dict keys in a state description must be str, int, float, bool or null")
                out[k] = v if type(v) in plain else dec(v, depth)
            return out
        if tag == "l":
            return [v if type(v) in plain else dec(v, depth) for v in node[1:]]
        if tag == "t":
            return tuple([v if type(v) in plain else dec(v, depth) for v in node[1:]])
        if tag == "y" and len(node) == 2:
            return _dtype(node[1])
        if tag == "s" and all(type(v) is int and 0 <= v < _DIM_LIMIT for v in node[1:]):
            return torch.Size(node[1:])
        if tag == "f" and len(node) == 2 and type(node[1]) is str and node[1] in _NONFINITE:
            return _NONFINITE[node[1]]
        raise WireFormatError(f"unknown type tag {tag!r} (or a malformed {tag!r} entry) in a state description")

    try:
        tree = dec(data, 0)
    except RecursionError:  # the depth bound is checked, but the caller's own stack depth is not known here
        raise WireFormatError("state description nested too deep for this process's stack") from None
    return tree, leaves


# Containers inside containers. A training state nests a handful of levels; each level costs two Python frames
# here (the walk and its comprehension), so 500 overran the interpreter's default limit of 1000 and a peer's
# 600-deep list escaped as a RecursionError instead of a WireFormatError.
_MAX_DEPTH = 200
# torch sizes are int64: a larger dimension or byte count cannot describe a real tensor (torch.Size raises a
# plain ValueError on one, which must surface as WireFormatError like every other bad description).
_DIM_LIMIT = 1 << 63


def _dtype(name: Any) -> torch.dtype:
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise WireFormatError(f"unknown dtype {name!r} in a state description")
    return dtype


# ---- tensor descriptions ----------------------------------------------------------------------------------


def encode_metas(metas: list[Any]) -> dict[str, Any]:
    """`TensorMeta`s by columns (see the module docstring)."""
    return {
        "paths": [m.path for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "dtypes": [_DTYPE_NAMES[m.dtype] for m in metas],
        "nbytes": [m.nbytes for m in metas],
        "specs": [None if m.dtensor is None else _encode_spec(m.dtensor, m.path) for m in metas],
    }


def decode_metas(data: Any, meta_type: Any) -> list[Any]:
    """`meta_type` (TensorMeta) tuples from `encode_metas` data, each checked: a path, non-negative integer
    dims, a known dtype, and a byte size equal to what shape and dtype take."""
    if type(data) is not dict:
        raise WireFormatError("tensor descriptions must be a JSON object")
    try:
        paths, shapes, dtypes, nbytes, specs = (data[k] for k in ("paths", "shapes", "dtypes", "nbytes", "specs"))
    except KeyError as err:
        raise WireFormatError(f"tensor descriptions lack {err}") from None
    columns = (paths, shapes, dtypes, nbytes, specs)
    if any(type(c) is not list for c in columns) or len({len(c) for c in columns}) != 1:
        raise WireFormatError("tensor descriptions: columns must be lists of one length")
    out = []
    new = tuple.__new__
    for path, shape, dtype_name, size, spec in zip(*columns):
        if type(path) is not str or type(shape) is not list or not all(
                type(d) is int and 0 <= d < _DIM_LIMIT for d in shape):
            raise WireFormatError(f"tensor description {path!r}: bad path or shape {shape!r}")
        dtype = _dtype(dtype_name)
        expected = math.prod(shape) * dtype.itemsize
        if type(size) is not int or size != expected or size >= _DIM_LIMIT:
            raise WireFormatError(f"tensor {path!r}: {size!r} bytes declared, but shape {shape} of {dtype} takes "
                                  f"{expected}")
        out.append(new(meta_type, (path, tuple(shape), dtype, size, None if spec is None else _decode_spec(spec, path))))
    return out


def _encode_spec(spec: Any, path: str) -> list[Any]:
    placements, shape, stride = spec
    return [[_encode_placement(p, path) for p in placements], list(shape), list(stride)]


def _encode_placement(p: Any, path: str) -> list[Any]:
    name = type(p).__name__
    if name == "Replicate":
        return ["Replicate"]
    if name == "Shard":
        return ["Shard", int(p.dim)]
    if name == "_StridedShard":
        return ["_StridedShard", int(p.dim), int(p.split_factor)]
    if name == "Partial":
        return ["Partial", str(p.reduce_op)]
    raise UnsupportedStateError(f"DTensor at {path} has placement {p!r}; peer transfer takes Shard, Replicate, "
                                "_StridedShard and Partial")


def _decode_spec(spec: Any, path: str) -> tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...]]:
    ints = lambda v: type(v) is list and all(type(x) is int for x in v)  # noqa: E731
    if type(spec) is not list or len(spec) != 3 or type(spec[0]) is not list or not ints(spec[1]) \
            or not ints(spec[2]):
        raise WireFormatError(f"tensor {path!r}: malformed DTensor layout")
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = []
    for p in spec[0]:
        if p == ["Replicate"]:
            placements.append(Replicate())
        elif type(p) is list and len(p) == 2 and p[0] == "Shard" and type(p[1]) is int:
            placements.append(Shard(p[1]))
        elif type(p) is list and len(p) == 3 and p[0] == "_StridedShard" and ints(p[1:]):
            placements.append(_StridedShard(p[1], split_factor=p[2]))
        elif type(p) is list and len(p) == 2 and p[0] == "Partial" and p[1] in ("sum", "avg", "max", "min"):
            placements.append(Partial(p[1]))
        else:
            raise WireFormatError(f"tensor {path!r}: unknown DTensor placement {p!r}")
    return tuple(placements), tuple(spec[1]), tuple(spec[2])


def check_index_lists(lists: Any, what: str, nbytes: list[int], seen: set[int]) -> list[list[int]]:
    """Packs or runs from a peer: lists of tensor indices in range, none given twice (`seen` collects them),
    none of an empty tensor."""
    if type(lists) is not list:
        raise WireFormatError(f"{what} must be a list")
    n = len(nbytes)
    for run in lists:
        if type(run) is not list or not run:
            raise WireFormatError(f"{what}: each entry must be a non-empty list of tensor indices")
        for i in run:
            if type(i) is not int or not 0 <= i < n or nbytes[i] == 0 or i in seen:
                raise WireFormatError(f"{what}: bad or repeated tensor index {i!r} (of {n})")
            seen.add(i)
    return lists
