"""Hugging Face `datasets` streaming as a training corpus: `--train.data hf:NAME[:split]`.

`datasets` is optional (not a Regent dependency); without it the option fails before launch with one line.

The position, exactly. The dataset's rows, in the order streaming yields them, each tokenized and followed by
EOS, make one token stream; the stream repeats (pass p+1 starts right after pass p's last EOS), so it has no end.
Sequence g is tokens [g*L, g*L + L + 1) of it (L = seq_len: inputs and shifted labels, like the in-memory
loader). Batch n of shard k (of S shards, B sequences each) is sequences (n*S + k)*B + j, j < B. So batch n of
shard k is a pure function of (dataset, tokenizer, L, B, n, k), and the loader's whole state is n, the batches
consumed, identical on every replica that took the same steps: a healed replica continues at the donor's n on its
own shard, and a restart resumes exactly. There is no shuffle (a stream has no random access): shuffle upstream,
or prepare shards (`regent data prepare hf:NAME DST`), which the memory-mapped loader shuffles per epoch.

The cost of exactness: every shard reads the whole stream (it skips the others' sequences), and reaching batch n
after a restart reads the stream from its start up to n (no network index to seek in). For long runs, prepare
shards once instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from regent.train.position import BatchPosition

EVAL_CACHE = 4  # batches 0..EVAL_CACHE-1 are kept once made: evaluate_loss reads them again and again
RECENT = 4  # the last batches made are kept too: a step that does not commit gives its batch back


def parse_hf(spec: str) -> tuple[str, str]:
    """'hf:NAME[:split]' -> (NAME, split); split defaults to 'train'. NAME may be org/name or a local folder."""
    if not spec.startswith("hf:") or not spec[3:]:
        raise ValueError(f"{spec!r} is not hf:NAME[:split] (for example hf:roneneldan/TinyStories:train)")
    name, sep, split = spec[3:].rpartition(":")
    if not sep or not split or "/" in split:
        return spec[3:], "train"
    return name, split


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError("hf:NAME data needs the Hugging Face 'datasets' package, which is not installed: "
                         "pip install datasets (or prepare shards where it is: regent data prepare hf:NAME DST)"
                         ) from None
    return datasets


def check_available(spec: str) -> None:
    """Before launch: the spec parses and `datasets` imports (the dataset itself is opened by the trainers)."""
    parse_hf(spec)
    _datasets()


def open_stream(name: str, split: str, *, skip: int = 0, column: str | None = None) -> Iterator[str]:
    """The texts of a streamed dataset from row `skip` on. `column` defaults to 'text', else the first string
    column of the first row."""
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot open it"
        raise ValueError(f"hf:{name}:{split} cannot be opened ({type(exc).__name__}: {exc}); check the name, the "
                         "split and the network") from None
    if skip:
        ds = ds.skip(skip)
    for row in ds:
        if column is None:
            strings = [k for k, v in row.items() if isinstance(v, str)]
            if not strings:
                raise ValueError(f"hf:{name}:{split} rows have no text column (columns: {', '.join(row)})")
            column = "text" if "text" in strings else strings[0]
        yield row[column]


class _Reader:
    """A forward-only window on the repeated token stream: holds the tokens from `base` on, no more than asked."""

    def __init__(self, docs: Iterator[np.ndarray]):
        self._docs = docs
        self.base = 0
        self._buf = np.zeros(0, dtype=np.int64)

    def read(self, start: int, length: int) -> np.ndarray:
        assert start >= self.base
        pieces = [self._buf]
        have = self.base + len(self._buf)
        while have < start + length:
            doc = next(self._docs)
            if have + len(doc) <= start:  # wholly before the window: skipped without keeping it
                self.base, have, pieces = have + len(doc), have + len(doc), []
                continue
            pieces.append(doc)
            have += len(doc)
        buf = np.concatenate(pieces) if len(pieces) != 1 else pieces[0]
        buf = buf[start - self.base:]
        self._buf, self.base = buf, start
        return buf[:length].copy()


class HFStreamBatches(BatchPosition):
    """Next-token batches of one shard from a streamed dataset, with the same interface and state as
    `ShardedBatches` (batches_consumed; see the module docstring for the position)."""

    def __init__(self, spec: str, tokenizer: Any, *, seq_len: int, batch_size: int, shard_index: int,
                 num_shards: int, rows: Callable[[], Iterable[str]] | None = None):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
        self.name, self.split = parse_hf(spec)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.shard_index, self.num_shards = shard_index, num_shards
        self.tokenizer = tokenizer
        # rows(): one pass over the dataset's texts, from its start (default: stream it with `datasets`)
        self._rows = rows if rows is not None else (lambda: open_stream(self.name, self.split))
        if rows is None:
            _datasets()
        self.fingerprint = f"hf:{self.name}:{self.split}:{tokenizer.cache_id()}"
        self.batches_consumed = 0
        self._reader: _Reader | None = None
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _docs(self) -> Iterator[np.ndarray]:
        eos = np.asarray([self.tokenizer.eos_id], dtype=np.int64)
        while True:
            tokens = 0
            for text in self._rows():
                ids = np.asarray(self.tokenizer.encode(text.encode("utf-8")), dtype=np.int64)
                tokens += len(ids) + 1
                yield np.concatenate([ids, eos])
            if tokens == 0:
                raise ValueError(f"hf:{self.name}:{self.split} is empty: a pass over it gave no rows")

    def _span(self, index: int) -> tuple[int, int]:
        first = (index * self.num_shards + self.shard_index) * self.batch_size
        return first * self.seq_len, self.batch_size * self.seq_len + 1

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` of this shard: (inputs, labels). Forward reads continue the stream; an earlier batch
        than the last one read is made by a second pass from the start (cached for the first few)."""
        if index in self._cache:
            return self._cache[index]
        start, length = self._span(index)
        if self._reader is None or start < self._reader.base:
            reader = _Reader(self._docs())
            if self._reader is None or index >= EVAL_CACHE:
                self._reader = reader  # a backward jump of the position itself (a heal to an earlier n)
        else:
            reader = self._reader
        span = torch.from_numpy(reader.read(start, length))
        result = (span[:-1].view(self.batch_size, self.seq_len), span[1:].view(self.batch_size, self.seq_len))
        self._cache[index] = result
        recent = sorted(i for i in self._cache if i >= EVAL_CACHE)
        for old in recent[:-RECENT]:
            del self._cache[old]
        return result
