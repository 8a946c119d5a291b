"""regent.ft.digest: the full-state digest replicas vote on. Pure: tensors only, no processes."""

from __future__ import annotations

import copy

import pytest
import torch

from regent.ft import digest
from regent.ft.digest import combine_rank_digests, flip_bit, part_digests, state_digest, tensor_sums


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
                  "h": torch.randn(5, generator=g).half(), "d": torch.randn(3, generator=g).double()},
        "optimizer": {"state": {"w": {"exp_avg": torch.zeros(64, 33), "step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]},
        "lr_scheduler": {"step_count": 3}, "data": {"batches_consumed": 12}, "step": 3,
        "mask": torch.tensor([True, False]), "ids": torch.arange(5, dtype=torch.int64),
    }


def test_equal_states_have_equal_digests_and_any_single_bit_changes_it():
    base = state_digest(state())
    assert base == state_digest(state())
    for name, bits in (("w", 32), ("b", 16), ("h", 16), ("d", 64)):
        for bit in range(bits - 1):  # every bit but the sign bit of the top word (flip_bit takes a python int)
            s = copy.deepcopy(state())
            flip_bit(s["model"][name], 2, bit)
            assert state_digest(s) != base, (name, bit)


def test_everything_the_replicas_agree_on_is_covered():
    base = state_digest(state())
    for change in (lambda s: s["optimizer"]["state"]["w"]["exp_avg"].add_(1e-30),
                   lambda s: s["optimizer"]["param_groups"][0].update(lr=2e-3),
                   lambda s: s["lr_scheduler"].update(step_count=4),
                   lambda s: s["data"].update(batches_consumed=13),
                   lambda s: s.update(step=4),
                   lambda s: s["mask"].logical_not_(),
                   lambda s: s["ids"].add_(1),
                   lambda s: s["model"].update(w=s["model"]["w"].reshape(33, 64))):  # same bits, other shape
        s = copy.deepcopy(state())
        change(s)
        assert state_digest(s) != base


def test_swapped_elements_and_chunks_differ(monkeypatch):
    x = torch.arange(10, dtype=torch.float32)
    y = x.clone()
    y[[2, 7]] = y[[7, 2]]
    assert not torch.equal(tensor_sums(x), tensor_sums(y))
    monkeypatch.setattr(digest, "PERIOD", 4)
    digest._weights.clear()
    z = torch.cat([x[4:8], x[0:4], x[8:]])  # the same weights in each block: only the block factors tell
    assert not torch.equal(tensor_sums(x), tensor_sums(z))
    # how many blocks are reduced at once (per device type) does not change the digest
    monkeypatch.setitem(digest.CHUNK_BLOCKS, "cpu", 1)
    one = tensor_sums(x)
    monkeypatch.setitem(digest.CHUNK_BLOCKS, "cpu", 3)
    assert torch.equal(one, tensor_sums(x))
    digest._weights.clear()


def test_parts_say_where_two_states_differ_and_ranks_combine_in_order():
    a, b = state(), state()
    b["data"]["batches_consumed"] += 1
    pa, pb = part_digests(a), part_digests(b)
    assert [k for k in pa if pa[k] != pb[k]] == ["/data/batches_consumed"]
    assert combine_rank_digests(["x", "y"]) != combine_rank_digests(["y", "x"])


def test_flip_bit_refuses_a_non_contiguous_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        flip_bit(torch.zeros(4, 4).t(), 0, 3)
