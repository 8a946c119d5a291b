"""A digest of a replica's whole training state, computed where the tensors live.

Replicas that committed the same steps must hold bit-identical state; a faulty device can change a bit and go
on training, and in per-step mode the all-reduce then keeps everyone's parameters moving together while the
flipped replica stays different for good. Comparing digests finds it. The digest must therefore cover
everything the replicas agree on (parameters, optimizer state, schedule, data position, step), be cheap enough
to take every few commits, and never copy the model to the host.

How: each tensor's bits are read as 16-, 32- or 64-bit integers x_i and reduced on its device to two 64-bit
sums of x_i * w_i with odd weights w_i that depend on the position (`tensor_sums` says why any one flipped bit
always changes them). Integer sums wrap the same way in any reduction order, so the result is deterministic
on any device, and products stay in the words' own width, so a 32-bit state is read with no 64-bit
temporaries. Only the two sums per tensor (16 bytes) reach the host, where they are hashed with the tree's
structure, dtypes, shapes and the non-tensor leaves (sha256).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from regent import settings

# Weights repeat with this period (elements); a block of PERIOD elements gets its own odd factor. The digest does
# not depend on how many blocks are reduced at once (CHUNK_BLOCKS, per device type), only on these constants.
PERIOD = 1 << 20
CHUNK_BLOCKS = {"cuda": 64, "cpu": 4}  # blocks per reduction: fewer kernel launches on a GPU, less memory on CPU
_A1, _B1 = 0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019  # odd multipliers (as signed int64)
_A2, _B2 = 0xC2B2AE3D27D4EB4F - (1 << 64), 0x165667B19E3779F9
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16}
_weights: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _period_weights(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of PERIOD odd weights in the words' own integer type (products wrap in that type), cached."""
    key = (str(device), dtype)
    if key not in _weights:
        i = torch.arange(PERIOD, dtype=torch.int64, device=device)
        _weights[key] = (((i * _A1 + _B1) | 1).to(dtype), ((i * _A2 + _B2) | 1).to(dtype))
    return _weights[key]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharded replicas digest per rank), the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as a flat tensor of 16-, 32- or 64-bit integers (bytes and bools widened to int32)."""
    flat = _local(t.detach()).contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    if size == 1:
        return flat.view(torch.uint8).to(torch.int32)
    # complex128 (16 bytes) and wider: their bytes as 64-bit words
    return flat.view(_INT_VIEW[size]) if size in _INT_VIEW else flat.view(torch.int64)


def _low32(v: int) -> int:
    """The low 32 bits of `v` as a signed int32 (what the torch path's int64 -> int32 cast keeps)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


_kernel: Any = None  # the Triton kernel, built on first use; False where Triton is not there


def _triton_kernel() -> Any:
    """One fused pass over 32-bit words on a GPU: read each word once, weights from its index in registers,
    one int64 partial per program (the torch path reads and writes int32 products twice per lane: 150-200 GB/s
    on an H200 against ~4 TB/s here). The same function as the torch path, bit for bit."""
    global _kernel
    if _kernel is not None:
        return _kernel
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _kernel = False
        return _kernel

    @triton.jit
    def sums(x_ptr, out_ptr, n, PERIOD: tl.constexpr, BLOCK: tl.constexpr, A1: tl.constexpr, B1: tl.constexpr,
             A2: tl.constexpr, B2: tl.constexpr, FA: tl.constexpr, FB: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0)
        j = (offs % PERIOD).to(tl.int32)
        w1 = (j * A1 + B1) | 1
        w2 = (j * A2 + B2) | 1
        s1 = tl.sum((x * w1).to(tl.int64), axis=0)
        s2 = tl.sum((x * w2).to(tl.int64), axis=0)
        b = (pid * BLOCK) // PERIOD
        f = (b * FA + FB) | 1
        tl.store(out_ptr + pid * 2, s1 * f)
        tl.store(out_ptr + pid * 2 + 1, s2 * f)

    _kernel = sums
    return _kernel


def _fused_sums(words: torch.Tensor) -> torch.Tensor | None:
    """`tensor_sums` of 32-bit words on a CUDA device through the Triton kernel; None where it cannot run."""
    if words.device.type != "cuda" or words.dtype != torch.int32 or settings.REGENT_DIGEST_TORCH.get():
        return None
    kernel = _triton_kernel()
    if not kernel:
        return None
    block = 4096  # divides PERIOD: a program never spans two blocks
    programs = (words.numel() + block - 1) // block
    partial = torch.empty(programs, 2, dtype=torch.int64, device=words.device)
    kernel[(programs,)](words, partial, words.numel(), PERIOD=PERIOD, BLOCK=block, A1=_low32(_A1),
                        B1=_low32(_B1), A2=_low32(_A2), B2=_low32(_B2), FA=_A2, FB=_B1)
    return partial.sum(dim=0)


def tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of `t`'s bits, on `t`'s device (no copy to the host).

    Per block b of PERIOD words x_j: s_b = sum_j x_j * w_j, the products wrapping in the words' own type (16,
    32 or 64 bits: no int64 temporaries for 32-bit data) and summed in int64; then sum_b s_b * f_b mod 2^64
    with odd f_b. One flipped bit changes one product by a nonzero amount below 2^32 in magnitude (w_j is
    odd, so 2^bit * w_j is not 0 in the word's type) or, for 64-bit words, by an odd multiple of 2^bit mod
    2^64; times an odd f_b that is never 0 mod 2^64: every single-bit change is seen."""
    words = _words(t)
    if words.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    fused = _fused_sums(words)
    if fused is not None:
        return fused
    return _torch_sums(words)


def _torch_sums(words: torch.Tensor) -> torch.Tensor:
    w1, w2 = _period_weights(words.device, words.dtype)
    n = words.numel()
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    step = PERIOD * CHUNK_BLOCKS.get(words.device.type, 4)
    for start in range(0, n, step):
        x = words[start:start + step]
        full, tail = divmod(x.numel(), PERIOD)
        b0 = start // PERIOD
        blocks = torch.arange(b0, b0 + full + (1 if tail else 0), dtype=torch.int64, device=words.device)
        f = (blocks * _A2 + _B1) | 1
        for lane, w in enumerate((w1, w2)):
            parts = []
            if full:
                parts.append((x[:full * PERIOD].view(full, PERIOD) * w).sum(dim=1, dtype=torch.int64))
            if tail:
                parts.append((x[full * PERIOD:] * w[:tail]).sum(dtype=torch.int64).reshape(1))
            s = torch.cat(parts) if len(parts) > 1 else parts[0]
            out[lane] += (s * f).sum()
    return out


def _walk(tree: Any, path: str, tensors: list[tuple[str, torch.Tensor]], meta: list[tuple[str, str]]) -> None:
    if isinstance(tree, torch.Tensor):
        t = _local(tree)
        tensors.append((path, t))
        meta.append((path, f"{path}:T:{t.dtype}:{tuple(t.shape)}"))
    elif isinstance(tree, dict):
        meta.append((path, f"{path}:D:{len(tree)}"))
        for k in sorted(tree, key=str):
            _walk(tree[k], f"{path}/{k}", tensors, meta)
    elif isinstance(tree, (list, tuple)):
        meta.append((path, f"{path}:L:{len(tree)}"))
        for i, v in enumerate(tree):
            _walk(v, f"{path}/{i}", tensors, meta)
    else:
        meta.append((path, f"{path}:V:{tree!r}"))


@torch.no_grad()
def digest_with_parts(tree: Any, depth: int = 2) -> tuple[str, dict[str, str]]:
    """(digest of `tree`, short digests of its parts down to `depth` levels: "/trainer/optimizer" ...).

    The digest is sha256 of the tree's structure, non-tensor leaves and every tensor's on-device sums: equal
    exactly when the trees are equal bit for bit (up to a 2^-64 chance for changes of many bits; any one-bit
    change is always seen). One host transfer per device, of 16 bytes per tensor. The parts say where two
    replicas differ (model, optimizer, schedule, data position, step) at no extra device cost."""
    tensors: list[tuple[str, torch.Tensor]] = []
    meta: list[tuple[str, str]] = []
    _walk(tree, "", tensors, meta)
    by_device: dict[str, list[torch.Tensor]] = {}
    where: dict[str, tuple[str, int]] = {}
    for path, t in tensors:
        sums = by_device.setdefault(str(t.device), [])
        where[path] = (str(t.device), len(sums))
        sums.append(tensor_sums(t))
    host = {dev: torch.stack(s).cpu() for dev, s in by_device.items() if s}
    whole = hashlib.sha256()
    parts: dict[str, Any] = {}
    for path, line in meta:
        chunk = line.encode()
        if path in where and line.startswith(f"{path}:T:"):
            dev, i = where[path]
            chunk += host[dev][i].numpy().tobytes()
        whole.update(chunk)
        key = "/" + "/".join(path.split("/")[1:depth + 1]) if path else "/"
        parts.setdefault(key, hashlib.sha256()).update(chunk)
    return whole.hexdigest(), {k: h.hexdigest()[:16] for k, h in parts.items()}


def state_digest(tree: Any) -> str:
    """The digest of `tree` (see `digest_with_parts`)."""
    return digest_with_parts(tree)[0]


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


def part_digests(tree: Any, depth: int = 2) -> dict[str, str]:
    """Short digests of `tree`'s parts down to `depth` levels (see `digest_with_parts`)."""
    return digest_with_parts(tree, depth)[1]
