"""Pre-tokenized shards: prepare -> memory-mapped load, the same batches as the in-memory path, exact resume,
one clear line for bad input, and a `regent data prepare` killed with SIGKILL then run again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from regent.orchestrate.config import ConfigError, RunConfig
from regent.orchestrate.preflight import check_data as preflight_check_data
from regent.train.data import (
    ByteTokenizer,
    ShardedBatches,
    build_batches,
    check_data,
    data_kind,
    load_token_stream,
    shuffled_positions,
)
from regent.train.shards import ShardError, ShardSet, prepare_shards


def write_corpus(root: Path, docs: int = 12, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "\n", "epsilon", "zeta"], size=300 + 40 * i)
        (root / f"doc{i:03d}.txt").write_text(" ".join(words))
    return str(root / "*.txt")


def loader(source, shard=0, shards=2, seed=3):
    return ShardedBatches(source, seq_len=16, batch_size=3, seed=seed, shard_index=shard, num_shards=shards)


def test_shuffled_positions_is_a_seeded_bijection():
    for n in (1, 2, 3, 17, 1000, 4097):
        assert sorted(shuffled_positions(np.arange(n), n, 0, 0).tolist()) == list(range(n))
    a, b, c = (shuffled_positions(np.arange(50), 50, s, e).tolist() for s, e in ((0, 0), (0, 1), (1, 0)))
    assert a != b and a != c
    # any slice of the order is computable on its own: no per-epoch table, so any corpus size
    assert shuffled_positions(np.arange(10, 20), 50, 0, 0).tolist() == a[10:20]
    big = shuffled_positions(np.arange(4), 10**12, 0, 0)
    assert ((big >= 0) & (big < 10**12)).all()


def test_prepare_then_load_gives_the_in_memory_batches(tmp_path, monkeypatch):
    """The shards hold the in-memory path's token stream (documents + EOS), so the batches are the same, also
    for windows that span two token files (small --file-tokens)."""
    monkeypatch.setenv("REGENT_TOKEN_CACHE", "off")
    pattern = write_corpus(tmp_path / "text")
    manifest = prepare_shards(pattern, str(tmp_path / "shards"), ByteTokenizer(), file_tokens=500, progress=False)
    assert len(manifest["files"]) > 5 and manifest["dtype"] == "uint16" and manifest["num_documents"] == 12
    stream = load_token_stream(pattern, ByteTokenizer(), max_bytes=1 << 30)
    shards = ShardSet(tmp_path / "shards")
    assert len(shards) == len(stream)
    np.testing.assert_array_equal(shards.read(0, len(stream)), stream)
    for shard in range(2):
        memory, mapped = loader(stream, shard), loader(shards, shard)
        assert mapped.batches_per_epoch == memory.batches_per_epoch
        for n in range(2 * memory.batches_per_epoch + 1):  # across an epoch boundary
            for a, b in zip(memory.batch(n), mapped.batch(n)):
                assert torch.equal(a, b)
    assert data_kind(str(tmp_path / "shards")) == "shards" and data_kind(pattern) == "text"


def test_resume_after_restart_and_heal_are_exact(tmp_path):
    prepare_shards(write_corpus(tmp_path / "text"), str(tmp_path / "shards"), ByteTokenizer(), file_tokens=700,
                   progress=False)
    path = str(tmp_path / "shards")
    make = lambda shard: build_batches(path, ByteTokenizer(), seq_len=16, batch_size=3, seed=5,  # noqa: E731
                                       shard_index=shard, num_shards=2, max_bytes=1)
    uninterrupted = make(1)
    expected = [uninterrupted.next_batch() for _ in range(9)]
    first = make(1)
    got = [first.next_batch() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # through a checkpoint's JSON
    del first
    restarted = make(1)  # a new process: maps the files afresh
    restarted.load_state_dict(state)
    got += [restarted.next_batch() for _ in range(5)]
    for (a, b), (c, d) in zip(expected, got):
        assert torch.equal(a, c) and torch.equal(b, d)
    healed = make(1)  # a healed replica takes a peer's (shard 0's) state and continues its own shard
    donor = make(0)
    for _ in range(6):
        donor.next_batch()
    healed.load_state_dict(donor.state_dict())
    assert torch.equal(healed.next_batch()[0], expected[6][0])
    other = ShardedBatches(load_token_stream(None, ByteTokenizer(), 50_000), seq_len=16, batch_size=3, seed=5,
                           shard_index=1, num_shards=2)
    with pytest.raises(ValueError, match="fingerprint"):
        other.load_state_dict(state)  # another corpus's position is refused


def test_bad_input_is_one_clear_line(tmp_path):
    pattern = write_corpus(tmp_path / "text", docs=3)
    dst = tmp_path / "shards"
    prepare_shards(pattern, str(dst), ByteTokenizer(), file_tokens=600, progress=False)

    def refused(match: str, data: str = str(dst), tokenizer=ByteTokenizer(), batch_size: int = 2) -> str:
        with pytest.raises(ValueError, match=match) as info:
            check_data(data, tokenizer, seq_len=16, batch_size=batch_size, num_shards=2)
        assert "\n" not in str(info.value)
        return str(info.value)

    check_data(str(dst), ByteTokenizer(), seq_len=16, batch_size=2, num_shards=2)
    refused("matched no files", str(tmp_path / "nowhere" / "*.txt"))
    refused("fewer than one global batch", batch_size=10_000)

    class OtherTokenizer(ByteTokenizer):
        vocab_size = 300

        def cache_id(self) -> str:
            return "other-1"

    refused("tokenized with the byte tokenizer .vocab 259. but --train.tokenizer gives other-1",
            tokenizer=OtherTokenizer())

    files = sorted(dst.glob("tokens-*.bin"))
    data = bytearray(files[1].read_bytes())
    data[7] ^= 0xFF
    files[1].write_bytes(bytes(data))
    refused("does not match its checksum")
    files[1].write_bytes(bytes(data[:-2]))
    refused("truncated or replaced")
    files[1].unlink()
    refused("is missing")
    (dst / "manifest.json").write_text("{not json")
    refused("not valid JSON")
    (dst / "manifest.json").unlink()
    refused("no manifest.json")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ShardError, match="all empty"):
        prepare_shards(str(tmp_path / "empty"), str(tmp_path / "out"), ByteTokenizer(), progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.me").write_text("x")
    with pytest.raises(ShardError, match="not empty and not a Regent shard directory"):
        prepare_shards(pattern, str(tmp_path / "busy"), ByteTokenizer(), progress=False)
    assert (tmp_path / "busy" / "keep.me").exists()


def test_preflight_refuses_before_launch(tmp_path):
    pattern = write_corpus(tmp_path / "text", docs=2)
    dst = tmp_path / "shards"
    prepare_shards(pattern, str(dst), ByteTokenizer(), progress=False)
    cfg = RunConfig()
    cfg.replicas, cfg.procs_per_replica, cfg.train.data, cfg.train.seq_len, cfg.train.batch_size = 2, 1, str(dst), 16, 2
    preflight_check_data(cfg)
    cfg.train.batch_size = 1000
    with pytest.raises(ConfigError, match="^--train.data: shards in .* fewer than one global batch .1000 x 2"):
        preflight_check_data(cfg)
