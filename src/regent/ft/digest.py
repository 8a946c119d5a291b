"""A digest of a replica's whole training state, computed where the tensors live.

Replicas that committed the same steps must hold bit-identical state; a faulty device can change a bit and go
on training, and in per-step mode the all-reduce then keeps everyone's parameters moving together while the
flipped replica stays different for good. Comparing digests finds it. The digest must therefore cover
everything the replicas agree on (parameters, optimizer state, schedule, data position, step), be cheap enough
to take every few commits, and never copy the model to the host.

How: each tensor's bits are read as unsigned integers x_i and reduced on its device to two 64-bit sums,
sum(x_i * w_i) mod 2^64 with odd weights w_i that depend on the position. A single flipped bit b changes the
first sum by +-2^b * w_i, which is never 0 mod 2^64 because w_i is odd: every single-bit change is found, and
integer sums wrap the same way in any reduction order, so the result is deterministic on any device. Only the
two sums per tensor (16 bytes) reach the host, where they are hashed with the tree's structure, dtypes,
shapes and the non-tensor leaves (sha256).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

CHUNK = 1 << 22  # elements reduced at once: bounds the int64 temporaries (32 MB each)
_A1, _B1 = 0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019  # odd multipliers (as signed int64)
_A2, _B2 = 0xC2B2AE3D27D4EB4F - (1 << 64), 0x165667B19E3779F9
_MASKS = {4: 0xFFFFFFFF, 2: 0xFFFF}
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _chunk_weights(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Odd weights for positions 0..n-1 of a chunk, cached per device (the largest chunk is CHUNK)."""
    key = (str(device), CHUNK)
    if key not in _weights:
        i = torch.arange(CHUNK, dtype=torch.int64, device=device)
        _weights[key] = ((i * _A1 + _B1) | 1, (i * _A2 + _B2) | 1)
    w1, w2 = _weights[key]
    return w1[:n], w2[:n]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharded replicas digest per rank), the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of `t`'s bits, on `t`'s device (no copy to the host)."""
    t = _local(t.detach())
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    # complex128 (16 bytes) and wider: their bytes as 64-bit words
    words = flat.view(_INT_VIEW[size]) if size in _INT_VIEW else flat.view(torch.int64)
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    n = words.numel()
    for c, start in enumerate(range(0, n, CHUNK)):
        x = words[start:start + CHUNK].to(torch.int64)
        mask = _MASKS.get(words.element_size())
        if mask is not None:
            x = x & mask  # the bits as an unsigned number
        w1, w2 = _chunk_weights(flat.device, x.numel())
        s = torch.stack(((x * w1).sum(), (x * w2).sum()))
        out += s * _signed(((c * _A2 + _B1) | 1) % (1 << 64))  # an odd factor per chunk: reordered chunks differ
    return out


def _walk(tree: Any, path: str, tensors: list[tuple[str, torch.Tensor]], meta: list[str]) -> None:
    if isinstance(tree, torch.Tensor):
        t = _local(tree)
        tensors.append((path, t))
        meta.append(f"{path}:T:{t.dtype}:{tuple(t.shape)}")
    elif isinstance(tree, dict):
        meta.append(f"{path}:D:{len(tree)}")
        for k in sorted(tree, key=str):
            _walk(tree[k], f"{path}/{k}", tensors, meta)
    elif isinstance(tree, (list, tuple)):
        meta.append(f"{path}:L:{len(tree)}")
        for i, v in enumerate(tree):
            _walk(v, f"{path}/{i}", tensors, meta)
    else:
        meta.append(f"{path}:V:{tree!r}")


@torch.no_grad()
def state_digest(tree: Any) -> str:
    """sha256 (hex) of `tree`'s structure, non-tensor leaves and every tensor's on-device sums.

    Equal exactly when the trees are equal bit for bit (up to a 2^-64 chance for changes of many bits; any
    one-bit change is always seen). One host transfer per device, of 16 bytes per tensor."""
    tensors: list[tuple[str, torch.Tensor]] = []
    meta: list[str] = []
    _walk(tree, "", tensors, meta)
    digest = hashlib.sha256("\n".join(meta).encode())
    by_device: dict[str, list[torch.Tensor]] = {}
    order: list[tuple[str, int]] = []
    for _, t in tensors:
        dev = str(t.device)
        sums = by_device.setdefault(dev, [])
        order.append((dev, len(sums)))
        sums.append(tensor_sums(t))
    host = {dev: torch.stack(s).cpu() for dev, s in by_device.items() if s}
    for dev, i in order:
        digest.update(host[dev][i].numpy().tobytes())
    return digest.hexdigest()


def combine_rank_digests(digests: list[str]) -> str:
    """One digest for a sharded replica: its ranks' digests in rank order."""
    return hashlib.sha256("|".join(digests).encode()).hexdigest()


# Bits a `bitflip` fault may flip, per element size: the upper mantissa. A flipped exponent or sign bit can make
# a value inf or NaN, which the next all-reduce spreads to every replica (a different failure, found by the loss,
# not by a vote); the upper mantissa changes the value by 2^-13 to 2^-1 of itself, which no rounding washes out.
FLIP_BITS = {8: range(40, 52), 4: range(12, 23), 2: range(3, 7)}


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` of element `index` of `t` (its local shard), in place on its device."""
    local = _local(t.detach())
    if not local.is_contiguous():
        raise ValueError("flip_bit needs a contiguous tensor")
    flat = local.view(-1)
    if not 0 <= index < flat.numel():
        raise IndexError(f"flip_bit: element {index} of a tensor of {flat.numel()}")
    words = flat.view(_INT_VIEW[flat.element_size()])
    words[index : index + 1].bitwise_xor_(1 << bit)


def part_digests(tree: Any, depth: int = 2, prefix: str = "") -> dict[str, str]:
    """Short digests of `tree`'s parts down to `depth` levels of dicts ("committed/extra": ...): when two
    replicas differ, these say where (model, optimizer, schedule, data position, step)."""
    if depth <= 0 or not isinstance(tree, dict):
        return {prefix or "/": state_digest(tree)[:16]}
    out: dict[str, str] = {}
    for k in sorted(tree, key=str):
        out.update(part_digests(tree[k], depth - 1, f"{prefix}/{k}"))
    return out
