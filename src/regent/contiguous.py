"""Tensors laid out back to back in one buffer per (device, dtype).

Why: a peer heal moves every parameter and optimizer moment. Sent one tensor per message, a 1.5 B-parameter
state is ~350 NCCL messages and each costs tens of microseconds of fixed latency; tensors that sit back to
back in memory go as one message (`regent.ft.transfer` merges adjacent tensors). Megatron keeps contiguous
parameter and gradient buffers for the same reason. Used by the Trainer (unsharded replicas; FSDP2 owns its
shards' storage) and by DiLoCo's copy of the global parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Each tensor starts on a 16-byte boundary (vectorized kernels such as fused AdamW want it); every shape
# whose byte size is a multiple of 16 therefore leaves no gap, and neighbours stay mergeable.
ALIGN_BYTES = 16


def _layout(tensors: list[torch.Tensor], device: torch.device | None,
            align_bytes: int) -> dict[tuple[torch.device, torch.dtype], list[tuple[int, int]]]:
    """Per (device, dtype): (tensor index, element offset) in input order."""
    plan: dict[tuple[torch.device, torch.dtype], list[tuple[int, int]]] = {}
    ends: dict[tuple[torch.device, torch.dtype], int] = {}
    for i, t in enumerate(tensors):
        key = (device or t.device, t.dtype)
        align = max(1, align_bytes // t.element_size())
        start = -(-ends.get(key, 0) // align) * align
        plan.setdefault(key, []).append((i, start))
        ends[key] = start + t.numel()
    return plan


def contiguous_empty_like(tensors: list[torch.Tensor], zero: bool = True, device: torch.device | None = None,
                          align_bytes: int = ALIGN_BYTES) -> list[torch.Tensor]:
    """New tensors shaped like `tensors` (on `device` if given), carved out of one buffer per (device,
    dtype), in order, each starting on an `align_bytes` boundary."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for (home, dtype), slots in _layout(tensors, device, align_bytes).items():
        total = max(start + tensors[i].numel() for i, start in slots)
        flat = (torch.zeros if zero else torch.empty)(total, dtype=dtype, device=home)
        for i, start in slots:
            out[i] = flat[start:start + tensors[i].numel()].view(tensors[i].shape)
    return out  # type: ignore[return-value]


@torch.no_grad()
def make_contiguous(params: list[torch.Tensor]) -> None:
    """Move the parameters' data into shared buffers, in place (values kept; the Parameter objects, and
    anything holding them, are unchanged). Call before an optimizer creates state for them."""
    if any(is_distributed(p) for p in params):
        raise ValueError("make_contiguous is for plain tensors; FSDP2 (DTensor) parameters own their storage")
    views = contiguous_empty_like(params, zero=False)
    for p, view in zip(params, views):
        view.copy_(p.data)
        p.data = view


def is_distributed(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2 shard): its storage is not ours to lay out."""
    return callable(getattr(t, "to_local", None))


@torch.no_grad()
def contiguous_copy(tensors: list[torch.Tensor], device: torch.device | None = None) -> list[torch.Tensor]:
    """Copies of `tensors` (on `device` if given) in one buffer per (device, dtype); DTensors are copied
    one by one, as `Tensor.to(copy=True)` does."""
    if any(is_distributed(t) for t in tensors):
        return [t.detach().to(device or t.device, copy=True) for t in tensors]
    out = contiguous_empty_like(tensors, zero=False, device=device)
    for dst, src in zip(out, tensors):
        dst.copy_(src.detach())
    return out


def is_contiguous_run(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors follow each other in one storage with no gap (one byte range covers them)."""
    if not tensors or not all(t.is_contiguous() for t in tensors):
        return False
    return spans_one_range(tensors[0], [t.data_ptr() for t in tensors],
                           [t.numel() * t.element_size() for t in tensors])


def spans_one_range(first: torch.Tensor, addresses: Iterable[int], sizes: Iterable[int]) -> bool:
    """Whether byte ranges (address, size), in order, follow each other with no gap inside `first`'s storage
    (`first` is the tensor at the first address).

    Consecutive addresses that all lie inside the first tensor's storage are that storage's bytes (live
    allocations never overlap), so one storage lookup serves the whole run."""
    end = first.data_ptr()
    for address, size in zip(addresses, sizes):
        if address != end:
            return False
        end += size
    storage = first.untyped_storage()
    return end <= storage.data_ptr() + storage.nbytes()


def byte_span(tensors: list[torch.Tensor], nbytes: int | None = None) -> torch.Tensor:
    """One uint8 tensor over the bytes of a contiguous run (shares memory with them). `nbytes`: the run's
    size when the caller knows it already (only the first tensor is looked at then)."""
    first = tensors[0]
    storage = first.untyped_storage()
    offset = first.data_ptr() - storage.data_ptr()
    if nbytes is None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
    span = torch.empty(0, dtype=torch.uint8, device=first.device)
    span.set_(storage, offset, (nbytes,))
    return span
