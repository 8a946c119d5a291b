"""Serialization of user objects: cloudpickle, protocol 5, with large buffers carried out of band.

Out-of-band buffers are written to the socket as they are and read straight into buffers of their own on the
other side, so a 100 MB array is not copied into the pickle stream. NumPy arrays do this by themselves
(protocol-5 `PickleBuffer`); CPU torch tensors do not (torch pickles storages through `torch.save`), so a
reducer here turns a dense CPU tensor into a raw byte buffer plus dtype and shape. torch is never imported
by this module: tensors are recognised only when the user's program already imported torch.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
from typing import Any

import cloudpickle

# Buffers smaller than this stay inside the pickle stream (one write, one read: cheaper for small data).
OUT_OF_BAND_MIN_BYTES = 64 * 1024


def _rebuild_tensor(buf: Any, dtype_name: str, shape: tuple, requires_grad: bool, is_param: bool) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    raw = memoryview(buf).cast("B")
    if raw.nbytes == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        if raw.readonly:
            raw = memoryview(bytearray(raw))
        tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _tensor_reduction(obj: Any) -> tuple | None:
    """Reduce a dense CPU tensor to (raw bytes buffer, dtype, shape), or None to let torch pickle it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cls = type(obj)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        return None
    try:
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized:
            return None
        if obj.grad_fn is not None:
            return None
        flat = obj.detach().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.element_size() != 1 or flat.dtype != torch.uint8 else flat
        array = raw.numpy()
    except Exception:  # noqa: BLE001 - any exotic tensor falls back to torch's own pickling
        return None
    dtype_name = str(obj.dtype).split(".", 1)[1]
    return (
        _rebuild_tensor,
        (pickle.PickleBuffer(array), dtype_name, tuple(obj.shape), bool(obj.requires_grad), cls is not torch.Tensor),
    )


_tables: dict[int, dict] = {}


def _reduce_tensor(obj: Any) -> Any:
    reduction = _tensor_reduction(obj)
    return reduction if reduction is not None else obj.__reduce_ex__(5)


def _dispatch_table(torch: Any) -> dict:
    table = _tables.get(id(torch))
    if table is None:
        table = dict(copyreg.dispatch_table)
        table[torch.Tensor] = _reduce_tensor
        table[torch.nn.Parameter] = _reduce_tensor
        _tables[id(torch)] = table
    return table


class _ThreadPickler(threading.local):
    """One C pickler with the tensor dispatch table per thread, reused: building a Pickler, its stream and its
    table for every message cost several times the pickling of a small call."""

    def __init__(self) -> None:
        self.stream = io.BytesIO()
        self.pickler: pickle.Pickler | None = None
        self.torch: Any = None
        self.keep: Any = None
        self.busy = False

    def on_buffer(self, buffer: pickle.PickleBuffer) -> bool:
        return self.keep(buffer)


_thread_pickler = _ThreadPickler()


def _tensor_pickler(stream: io.BytesIO, torch: Any, buffer_callback: Any) -> pickle.Pickler:
    """The C pickler, protocol 5, with CPU tensors sent out of band."""
    pickler = pickle.Pickler(stream, protocol=5, buffer_callback=buffer_callback)
    pickler.dispatch_table = _dispatch_table(torch)
    return pickler


def _with_tensor_table(obj: Any, torch: Any, keep: Any) -> bytes:
    state = _thread_pickler
    if state.busy:  # pickling from inside a pickling on this thread (a __reduce__ that sends): a fresh one
        stream = io.BytesIO()
        _tensor_pickler(stream, torch, keep).dump(obj)
        return stream.getvalue()
    if state.pickler is None or state.torch is not torch:
        state.pickler = _tensor_pickler(state.stream, torch, state.on_buffer)
        state.torch = torch
    state.busy, state.keep = True, keep
    try:
        state.pickler.dump(obj)
        return state.stream.getvalue()
    finally:
        state.pickler.clear_memo()  # drop the references to this message's objects now
        state.stream.seek(0)
        state.stream.truncate()
        state.busy, state.keep = False, None


class _Pickler(cloudpickle.Pickler):
    """cloudpickle (functions and classes by value when needed) plus out-of-band CPU tensors."""

    def reducer_override(self, obj: Any) -> Any:
        reduction = _tensor_reduction(obj)
        if reduction is not None:
            return reduction
        return super().reducer_override(obj)


# Results of these exact types pickle the same with any pickler and carry no buffers: the C pickler alone, with
# no buffer callback and no check for references into __main__ (most endpoints return one of these).
_PLAIN_TYPES = frozenset({int, float, bool, str, type(None)})


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle `obj`; returns the pickle stream and the out-of-band buffers (as flat byte memoryviews)."""
    if type(obj) in _PLAIN_TYPES:
        return pickle.dumps(obj, 5), []
    buffers: list[memoryview] = []

    def keep(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < OUT_OF_BAND_MIN_BYTES:
            return True  # in band
        buffers.append(view)
        return False

    # Fast path: the C pickler (several times cheaper than cloudpickle per call). Anything it would get
    # wrong goes the slow way: objects it cannot pickle by reference (lambdas, local classes) raise, and
    # references into __main__ (which the receiver does not have) are spotted in the output. Once torch
    # is imported, a dispatch table sends tensors out of band (looked up by exact type, in C).
    try:
        torch = sys.modules.get("torch")
        if torch is None:
            data = pickle.dumps(obj, 5, buffer_callback=keep)
        else:
            data = _with_tensor_table(obj, torch, keep)
        if b"__main__" not in data:
            return data, buffers
    except Exception:  # noqa: BLE001 - any failure: let cloudpickle try (it raises a clear error)
        pass
    buffers.clear()
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=keep).dump(obj)
    return stream.getvalue(), buffers


def loads(data: bytes | bytearray | memoryview, buffers: list[Any] = ()) -> Any:
    return pickle.loads(data, buffers=buffers) if buffers else pickle.loads(data)


def dumps_inband(obj: Any) -> bytes:
    """Pickle with every buffer in band (for places that store one bytes object)."""
    return cloudpickle.dumps(obj, protocol=5)


# Pickles of the commonest call arguments and result, made once: a no-argument call to many actors unpickles its
# arguments once per actor, and every endpoint that returns nothing pickled None once per reply.
NONE_BODY = pickle.dumps(None, 5)
_EMPTY_CALL_BODY = pickle.dumps(((), {}), 5)


def loads_call(body: Any, buffers: list) -> tuple[tuple, dict]:
    """An endpoint's (args, kwargs); a fresh empty pair without unpickling for a call with no arguments."""
    if not buffers and len(body) == len(_EMPTY_CALL_BODY) and body == _EMPTY_CALL_BODY:
        return (), {}
    return loads(body, buffers)
