"""`--train.data hf:NAME[:split]`: the stream position as a pure function, exact resume, one line without
`datasets`; with `datasets` installed, a local dataset streamed end to end (no network)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from regent.orchestrate.config import ConfigError, RunConfig
from regent.orchestrate.preflight import check_data as preflight_check_data
from regent.train.data import ByteTokenizer
from regent.train.hf_stream import HFStreamBatches, parse_hf
from regent.train.shards import ShardSet, prepare_shards

TEXTS = [f"row {i}: " + "abc " * (i % 7) for i in range(40)]
HAS_DATASETS = importlib.util.find_spec("datasets") is not None


def stream_of(texts: list[str], repeats: int = 3) -> np.ndarray:
    one = np.concatenate([np.append(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), 257) for t in texts])
    return np.tile(one, repeats)


def make(shard: int, shards: int = 3, texts: list[str] = TEXTS) -> HFStreamBatches:
    return HFStreamBatches("hf:local:train", ByteTokenizer(), seq_len=8, batch_size=2, shard_index=shard,
                           num_shards=shards, rows=lambda: iter(texts))


def test_parse_hf():
    assert parse_hf("hf:roneneldan/TinyStories") == ("roneneldan/TinyStories", "train")
    assert parse_hf("hf:roneneldan/TinyStories:validation") == ("roneneldan/TinyStories", "validation")
    assert parse_hf("hf:/data/my_set:test") == ("/data/my_set", "test")
    with pytest.raises(ValueError, match="not hf:NAME"):
        parse_hf("hf:")


def test_batch_n_of_shard_k_is_the_defined_slice_of_the_stream():
    """Sequence g = stream[g*L : g*L+L+1]; batch n of shard k = sequences (n*S + k)*B + j; the stream repeats."""
    stream = stream_of(TEXTS)
    L, B, S = 8, 2, 3
    for k in range(S):
        loader = make(k)
        for n in range(30):  # past the end of one pass (about 400 tokens): the stream wraps
            inputs, labels = loader.next_batch()
            for j in range(B):
                g = (n * S + k) * B + j
                assert inputs[j].tolist() == stream[g * L: g * L + L].tolist()
                assert labels[j].tolist() == stream[g * L + 1: g * L + L + 1].tolist()


def test_resume_and_backward_reads_are_exact():
    reference = make(1)
    expected = [reference.next_batch()[0] for _ in range(20)]
    first = make(1)
    for _ in range(7):
        first.next_batch()
    restarted = make(1)
    restarted.load_state_dict(first.state_dict())
    assert all(torch.equal(restarted.next_batch()[0], expected[n]) for n in range(7, 20))
    # an evaluation reads batch 0 again, a step that did not commit gives its batch back: neither moves the
    # stream position of the next batches
    assert torch.equal(restarted.batch(0)[0], expected[0])
    assert torch.equal(restarted.batch(19)[0], expected[19])
    assert torch.equal(restarted.batch(12)[0], expected[12])  # a heal to an earlier position
    assert torch.equal(restarted.batch(13)[0], expected[13])


def test_empty_dataset_and_missing_datasets_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="is empty"):
        make(0, texts=[]).batch(0)
    if HAS_DATASETS:
        return
    with pytest.raises(ValueError, match="needs the Hugging Face 'datasets' package"):
        HFStreamBatches("hf:roneneldan/TinyStories", ByteTokenizer(), seq_len=8, batch_size=2, shard_index=0,
                        num_shards=1)
    cfg = RunConfig()
    cfg.train.data = "hf:roneneldan/TinyStories"
    with pytest.raises(ConfigError, match="^--train.data: hf:NAME data needs .*pip install datasets"):
        preflight_check_data(cfg)


@pytest.mark.skipif(not HAS_DATASETS, reason="the optional `datasets` package is not installed")
def test_local_dataset_streams_and_prepares(tmp_path):
    """A real `datasets` streaming read of a local JSON-lines dataset: the loader's batches are the defined
    slices, and `regent data prepare hf:DIR` writes the same token stream as shards."""
    folder = tmp_path / "ds"
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for i, text in enumerate(TEXTS):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    spec = f"hf:{folder}:train"
    loader = HFStreamBatches(spec, ByteTokenizer(), seq_len=8, batch_size=2, shard_index=1, num_shards=2)
    stream = stream_of(TEXTS)
    for n in range(4):
        inputs, _ = loader.next_batch()
        g = (n * 2 + 1) * 2
        assert inputs[0].tolist() == stream[g * 8: g * 8 + 8].tolist()
    prepare_shards(spec, str(tmp_path / "shards"), ByteTokenizer(), file_tokens=100, progress=False)
    shards = ShardSet(tmp_path / "shards")
    np.testing.assert_array_equal(shards.read(0, len(shards)), stream_of(TEXTS, 1))
