"""Peer state transfer: a healing replica pulls the state of an up-to-date donor replica.

Two transports with one interface (`CheckpointTransport`):
- `GroupTransport` sends over the replicated group that the quorum just rebuilt: metadata pickled, tensors
  sent raw, device to device on GPU, and received **in place** into the healer's existing tensors when the
  path, shape and dtype match (no extra allocation, no host round-trip).
- `StreamTransport` is the fallback when no group is available: the donor serves its staged state on a TCP
  socket and the healer fetches it over several parallel connections (chunks of tensors), again writing
  into its own tensors in place. One donor serves any number of healers at once.

Faults, the same for both:
- every request names the step it wants; a donor at another step refuses it ("stale step");
- a receive that does not finish within `timeout` raises `TimeoutError`;
- once the donor's weights are about to change (`disallow_checkpoint`, called by the Manager in
  `should_commit`), it stops serving; in-flight reads finish first (they hold the read side of the lock).

Trust: nothing a peer sends is unpickled. The structure and tensor descriptions travel as JSON for exactly
the types a training state holds (`regent.ft.wire`), bounded in size (`max_header_bytes`) and checked
before any tensor byte is received: sizes must match shapes and dtypes, a tensor the healer already holds
must arrive with its shape and dtype, and the wire layout must name each tensor once. The TCP transport also
authenticates both ends with the job secret (`regent.auth`, the actor transport's challenge-response):
a donor serves only processes that know it, a healer loads only from a donor that knows it. Without a secret
(library use outside `regent train`, no `REGENT_JOB_SECRET`) it runs unauthenticated, as before, and says so
once in the log; a process with a secret never talks to one without.

Integrity (TCP): after the bytes of its tensors, each chunk connection carries their checksums
(`wire.tensor_digest`, 8 bytes per non-empty tensor, computed once per served state and cached); the healer
computes the same over what it received and raises `TransferIntegrityError`, naming the tensor, on any
difference. The transfer then fails
like a dropped connection: the received state is never returned, so the Manager reports the heal as failed and
never commits on it (tensors received in place may hold part of the donor's bytes until the next heal).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import secrets
import socket
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from regent import auth
from regent.contiguous import byte_span, spans_one_range
from regent.dtensor import is_dtensor
from regent.ft import wire
from regent.ft.wire import MAX_HEADER_BYTES, WireFormatError
from regent.sockio import recv_exact, recv_into

logger = logging.getLogger(__name__)

# Tensors smaller than this travel packed into one message over the replicated group.
PACKED_BELOW_BYTES = 1 << 20
# Adjacent tensors merge into messages of up to this size (a healer whose layout differs stages one such
# message at a time, so this also bounds its extra memory).
MAX_MESSAGE_BYTES = 1 << 30
# GroupTransport's first message: the encoded metadata of a typical trainer state fits (1b: ~50 KB).
HEADER_BYTES = 256 << 10


class RWLock:
    """Many readers (donors serving state) or one writer (the optimizer changing the weights)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def acquire_read(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._writer, timeout) and self._add_reader()

    def _add_reader(self) -> bool:
        self._readers += 1
        return True

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def acquire_write(self, timeout: float | None = None) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writer, timeout):
                return False
            self._writer = True
            if not self._cond.wait_for(lambda: self._readers == 0, timeout):
                self._writer = False
                self._cond.notify_all()
                return False
            return True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def read(self, timeout: float | None = None) -> Iterator[None]:
        if not self.acquire_read(timeout):
            raise TimeoutError(f"state is being modified; could not read it within {timeout} s")
        try:
            yield
        finally:
            self.release_read()

    @contextlib.contextmanager
    def write(self, timeout: float | None = None) -> Iterator[None]:
        if not self.acquire_write(timeout):
            raise TimeoutError(f"state is being read; could not lock it for writing within {timeout} s")
        try:
            yield
        finally:
            self.release_write()


# ---- flattening -----------------------------------------------------------------------------------------


class TensorMeta(NamedTuple):
    """One tensor's place in the state (a tuple: a heal builds and encodes hundreds of them)."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    # for a DTensor: (placements, global shape, global stride); the receiver rebuilds it on its own mesh
    dtensor: Any = None


@dataclass
class StateMeta:
    """Everything but the tensor bytes: the step, the structure with each tensor replaced by `_TENSOR`
    (tensors are numbered in walk order), and each tensor's description."""

    step: int
    skeleton: Any
    tensors: list[TensorMeta]


class _TensorLeaf:
    """Where a tensor was in the skeleton (one shared instance; `wire` encodes it as `["T"]`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorLeaf()


def _is_sequence(node: Any) -> bool:
    """Lists and plain tuples are walked into; named tuples and torch.Size are kept whole (one rule for every
    walk here)."""
    return isinstance(node, list) or _is_plain_tuple(node)


def _is_plain_tuple(node: Any) -> bool:
    return isinstance(node, tuple) and not hasattr(node, "_fields") and type(node) is not torch.Size


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself. Peers of the same group
    rank hold the same shard layout, so shards move between them as plain tensors."""
    return t.to_local() if is_dtensor(t) else t


def _tensors_by_path(state: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            out[path] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif _is_sequence(node):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(state, "")
    return out


def _flatten(state: Any, step: int) -> tuple[StateMeta, list[torch.Tensor], list[torch.Tensor]]:
    """`flatten_state`, plus each tensor as it was in the state (a DTensor, where the second list holds its
    local shard)."""
    tensors: list[torch.Tensor] = []
    originals: list[torch.Tensor] = []
    metas: list[TensorMeta] = []

    new_meta = tuple.__new__  # a NamedTuple's own constructor is a Python function: too slow for ~600 calls

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            originals.append(node)
            spec = None
            if type(node) is not torch.Tensor and is_dtensor(node):  # plain tensors skip the probe
                spec = (tuple(node.placements), tuple(node.shape), tuple(node.stride()))
                node = node.to_local()
            t = node.detach() if node.requires_grad else node
            metas.append(new_meta(TensorMeta, (path, tuple(t.shape), t.dtype, t.nbytes, spec)))
            tensors.append(t)
            return _TENSOR
        if isinstance(node, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if _is_plain_tuple(node):
            return tuple(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    skeleton = walk(state, "")
    return StateMeta(step=step, skeleton=skeleton, tensors=metas), tensors, originals


def flatten_state(state: Any, step: int) -> tuple[StateMeta, list[torch.Tensor]]:
    """Split a nested state (dicts, lists, tuples, tensors, plain values) into metadata and tensors.

    DTensors are sent as their local shard (see `local_view`)."""
    meta, tensors, _ = _flatten(state, step)
    return meta, tensors


def unflatten_state(meta: StateMeta, tensors: list[torch.Tensor], like: Any = None,
                    like_tensors: list[torch.Tensor] | None = None) -> Any:
    """Rebuild the state. Where `like` (the receiver's own state) holds a DTensor at the same path, the
    result is that DTensor (filled in place) or a DTensor wrapped around the received shard.

    `like_tensors`: `like`'s tensors in flatten order, when its description equals `meta.tensors` (saves
    looking them up by path)."""
    if like_tensors is not None:
        mine_at: Any = like_tensors.__getitem__
        any_mesh = next((t.device_mesh for t in like_tensors if type(t) is not torch.Tensor and is_dtensor(t)), None)
    else:
        own = _tensors_by_path(like) if like is not None else {}
        mine_at = lambda index: own.get(meta.tensors[index].path)  # noqa: E731
        # All of a trainer's DTensors live on its one FSDP mesh: a shard the receiver has no slot for yet (say,
        # outer-optimizer momentum on a fresh replica) is rebuilt on that mesh with the donor's layout.
        any_mesh = next((t.device_mesh for t in own.values() if is_dtensor(t)), None)

    def restore(index: int) -> torch.Tensor:
        t = tensors[index]
        tm = meta.tensors[index]
        if tm.dtensor is None and any_mesh is None:
            return t
        mine = mine_at(index)
        if mine is not None and type(mine) is not torch.Tensor and is_dtensor(mine):
            local = mine.to_local()
            if local.data_ptr() == t.data_ptr() and local.shape == t.shape:
                return mine
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(t.to(local.device), mine.device_mesh, mine.placements, run_check=False,
                                      shape=mine.shape, stride=mine.stride())
        if tm.dtensor is not None and any_mesh is not None:
            from torch.distributed.tensor import DTensor

            placements, shape, stride = tm.dtensor
            return DTensor.from_local(t, any_mesh, placements, run_check=False, shape=torch.Size(shape),
                                      stride=stride)
        return t

    count = 0

    def walk(node: Any) -> Any:
        nonlocal count
        if node is _TENSOR:
            count += 1
            if count > len(tensors):
                raise ValueError(f"state description holds more tensors than the {len(tensors)} given")
            return restore(count - 1)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if _is_plain_tuple(node):
            return tuple(walk(v) for v in node)
        return node

    state = walk(meta.skeleton)
    if count != len(tensors):
        raise ValueError(f"state description holds {count} tensors but {len(tensors)} were given")
    return state


def own_tensors(into: Any) -> dict[str, torch.Tensor]:
    """The receiver's own tensors by path (local shards for DTensors): where a received tensor can land."""
    return {path: local_view(t) for path, t in _tensors_by_path(into).items()} if into is not None else {}


def _own_targets(metas: list[TensorMeta], own: list[torch.Tensor], device: torch.device,
                 packed_below: int) -> list[torch.Tensor]:
    """`_targets` for a donor whose tensors are described as ours, worked out before its description arrives:
    each own tensor that can receive in place, else a fresh buffer."""
    return [t if _serves(t, m, device, True, packed_below) else torch.empty(m.shape, dtype=m.dtype, device=device)
            for m, t in zip(metas, own)]


def _addresses(targets: list[torch.Tensor], device: torch.device) -> list[int]:
    """Each target's address where a run's bytes can land in it directly (on `device`, contiguous), else -1."""
    return [t.data_ptr() if t.device == device and t.is_contiguous() else -1 for t in targets]


def _serves(t: torch.Tensor, m: TensorMeta, device: torch.device, same_device: bool, packed_below: int) -> bool:
    """Whether the healer's own tensor `t` can receive `m` in place (see `_targets`)."""
    return t.is_contiguous() and (not same_device or t.device == device or 0 < m.nbytes < packed_below)


def _targets(
    meta: StateMeta | Layout, existing: dict[str, torch.Tensor], device: torch.device, same_device: bool = False,
    packed_below: int = 0,
) -> list[torch.Tensor]:
    """Receive buffers: the healer's own tensors (`existing`, from `own_tensors`) where path/shape/dtype
    match (in place), else new ones.

    With `same_device`, an own tensor is used only if it lives on `device`: NCCL can only receive into GPU
    memory, and a trainer keeps some state on the host (AdamW's `step` counters are CPU tensors). Those get
    a fresh buffer on `device`, which the trainer's `load_state_dict` copies into its own tensor. Tensors
    under `packed_below` bytes arrive packed and are copied out of the pack, so their own tensor serves
    wherever it lives.
    """
    out = []
    for m in meta.tensors:
        t = existing.get(m.path)
        if (t is not None and tuple(t.shape) == m.shape and t.dtype == m.dtype
                and _serves(t, m, device, same_device, packed_below)):
            out.append(t.detach() if t.requires_grad else t)
        else:
            out.append(torch.empty(m.shape, dtype=m.dtype, device=device))
    return out


def adjacent_runs(indices: list[int], tensors: list[torch.Tensor], device: torch.device,
                  max_bytes: int, nbytes: list[int] | None = None) -> list[list[int]]:
    """Group the tensors into runs that follow each other in one storage on `device` (at most `max_bytes`
    a run, in memory order within it): each run travels as one message. A tensor elsewhere travels alone.
    Runs are ordered by their first tensor's index, not by address, so two processes that allocated the
    same buffers at different addresses agree on the runs."""
    if nbytes is None:
        nbytes = [t.numel() * t.element_size() for t in tensors]
    movable = [(t.data_ptr(), nbytes[i], i) for i, t in ((i, tensors[i]) for i in indices)
               if t.device == device and t.is_contiguous()]
    kept = {i for _, _, i in movable}
    alone = [[i] for i in indices if i not in kept]
    movable.sort()
    runs: list[list[int]] = []
    size = end = limit = 0
    for start, nbytes, i in movable:
        # Consecutive addresses inside the run's first storage: the same allocation, no gap between.
        if runs and start == end and start + nbytes <= limit and size + nbytes <= max_bytes:
            runs[-1].append(i)
            size += nbytes
        else:
            runs.append([i])
            storage = tensors[i].untyped_storage()
            limit, size = storage.data_ptr() + storage.nbytes(), nbytes
        end = start + nbytes
    return sorted(runs + alone, key=lambda run: run[0])


@dataclass
class Layout:
    """How a state travels over the replicated group: its tensors, the small ones that lie apart packed into
    one message per home device, the rest one message per run of adjacent tensors.

    `digest` covers the tensor descriptions: a healer whose tensors are described like the donor's (the
    usual case: same model, same rank layout) prepares its receive targets before the donor's description
    arrives and never decodes it. Packs and runs are plain index lists, cheap to decode and check."""

    tensors: list[TensorMeta]
    packs: list[list[int]]
    runs: list[list[int]]
    digest: bytes = b""

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = tensors_digest(self.tensors)


def tensors_digest(metas: list[TensorMeta]) -> bytes:
    """A digest equal in two processes exactly when their tensor descriptions are (hashed by columns, not
    per-tensor text: the healer computes it while the donor describes its state)."""
    h = hashlib.blake2b(digest_size=16)
    if metas:
        paths, shapes, dtypes, nbytes, specs = zip(*metas)
        h.update("\n".join(paths).encode())
        h.update(array("q", map(len, shapes)).tobytes())
        h.update(array("q", itertools.chain.from_iterable(shapes)).tobytes())
        h.update(array("q", nbytes).tobytes())
        h.update(repr((dtypes, specs)).encode())
    return h.digest()


def describe_layout(metas: list[TensorMeta], tensors: list[torch.Tensor], device: torch.device,
                    packed_below: int, max_bytes: int) -> Layout:
    """Runs of tensors adjacent in memory travel as one message each (a norm weight between two matrices rides
    along); what is left alone and small is packed, one pack per device it lives on (in practice the GPU's,
    and the host's AdamW step counters)."""
    sizes = [m.nbytes for m in metas]
    runs = adjacent_runs([i for i, n in enumerate(sizes) if n > 0], tensors, device, max_bytes, sizes)
    by_home: dict[str, list[int]] = {}
    for run in runs:
        if len(run) == 1 and sizes[run[0]] < packed_below:
            by_home.setdefault(str(tensors[run[0]].device), []).append(run[0])
    big = [run for run in runs if len(run) > 1 or sizes[run[0]] >= packed_below]
    return Layout(metas, list(by_home.values()), big)


def _pack(indices: list[int], tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate the tensors' bytes where they live (one kernel, or one host copy), then move the result
    to `device` once: a copy per tiny host tensor would cost a synchronizing transfer each."""
    home = tensors[indices[0]].device
    packed = torch.cat([_as_bytes(tensors[i].contiguous()) for i in indices])
    return packed if home == device else packed.to(device)


def _unpack(pack: torch.Tensor, indices: list[int], metas: list[TensorMeta], targets: list[torch.Tensor]) -> None:
    """Copy each tensor out of a received pack (one multi-tensor copy per target device); targets on
    another device (host-resident optimizer counters) are served from one copy of the pack there."""
    copies: dict[torch.device, torch.Tensor] = {pack.device: pack}
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    offset = 0
    for i in indices:
        n = metas[i].nbytes
        target = targets[i]
        if target.device not in copies:
            copies[target.device] = pack.to(target.device)
        # A heal runs while the healer's own step is in flight (its result is discarded). Write through
        # `.data`, like the collective's raw receive does, so autograd's version counters of live
        # parameters are not bumped under a running backward.
        dsts, srcs = by_device.setdefault(target.device, ([], []))
        dsts.append(_as_bytes(target.data))
        srcs.append(copies[target.device][offset:offset + n])
        offset += n
    for dsts, srcs in by_device.values():
        torch._foreach_copy_(dsts, srcs)


def _receivable_in_place(run: list[int], targets: list[torch.Tensor], addresses: list[int],
                         sizes: list[int]) -> bool:
    """A run lands straight in the healer's tensors if they too are one byte range on the device (addresses
    from `_addresses`: -1 where a target cannot take bytes directly)."""
    return addresses[run[0]] >= 0 and spans_one_range(targets[run[0]], [addresses[i] for i in run],
                                                      [sizes[i] for i in run])


def _check_layout(packs: Any, runs: Any, metas: list[TensorMeta]) -> None:
    """A peer's packs and runs name every non-empty tensor exactly once (so no message is sized or placed by
    an index the healer did not check)."""
    sizes = [m.nbytes for m in metas]
    seen: set[int] = set()
    wire.check_index_lists(packs, "wire layout (packs)", sizes, seen)
    wire.check_index_lists(runs, "wire layout (runs)", sizes, seen)
    if len(seen) != sum(1 for n in sizes if n):
        raise WireFormatError(f"wire layout covers {len(seen)} of the {sum(1 for n in sizes if n)} non-empty tensors")


def _check_against_own(metas: list[TensorMeta], existing: dict[str, torch.Tensor]) -> None:
    """Before receiving: a tensor this process already holds at a path must arrive with its shape and dtype
    (a donor's state for another model or rank layout is refused, not allocated and half-loaded)."""
    for m in metas:
        t = existing.get(m.path)
        if t is not None and (tuple(t.shape) != m.shape or t.dtype != m.dtype):
            raise WireFormatError(
                f"donor's tensor {m.path} is {m.dtype} {list(m.shape)}, this replica's is {t.dtype} {list(t.shape)}: "
                "refusing the transfer (do the replicas run the same model, dtypes and ranks per replica?)"
            )


def _decode_state(blob: bytes | bytearray | memoryview, max_bytes: int) -> tuple[Any, Any, Any, int]:
    """A peer's [structure, packs, runs] (GroupTransport) and the number of tensor places in the structure."""
    data = wire.loads(blob, "state structure", max_bytes)
    if type(data) is not list or len(data) != 3:
        raise WireFormatError("state structure must be [skeleton, packs, runs]")
    skeleton, leaves = wire.decode_tree(data[0], _TENSOR)
    return skeleton, data[1], data[2], leaves


# GroupTransport's header: step, length of the encoded (skeleton, packs, runs), length of the encoded tensor
# descriptions, their digest.
_FRAME = struct.Struct("<qqq16s")


def _header(step: int, state_blob: bytes, layout: Layout, metas_blob: bytes,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first message (`_FRAME`, then as much of both blobs as fits in `HEADER_BYTES`) and the rest, if
    any: one fixed-size message describes a typical state, saving a round trip per heal."""
    framed = _FRAME.pack(step, len(state_blob), len(metas_blob), layout.digest) + state_blob + metas_blob
    head = bytearray(framed[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0"))
    rest = framed[HEADER_BYTES:]
    return (torch.frombuffer(head, dtype=torch.uint8).to(device),
            torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(device) if rest else None)


class _SentLayout(NamedTuple):
    """What a donor keeps of its last send (`GroupTransport._layout`)."""

    addresses: list[int]
    device: str
    layout: Layout
    storages: list[tuple[int, int]]  # (address, size) of the storage of each run's first tensor
    metas_blob: bytes  # the encoded tensor descriptions


def _run_storages(layout: Layout, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(st.data_ptr(), st.nbytes()) for st in (tensors[run[0]].untyped_storage() for run in layout.runs)]


def _span(tensors: list[torch.Tensor], run: list[int], metas: list[TensorMeta]) -> torch.Tensor:
    """The bytes of a run of adjacent tensors (one tensor: its own bytes), sharing their memory. Autograd
    never sees it: a heal may write into live parameters."""
    first = tensors[run[0]]
    return _as_bytes(first.data) if len(run) == 1 else byte_span([first], sum(metas[i].nbytes for i in run))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (shares memory)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


_DIGEST_ROW = 1024  # 32-bit words per row of `device_digest`


def device_digest(b: torch.Tensor) -> torch.Tensor:
    """Four int64 checksums of a uint8 tensor, computed where it lives (GPU: no host copy, two reads of it):
    the total of its 32-bit words, their row sums weighted by row number, their column sums weighted by
    column number (rows of `_DIGEST_ROW` words), and the weighted tail bytes with the length. A changed word
    changes the total; two words swapped change a weighted sum unless they are equal. For corruption on the
    way (the group transport's counterpart of `wire.tensor_digest`), not forgery; int64 sums wrap."""
    if b.storage_offset() % 4:
        b = b.clone()  # a view that starts off a 4-byte boundary cannot be read as 32-bit words
    n = b.numel()
    rows = n // (4 * _DIGEST_ROW)
    out = torch.zeros(4, dtype=torch.int64, device=b.device)
    if rows:
        m = b[:rows * 4 * _DIGEST_ROW].view(torch.int32).view(rows, _DIGEST_ROW)
        row = m.sum(dim=1, dtype=torch.int64)
        col = m.sum(dim=0, dtype=torch.int64)
        out[0] = row.sum()
        out[1] = (row * torch.arange(1, rows + 1, dtype=torch.int64, device=b.device)).sum()
        out[2] = (col * torch.arange(1, _DIGEST_ROW + 1, dtype=torch.int64, device=b.device)).sum()
    tail = b[rows * 4 * _DIGEST_ROW:].to(torch.int64)
    weights = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=b.device)
    out[3] = (tail * weights).sum() + n
    return out


def _digests(messages: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The `device_digest` of every message, as one [n, 4] int64 tensor on `device` (sent after them)."""
    if not messages:
        return torch.zeros((0, 4), dtype=torch.int64, device=device)
    return torch.stack([device_digest(m.to(device) if m.device != device else m) for m in messages])


class CheckpointTransport(Protocol):
    def metadata(self) -> str: ...

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: float) -> None: ...

    def disallow_checkpoint(self) -> None: ...

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: float, into: Any = None
    ) -> Any: ...

    def shutdown(self) -> None: ...


# ---- over the replicated group --------------------------------------------------------------------------


class GroupTransport:
    """Send/recv over the replicated group (ranks are replica ranks of the current quorum).

    Wire order per healer: a `HEADER_BYTES` message with the step, the state structure and wire layout, and
    the tensor descriptions with their digest (both JSON, `regent.ft.wire`) (the rest, for a very large description,
    in a second message), then one message per home device of the small tensors that lie apart, packed back
    to back (on CPU, AdamW's step counters: hundreds of tiny messages would each cost a NCCL launch, more
    than their bytes), then the
    larger tensors without a copy: one message per run of tensors that lie back to back in the donor's
    memory (`regent.contiguous`; up to `max_message_bytes`), else one per tensor. A healer with the same
    layout receives each run straight into its own tensors; one with another layout stages that run and
    copies it out. No host round-trip between messages. The receiver checks the step before receiving any
    tensor and refuses a stale one. A healer whose tensors are described like the donor's (equal digests)
    has its receive targets ready before the header arrives.
    """

    def __init__(self, group: Any, packed_below: int = PACKED_BELOW_BYTES,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self._group = group
        self.packed_below = packed_below
        self.max_message_bytes = max_message_bytes
        self.max_header_bytes = max_header_bytes  # largest state description accepted from a donor
        self.last_messages = 0  # tensor messages of the last send (packs and runs), for reports
        self.last_timing: dict[str, float] = {}  # phases of the last send or receive, seconds
        self.last_described_alike = False  # whether the last receive found the donor's tensors described as its own
        self._sent: _SentLayout | None = None  # donor: the layout of the last send, while its buffers stay put

    def metadata(self) -> str:
        return "<group>"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: float) -> None:
        start = time.perf_counter()
        meta, tensors = flatten_state(state_dict, step)
        device = self._group.device
        layout, metas_blob = self._layout(meta.tensors, tensors, device)
        state_blob = wire.dumps([wire.encode_tree(meta.skeleton, _TENSOR), layout.packs, layout.runs])
        header, rest = _header(step, state_blob, layout, metas_blob, device)
        described = time.perf_counter()
        packs: list[torch.Tensor] = []
        digests: torch.Tensor | None = None
        # Every message to a healer goes on one build of the communicator, posted even if the group is aborted
        # midway: a healer that got the header receives the state into its own tensors and cannot give that
        # receive up (a late write would land in them), so the state must follow the header. Without this, a
        # donor aborted between the two (a third replica died) left its healer waiting out the whole timeout
        # while the others waited for it at the Lighthouse (15 s stalls, caught with stacks in a session-19 soak).
        pinned = self._group.pin()
        failed: Exception | None = None

        def post(send: Callable[..., None], *args: Any, **kwargs: Any) -> None:
            # Abortable (`ReplicatedGroup.send`): a donor told that its group failed leaves at once, after posting
            # to every healer. What it abandons may still be read from the state after it moves on; the healer's
            # digest check refuses that.
            nonlocal failed
            try:
                send(*args, abortable=True, pinned=pinned, **kwargs)
            except Exception as err:  # noqa: BLE001 - raised below, once everything is posted
                failed = failed or err

        for dst in dst_ranks:
            post(self._group.send, [header], dst, tag=1)
            if rest is not None:
                post(self._group.send, [rest], dst, tag=2)
            # Packed after the first healer has the metadata: it sets up its receive meanwhile.
            packs = packs or [_pack(indices, tensors, device) for indices in layout.packs]
            messages = packs + [_span(tensors, run, layout.tensors) if len(run) > 1
                                else _as_bytes(_on_device(tensors[run[0]], device)) for run in layout.runs]
            self.last_messages = len(messages)
            # the messages' checksums travel last: the healer compares before it returns anything
            digests = _digests(messages, device) if digests is None else digests
            post(self._group.send_many, [*messages, digests], dst, first_tag=3)
        if failed is not None:
            raise failed
        self.last_timing = {"describe": described - start, "send": time.perf_counter() - described}

    def _layout(self, metas: list[TensorMeta], tensors: list[torch.Tensor],
                device: torch.device) -> tuple[Layout, bytes]:
        """This donor's layout and its encoded tensor descriptions, kept while the tensors stay where they are:
        a long-lived donor heals many replicas from the same buffers, and describing ~600 tensors costs
        milliseconds a heal."""
        where = [t.data_ptr() for t in tensors]
        sent = self._sent
        # Same addresses, device and descriptions, and the storages that bound each run are still the same
        # allocations (an address can be reused).
        if (sent is not None and sent.addresses == where and sent.device == str(device)
                and sent.layout.tensors == metas and sent.storages == _run_storages(sent.layout, tensors)):
            return sent.layout, sent.metas_blob
        layout = describe_layout(metas, tensors, device, self.packed_below, self.max_message_bytes)
        self._sent = _SentLayout(where, str(device), layout, _run_storages(layout, tensors),
                                 wire.dumps(wire.encode_metas(layout.tensors)))
        return layout, self._sent.metas_blob

    def disallow_checkpoint(self) -> None:
        """Nothing is served between calls: the data moves inside `send_checkpoint`."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: float, into: Any = None) -> Any:
        start = time.perf_counter()
        device = self._group.device
        # While the donor describes its state: describe ours, and where each of our tensors would land if the
        # donor's tensors are described the same.
        own_meta, own, originals = _flatten(into, 0) if into is not None else (None, [], [])
        own_digest = tensors_digest(own_meta.tensors) if own_meta is not None else b""
        own_targets = _own_targets(own_meta.tensors, own, device, self.packed_below) if own_meta else []
        own_addresses = _addresses(own_targets, device)
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
        # Abortable: a fresh buffer, read by nobody after a failure. A healer whose donor was told to abort before
        # sending must not wait out the timeout for it. The state itself (below) is received into this replica's
        # own tensors: that receive is never abandoned, since a late write would land in them.
        self._group.recv([header], src_rank, tag=1, abortable=True)
        head = header.cpu().numpy().tobytes()
        donor_step, state_len, metas_len, digest = _FRAME.unpack_from(head)
        if not (0 <= state_len <= self.max_header_bytes and 0 <= metas_len <= self.max_header_bytes - state_len):
            raise WireFormatError(
                f"donor replica rank {src_rank} announced a state description of {state_len} + {metas_len} bytes; "
                f"accepted: up to {self.max_header_bytes} (GroupTransport(max_header_bytes=...)); nothing loaded"
            )
        blob = head[_FRAME.size:_FRAME.size + state_len + metas_len]
        if _FRAME.size + state_len + metas_len > HEADER_BYTES:  # too large for one header: the rest follows
            rest = torch.empty(_FRAME.size + state_len + metas_len - HEADER_BYTES, dtype=torch.uint8, device=device)
            self._group.recv([rest], src_rank, tag=2, abortable=True)
            blob += rest.cpu().numpy().tobytes()
        if donor_step != step:
            raise RuntimeError(
                f"donor replica rank {src_rank} offered state of step {donor_step}, expected {step}: "
                "refusing a stale checkpoint; the next quorum retries the heal"
            )
        got_meta = time.perf_counter()
        # Checked before any tensor is received: a bad description raises here and nothing is loaded.
        skeleton, packs, runs, leaves = _decode_state(memoryview(blob)[:state_len], self.max_header_bytes)
        same = own_meta is not None and own_digest == digest
        if same:  # same model and rank layout: the usual case, prepared already
            metas = own_meta.tensors
        else:
            metas = wire.decode_metas(wire.loads(memoryview(blob)[state_len:], "tensor descriptions",
                                                 self.max_header_bytes), TensorMeta)
        if leaves != len(metas):
            raise WireFormatError(f"donor's state structure holds {leaves} tensors but describes {len(metas)}")
        _check_layout(packs, runs, metas)
        if same:
            layout, targets, addresses = Layout(metas, packs, runs, digest), own_targets, own_addresses
        else:
            layout = Layout(metas, packs, runs, digest)
            existing = {m.path: t for m, t in zip(own_meta.tensors, own)} if own_meta is not None else {}
            _check_against_own(metas, existing)
            targets = _targets(layout, existing, device, same_device=True, packed_below=self.packed_below)
            addresses = _addresses(targets, device)
        sizes = [m.nbytes for m in layout.tensors]
        # Small tensors arrive packed; a run whose targets are not one byte range here (another layout) is
        # staged in a buffer of its own; both are copied out after the receive.
        in_place = [_receivable_in_place(run, targets, addresses, sizes) for run in layout.runs]
        staged = list(layout.packs) + [run for run, ok in zip(layout.runs, in_place) if not ok]
        buffers = [torch.empty(sum(layout.tensors[i].nbytes for i in indices), dtype=torch.uint8, device=device)
                   for indices in staged]
        by_run = iter(buffers[len(layout.packs):])
        messages = buffers[:len(layout.packs)] + [
            _span(targets, run, layout.tensors) if ok else next(by_run) for run, ok in zip(layout.runs, in_place)
        ]
        posted = time.perf_counter()
        expected = torch.empty((len(messages), 4), dtype=torch.int64, device=device)
        self._group.recv_many([*messages, expected], src_rank, first_tag=3)
        received = time.perf_counter()
        if not torch.equal(_digests(messages, device), expected):
            raise TransferIntegrityError(
                f"the state received from donor replica rank {src_rank} does not match the checksums it sent "
                "(corrupted on the way or at either end); the heal fails and the next quorum retries it")
        for buffer, indices in zip(buffers, staged):
            _unpack(buffer, indices, layout.tensors, targets)
        meta = StateMeta(step=donor_step, skeleton=skeleton, tensors=layout.tensors)
        state = unflatten_state(meta, targets, like=into, like_tensors=originals if same else None)
        self.last_timing = {"metadata": got_meta - start, "targets": posted - got_meta, "data": received - posted,
                            "unpack": time.perf_counter() - received}
        self.last_described_alike = same
        return state

    def shutdown(self) -> None:
        pass


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device and t.is_contiguous() else t.to(device).contiguous()


# ---- TCP streaming fallback ------------------------------------------------------------------------------

_HEADER = struct.Struct("!Q")
# Connection greeting: magic and whether this donor authenticates ("A": the job secret's handshake follows,
# "N": no secret configured). Each side refuses the other mode, so a process with the secret never falls
# back to an unauthenticated peer.
_GREETING = b"RGFT"
_CLIENT_ROLE = b"regent-ft-transfer-client"
_SERVER_ROLE = b"regent-ft-transfer-server"
# A healer's request is a small JSON object.
_MAX_REQUEST_BYTES = 4096
_warned_unauthenticated = False


def _warn_unauthenticated_once() -> None:
    global _warned_unauthenticated
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        logger.warning("peer state transfer over TCP is unauthenticated: no job secret in this process (set "
                       "%s or %s; `regent train` sets it for every trainer)", auth.SECRET_ENV, auth.SECRET_FILE_ENV)


class TransferIntegrityError(WireFormatError):
    """The tensor bytes received from a donor do not match the checksums it sent (corrupted on the way or at
    either end): the transfer fails and nothing of it is returned."""


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_frame(sock: socket.socket, max_bytes: int, what: str) -> bytes:
    """One length-prefixed frame, refused (before allocating) when it announces more than `max_bytes`."""
    (n,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if n > max_bytes:
        raise WireFormatError(f"peer announced a {what} of {n} bytes; accepted: up to {max_bytes}")
    return recv_exact(sock, n)


def _cpu_bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(_as_bytes(t).numpy()).cast("B")


def _encode_served(meta: StateMeta) -> bytes:
    return wire.dumps({"step": meta.step, "skeleton": wire.encode_tree(meta.skeleton, _TENSOR),
                       "tensors": wire.encode_metas(meta.tensors)})


def _decode_served(blob: bytes, max_bytes: int) -> StateMeta:
    data = wire.loads(blob, "state description", max_bytes)
    if type(data) is not dict or type(data.get("step")) is not int:
        raise WireFormatError("state description must be an object with an integer step")
    skeleton, leaves = wire.decode_tree(data.get("skeleton"), _TENSOR)
    metas = wire.decode_metas(data.get("tensors"), TensorMeta)
    if leaves != len(metas):
        raise WireFormatError(f"donor's state structure holds {leaves} tensors but describes {len(metas)}")
    return StateMeta(step=data["step"], skeleton=skeleton, tensors=metas)


ANY_STEP = -1  # a healer's request for whatever step the donor serves (the description request only)
# A live donor (per-step early heal) moves on every step, faster than a state transfer travels: a healer that asks
# for a hold keeps the described state served until its last chunk is sent. Bounded, so that a stopped healer
# holds up the donor's optimizer step for a few seconds at most (the quorum heal stalls a donor as long).
HOLD_IDLE_S = 2.0  # released this long after the healer's last request
HOLD_MAX_S = 30.0  # and at the latest this long after the description was served
MAX_HOLDS = 64  # holds at once; a description asked for beyond that is served without one


@dataclass
class _Hold:
    """A healer's hold on the served state: from its description until every one of its chunks is sent."""

    started: float
    last: float
    of: int = 0  # how many chunks the healer fetches (known from its first chunk request)
    active: int = 0  # chunk requests being answered now
    done: set[int] = field(default_factory=set)

    def finished(self) -> bool:
        return self.of > 0 and len(self.done) >= self.of

    def ends_at(self) -> float:
        """When it is released at the latest: HOLD_MAX_S after it began, or HOLD_IDLE_S after the healer's last
        request while no chunk of it is being sent."""
        end = self.started + HOLD_MAX_S
        return end if self.active else min(end, self.last + HOLD_IDLE_S)


class StreamTransport:
    """Donor-side TCP server + healer-side parallel fetch (the no-group fallback).

    `metadata()` is `tcp://host:port`; the Manager publishes it so healers can find the donor.

    Every connection starts with the job secret's mutual challenge-response (`regent.auth`); `secret`
    defaults to the job secret of this process's environment (`REGENT_JOB_SECRET` / `REGENT_JOB_SECRET_FILE`,
    which `regent train` sets for every trainer). With none, the channel is unauthenticated (logged once).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, num_chunks: int = 4, timeout: float = 60.0,
                 secret: bytes | None = None, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.num_chunks = max(1, num_chunks)
        self.timeout = timeout
        self.max_header_bytes = max_header_bytes  # largest state description accepted from a donor
        self._secret = secret if secret is not None else auth.job_secret_from_env()
        if not self._secret:
            self._secret = None
            _warn_unauthenticated_once()
        self._lock = RWLock()
        self._state_lock = threading.Lock()
        # step, description, staged tensors, encoded description (made on the first request: a donor publishes
        # at every commit and is rarely asked), each tensor's checksum (index -> digest, filled as chunks are served)
        self._serving: list[Any] | None = None
        self._readers: set[socket.socket] = set()  # connections reading the served state now
        self._holds: dict[int, _Hold] = {}  # healers' holds on the served state (see HOLD_IDLE_S)
        self._holds_changed = threading.Condition(self._state_lock)
        self.held_s = 0.0  # total time withdrawals waited for holds (a donor's cost of live early heals)
        self._sock = socket.create_server((host, port), backlog=128)
        self._host = host
        self._port = self._sock.getsockname()[1]
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="regent-ft-serve")
        self._accept_thread = threading.Thread(target=self._accept_loop, name="regent-ft-transfer", daemon=True)
        self._accept_thread.start()

    def metadata(self) -> str:
        return f"tcp://{self._host}:{self._port}"

    # donor side
    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: float,
                        copy_to_host: bool = True, lazy: bool = False) -> None:
        """Stage `state_dict` for `step` and start serving it (accelerator tensors copied to host once).

        `copy_to_host=False`: keep accelerator tensors where they are and copy each to host only when a healer
        asks for it. For state that is served for a long time and rarely fetched (the committed state a donor
        serves between two syncs): no device-to-host copy of the whole state at every sync. Safe because
        `disallow_checkpoint` stops serving before the tensors change.

        `lazy=True` (implies `copy_to_host=False`): keep `state_dict` as given and describe it only when the first
        healer asks. For state published at every step and rarely fetched (per-step early heal): publishing
        costs nothing but this call. The caller must pass a structure of its own (fresh containers; tensors
        stay shared until `disallow_checkpoint`), and a value the wire format cannot carry is reported to the
        healer instead of failing here."""
        if lazy:
            with self._state_lock:
                self._serving = [step, None, None, None, {}, state_dict]
            logger.debug("serving state of step %d (described on request) to %s", step, dst_ranks or "any healer")
            return
        meta, tensors = flatten_state(state_dict, step)
        if copy_to_host:
            staged = [t if t.device.type == "cpu" and t.is_contiguous() else t.to("cpu").contiguous() for t in tensors]
        else:
            staged = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        wire.encode_tree(meta.skeleton, _TENSOR)  # an unsupported value fails here, in the donor's own step
        with self._state_lock:
            self._serving = [step, meta, staged, None, {}]
        logger.info("serving state of step %d (%d tensors) to %s", step, len(staged), dst_ranks or "any healer")

    def disallow_checkpoint(self, cut_readers: bool = False) -> None:
        """Stop serving (the weights are about to change); waits for in-flight reads to finish.

        `cut_readers`: end the in-flight reads now instead (their healers see a broken transfer and ask again
        later). For state withdrawn at every step: a slow or stopped healer must not hold up the donor's
        optimizer step for the transfer timeout."""
        if cut_readers:
            with self._holds_changed:
                self._wait_for_holds()
                self._serving = None
                readers = list(self._readers)
            for conn in readers:
                with contextlib.suppress(OSError):  # already closed by its handler: nothing left to cut
                    conn.shutdown(socket.SHUT_RDWR)
        with self._lock.write(timeout=self.timeout), self._state_lock:
            self._serving = None
            self._holds.clear()  # they were for the state withdrawn now

    def _wait_for_holds(self) -> None:
        """(With `_state_lock` held.) Until every healer's hold on the served state is finished or expired: the
        healer got its whole state, or stopped asking (then its transfer is cut like any other reader's)."""
        start = time.monotonic()
        while self._holds:
            now = time.monotonic()
            for key in [k for k, h in self._holds.items() if h.finished() or h.ends_at() <= now]:
                del self._holds[key]
            if self._holds:
                self._holds_changed.wait(timeout=min(h.ends_at() for h in self._holds.values()) - now)
        waited = time.monotonic() - start
        if waited > 0.001:
            self.held_s += waited
            logger.info("kept serving step %s %.3f s longer for a healer's transfer",
                        self._serving[0] if self._serving else "?", waited)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._pool.submit(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            peer = "?"
            try:
                peer = "%s:%s" % conn.getpeername()[:2]  # noqa: UP031 - IPv4 and IPv6 tuples alike
                conn.settimeout(self.timeout)
                if self._secret is None:
                    conn.sendall(_GREETING + b"N")
                else:
                    conn.sendall(_GREETING + b"A")
                    auth.server_handshake(conn, self._secret, b"", _CLIENT_ROLE, _SERVER_ROLE, peer=peer)
                request = _parse_request(_recv_frame(conn, _MAX_REQUEST_BYTES, "request"))
                if not self._lock.acquire_read(timeout=0):
                    _send_frame(conn, json.dumps({"error": "donor is updating its weights; not serving"}).encode())
                    return
                with self._state_lock:
                    self._readers.add(conn)
                try:
                    self._answer(conn, request)
                finally:
                    with self._state_lock:
                        self._readers.discard(conn)
                    self._lock.release_read()
            except auth.AuthenticationError as err:
                logger.warning("state transfer: %s", err)
            except (OSError, ValueError, ConnectionError) as err:  # WireFormatError is a ValueError
                logger.debug("transfer connection from %s ended: %s", peer, err)

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> None:
        with self._state_lock:
            serving = self._serving
            if serving is not None and serving[1] is None:  # published lazily: described at the first request
                try:
                    meta, tensors = flatten_state(serving[5], serving[0])
                    wire.encode_tree(meta.skeleton, _TENSOR)
                except (TypeError, ValueError) as err:  # reported to the healer, which refuses the state
                    _send_frame(conn, json.dumps({"error": f"donor cannot describe its state: {err}"}).encode())
                    return
                serving[1], serving[2] = meta, [t if t.is_contiguous() else t.contiguous() for t in tensors]
        if serving is None:
            _send_frame(conn, json.dumps({"error": "donor is not serving any state now"}).encode())
            return
        step, meta, tensors, blob, digests = serving[:5]
        if request["step"] != step and not (request["what"] == "meta" and request["step"] == ANY_STEP):
            _send_frame(
                conn,
                json.dumps({"error": f"stale step: donor serves step {step}, requested {request['step']}"})
                .encode(),
            )
            return
        if request["what"] == "meta":
            answer: dict[str, Any] = {"ok": True}
            if request.get("hold"):
                with self._state_lock:
                    # not withdrawn meanwhile: hold it for this healer's chunks (a bounded number of holds at once)
                    if self._serving is serving and len(self._holds) < MAX_HOLDS:
                        key = secrets.randbits(62)
                        now = time.monotonic()
                        self._holds[key] = _Hold(started=now, last=now)
                        answer["hold"] = key
            _send_frame(conn, json.dumps(answer).encode())
            if blob is None:
                blob = serving[3] = _encode_served(meta)
            _send_frame(conn, blob)
            return
        with self._holds_changed:
            hold = self._holds.get(request["hold"]) if "hold" in request else None
            if hold is not None:
                hold.active += 1
                hold.of, hold.last = request["of"], time.monotonic()
        try:
            _send_frame(conn, json.dumps({"ok": True}).encode())
            self._send_chunk(conn, request, tensors, digests)
            if hold is not None:
                hold.done.add(request["chunk"])
        finally:
            if hold is not None:
                with self._holds_changed:
                    hold.active -= 1
                    hold.last = time.monotonic()
                    if hold.finished():
                        self._holds.pop(request["hold"], None)
                    self._holds_changed.notify_all()

    def _send_chunk(self, conn: socket.socket, request: dict[str, Any], tensors: list[torch.Tensor],
                    digests: dict[int, bytes]) -> None:
        chunk, of = request["chunk"], request["of"]
        sums = []
        for i in range(chunk, len(tensors), of):
            if tensors[i].numel():
                t = tensors[i] if tensors[i].device.type == "cpu" else tensors[i].to("cpu")
                view = _cpu_bytes_view(t)
                conn.sendall(view)
                digest = digests.get(i)
                if digest is None:  # the tensors do not change while served (disallow_checkpoint first)
                    digest = digests[i] = wire.tensor_digest(view)
                sums.append(digest)
        conn.sendall(b"".join(sums))

    # healer side
    def _open(self, host: str, port: int, metadata: str, remaining: float) -> socket.socket:
        """A connection to the donor, both ends authenticated (or, with no secret here, neither)."""
        sock = socket.create_connection((host, port), timeout=remaining)
        try:
            greeting = recv_exact(sock, len(_GREETING) + 1)
            if greeting[:len(_GREETING)] != _GREETING:
                raise auth.AuthenticationError(f"{metadata} is not a regent state-transfer donor (bad greeting)")
            mode = greeting[len(_GREETING):]
            if self._secret is not None and mode == b"A":
                auth.client_handshake(sock, self._secret, b"", _CLIENT_ROLE, _SERVER_ROLE, peer=f"donor {metadata}")
            elif self._secret is not None:
                raise auth.AuthenticationError(
                    f"donor {metadata} serves without authentication but this process has the job secret: "
                    "refusing its state (does the donor run without REGENT_JOB_SECRET?)")
            elif mode == b"A":
                raise auth.AuthenticationError(
                    f"donor {metadata} requires the job secret; set {auth.SECRET_ENV} (or {auth.SECRET_FILE_ENV}) "
                    "in this process")
        except BaseException:
            sock.close()
            raise
        return sock

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: float, into: Any = None) -> Any:
        """Fetch the donor's state of `step` from `metadata` ('tcp://host:port') into `into`'s tensors.

        `step=ANY_STEP`: the state the donor serves now, whatever its step (a donor that publishes at every
        commit moves on while a healer connects); the chunks are still all of the step its description names.

        Raises `regent.auth.AuthenticationError` when the donor does not know the job secret and
        `regent.ft.wire.WireFormatError` on a bad state description; both before anything is loaded.
        Raises `TransferIntegrityError` when tensor bytes arrive other than the donor sent them (a checksum per
        tensor): nothing is returned, though tensors of `into` received in place may hold part of them."""
        host, port = _parse_tcp(metadata)
        deadline = time.monotonic() + timeout

        answers: dict[str, Any] = {}

        def connect(request: dict[str, Any]) -> socket.socket:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"state transfer from {metadata} timed out after {timeout:.3g} s")
            sock = self._open(host, port, metadata, remaining)
            try:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                _send_frame(sock, json.dumps(request).encode())
                answer = wire.loads(_recv_frame(sock, _MAX_REQUEST_BYTES, "answer"), "answer", _MAX_REQUEST_BYTES)
                if type(answer) is not dict:
                    raise WireFormatError(f"donor {metadata} answered {answer!r}")
                if "error" in answer:
                    raise RuntimeError(f"donor {metadata} refused the transfer: {answer['error']}")
                if request["what"] == "meta" and type(answer.get("hold")) is int:
                    answers["hold"] = answer["hold"]
            except BaseException:
                sock.close()
                raise
            return sock

        try:
            # a donor that moves on at every step (ANY_STEP) is asked to hold the state it describes until our
            # last chunk is sent (see HOLD_IDLE_S); one that publishes per commit keeps it for a whole round
            with connect({"what": "meta", "step": step, **({"hold": True} if step == ANY_STEP else {})}) as sock:
                meta = _decode_served(_recv_frame(sock, self.max_header_bytes, "state description"),
                                      self.max_header_bytes)
            if step == ANY_STEP:
                step = meta.step  # whatever the donor serves now; every chunk must then be of that same step
            elif meta.step != step:
                raise WireFormatError(f"donor {metadata} described step {meta.step} when asked for {step}")
            own = own_tensors(into)
            _check_against_own(meta.tensors, own)
            targets = _targets(meta, own, torch.device("cpu"))
            # Receive into host buffers; accelerator targets get a host staging copy.
            host_bufs = [t if t.device.type == "cpu" else torch.empty_like(t, device="cpu") for t in targets]
            n = min(self.num_chunks, max(1, len(targets)))

            def fetch(chunk: int) -> None:
                request = {"what": "chunk", "step": step, "chunk": chunk, "of": n}
                if "hold" in answers:
                    request["hold"] = answers["hold"]
                with connect(request) as sock:
                    mine = [i for i in range(chunk, len(host_bufs), n) if host_bufs[i].numel()]
                    got = []
                    for i in mine:
                        view = _cpu_bytes_view(host_bufs[i])
                        recv_into(sock, view)
                        got.append(wire.tensor_digest(view))
                    sent = recv_exact(sock, wire.DIGEST_BYTES * len(mine))
                    for k, (i, digest) in enumerate(zip(mine, got)):
                        theirs = sent[k * wire.DIGEST_BYTES:(k + 1) * wire.DIGEST_BYTES]
                        if digest != theirs:
                            raise TransferIntegrityError(
                                f"tensor {meta.tensors[i].path!r} from donor {metadata} arrived corrupted "
                                f"(checksum {digest.hex()}, donor sent {theirs.hex()}); the transfer is refused")

            with ThreadPoolExecutor(max_workers=n) as pool:
                for f in [pool.submit(fetch, c) for c in range(n)]:
                    f.result()
        except TimeoutError as err:
            raise TimeoutError(f"state transfer from {metadata} timed out after {timeout:.3g} s") from err
        out = []
        for t, h in zip(targets, host_bufs):
            if h is not t:
                t.copy_(h)
            out.append(t)
        return unflatten_state(meta, out, like=into)

    def shutdown(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _parse_request(frame: bytes) -> dict[str, Any]:
    """A healer's request: {"what": "meta", "step": S} or {"what": "chunk", "step": S, "chunk": C, "of": N}."""
    request = wire.loads(frame, "request", _MAX_REQUEST_BYTES)
    if type(request) is not dict or request.get("what") not in ("meta", "chunk") or type(request.get("step")) is not int:
        raise WireFormatError(f"bad transfer request {request!r}")
    if request["what"] == "chunk":
        chunk, of = request.get("chunk"), request.get("of")
        if type(chunk) is not int or type(of) is not int or not 0 <= chunk < of:
            raise WireFormatError(f"bad transfer request {request!r}")
        if "hold" in request and (type(request["hold"]) is not int or not 0 <= request["hold"] < 2 ** 62):
            raise WireFormatError(f"bad transfer request {request!r}")
    elif "hold" in request and type(request["hold"]) is not bool:
        raise WireFormatError(f"bad transfer request {request!r}")
    return request


def _parse_tcp(metadata: str) -> tuple[str, int]:
    addr = metadata.removeprefix("tcp://")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad transfer address {metadata!r}; expected tcp://host:port")
    return host.strip("[]"), int(port)
