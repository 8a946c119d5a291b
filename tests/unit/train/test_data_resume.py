"""Data: deterministic built-in corpus, packing, disjoint (replica, rank) shards, resume without skip/replay."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from regent.train.data import ByteTokenizer, ShardedBatches, builtin_corpus_files, load_token_stream


def make_loader(tokens, shard=0, shards=1, seed=0, batch=2, seq=8):
    return ShardedBatches(tokens, seq_len=seq, batch_size=batch, seed=seed, shard_index=shard, num_shards=shards)


@pytest.fixture(scope="module")
def tokens():
    return load_token_stream(None, ByteTokenizer(), max_bytes=200_000)


def test_builtin_corpus_is_stdlib_and_deterministic(tokens):
    files = builtin_corpus_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    again = load_token_stream(None, ByteTokenizer(), max_bytes=200_000)
    assert np.array_equal(tokens, again)
    assert tokens.max() <= ByteTokenizer.eos_id and len(tokens) > 200_000  # bytes + EOS separators


def test_packing_labels_are_shifted_inputs(tokens):
    loader = make_loader(tokens, seq=16)
    inputs, labels = loader.next_batch()
    assert inputs.shape == labels.shape == (2, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    stream = torch.from_numpy(tokens).long()
    starts = torch.nonzero((stream.unfold(0, 16, 1) == inputs[0]).all(dim=1)).flatten().tolist()
    assert any(s % 16 == 0 for s in starts)  # packed back to back on seq_len boundaries (text may repeat elsewhere)


def test_shards_are_disjoint_and_cover_the_global_batch():
    tokens = np.arange(1 + 8 * 200, dtype=np.int32)  # unique values: equal rows would mean equal positions
    shards = 4
    seen = []
    for shard in range(shards):
        loader = make_loader(tokens, shard=shard, shards=shards)
        for _ in range(3):
            inputs, _ = loader.next_batch()
            seen.extend(tuple(row.tolist()) for row in inputs)
    assert len(seen) == len(set(seen)) == 3 * shards * 2


def test_resume_neither_skips_nor_repeats(tokens):
    reference = make_loader(tokens, shard=1, shards=2)
    expected = [reference.next_batch()[0] for _ in range(10)]
    first = make_loader(tokens, shard=1, shards=2)
    got = [first.next_batch()[0] for _ in range(4)]
    state = first.state_dict()
    resumed = make_loader(tokens, shard=1, shards=2)
    resumed.load_state_dict(state)
    got += [resumed.next_batch()[0] for _ in range(6)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_peer_state_continues_own_shard(tokens):
    """A healed replica loads a peer's data state and continues its *own* shard at the same position."""
    survivor, healed = make_loader(tokens, shard=0, shards=2), make_loader(tokens, shard=1, shards=2)
    for _ in range(5):
        survivor.next_batch()
    healed.load_state_dict(survivor.state_dict())
    assert torch.equal(healed.next_batch()[0], make_loader(tokens, shard=1, shards=2).batch(5)[0])


def test_epochs_wrap_with_new_order():
    tokens = np.arange(1 + 8 * 8, dtype=np.int32)  # 8 sequences of 8
    loader = make_loader(tokens, batch=2, seq=8, shards=2)
    assert loader.batches_per_epoch == 2
    epoch0 = [loader.next_batch()[0] for _ in range(2)]
    epoch1 = [loader.next_batch()[0] for _ in range(2)]
    assert loader.state_dict()["batches_consumed"] == 4
    assert {tuple(b[:, 0].tolist()) for b in epoch0} != {tuple(b[:, 0].tolist()) for b in epoch1}


def test_mismatched_state_and_tiny_corpus_are_refused(tokens):
    loader = make_loader(tokens, shards=2)
    with pytest.raises(ValueError, match="num_shards"):
        make_loader(tokens, shards=4).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make_loader(np.arange(10, dtype=np.int32), seq=8)


def test_data_glob(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("world")
    stream = load_token_stream(str(tmp_path / "*.txt"), ByteTokenizer(), 1000)
    assert bytes(stream[stream < 256].astype(np.uint8)) == b"helloworld"
    with pytest.raises(ValueError, match="matched no files"):
        load_token_stream(str(tmp_path / "*.md"), ByteTokenizer(), 1000)


def test_token_stream_is_cached_until_an_input_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("REGENT_TOKEN_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world")
    first = load_token_stream(str(corpus), ByteTokenizer(), 1000)
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1

    class Refusing(ByteTokenizer):
        def encode(self, text: bytes) -> np.ndarray:
            raise AssertionError("tokenized again although cached")

    np.testing.assert_array_equal(load_token_stream(str(corpus), Refusing(), 1000), first)  # from the cache
    with pytest.raises(AssertionError, match="tokenized again"):
        load_token_stream(str(corpus), Refusing(), 999)  # another byte budget is another stream
    corpus.write_text("hello there")  # new content (size or mtime changes): tokenized afresh
    os.utime(corpus, ns=(1, 1))
    assert bytes(load_token_stream(str(corpus), ByteTokenizer(), 1000)[:11].astype(np.uint8)) == b"hello there"
    monkeypatch.setenv("REGENT_TOKEN_CACHE", "off")
    with pytest.raises(AssertionError, match="tokenized again"):
        load_token_stream(str(corpus), Refusing(), 1000)
