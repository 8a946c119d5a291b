"""Contiguous tensor layout and the transport's grouping of adjacent tensors (pure, no processes)."""

from __future__ import annotations

import pytest
import torch

from regent.contiguous import (
    byte_span,
    contiguous_copy,
    contiguous_empty_like,
    is_contiguous_run,
    make_contiguous,
)
from regent.ft.transfer import adjacent_runs


def test_make_contiguous_keeps_values_and_parameter_objects():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    make_contiguous(params)
    assert [id(p) for p in model.parameters()] == ids
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert is_contiguous_run(params)
    # The model still trains through the views, and the update lands in the shared buffer.
    model(torch.randn(2, 8)).sum().backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert not torch.equal(params[0], before[0])
    assert torch.equal(byte_span(params)[: params[0].numel() * 4], params[0].detach().reshape(-1).view(torch.uint8))


def test_odd_sizes_are_aligned_and_dtypes_get_their_own_buffer():
    like = [torch.empty(3), torch.empty(5), torch.empty(2, dtype=torch.bfloat16), torch.empty(4)]
    out = contiguous_empty_like(like)
    assert [t.shape for t in out] == [t.shape for t in like] and all(float(t.abs().sum()) == 0 for t in out)
    assert all(t.data_ptr() % 16 == 0 for t in out)
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    assert out[2].untyped_storage().data_ptr() != out[0].untyped_storage().data_ptr()
    assert not is_contiguous_run(out[:2])  # 12 bytes, padded to 16: a gap
    assert is_contiguous_run([out[1], out[3]]) is False  # 20 bytes padded to 32
    even = contiguous_empty_like([torch.empty(4), torch.empty(8)])
    assert is_contiguous_run(even)


def test_contiguous_copy_is_a_copy():
    src = [torch.randn(4, 4), torch.randn(8)]
    out = contiguous_copy(src)
    assert all(torch.equal(a, b) for a, b in zip(out, src)) and is_contiguous_run(out)
    out[0].zero_()
    assert float(src[0].abs().sum()) > 0


def test_make_contiguous_refuses_dtensors():
    class Fake(torch.Tensor):
        def to_local(self):
            return self

    with pytest.raises(ValueError, match="FSDP2"):
        make_contiguous([torch.empty(2).as_subclass(Fake)])


def test_adjacent_runs_follow_memory_order_and_respect_the_cap():
    a, b, c, d = contiguous_empty_like([torch.empty(4)] * 4)  # 16 bytes each, back to back
    loose = torch.empty(4)
    # Listed out of memory order: a run comes out in memory order; the loose tensor is a run of its own.
    tensors = [c, loose, a, d, b]
    runs = adjacent_runs([0, 1, 2, 3, 4], tensors, torch.device("cpu"), max_bytes=1 << 20)
    assert runs == [[1], [2, 4, 0, 3]]  # runs by their first index: the same in any process, whatever the addresses
    # A 32-byte cap splits the run in pairs.
    assert adjacent_runs([0, 2, 3, 4], tensors, torch.device("cpu"), max_bytes=32) == [[0, 3], [2, 4]]
    # Tensors not on the group's device are copied there one by one, never merged.
    assert adjacent_runs([0, 2], tensors, torch.device("meta"), max_bytes=1 << 20) == [[0], [2]]
