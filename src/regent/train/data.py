"""Data: a corpus that needs no download, a tokenizer, sequence packing and a resumable sharded loader.

`--train.data` names one of four sources (`data_kind`): unset (the built-in corpus), a glob of text files
(tokenized into memory, up to data_max_bytes), a directory of pre-tokenized shards (`regent.train.shards`,
memory-mapped, any size) or `hf:NAME[:split]` (`regent.train.hf_stream`, streamed with `datasets`).

The loader is *stateless by construction*: batch n of shard k is a pure function of (corpus, seed, n, k).
Its whole state is the number of batches consumed, which is the same on every replica that took the same
steps. So a replica healed from a peer can load the peer's data state and continue with the next batch of
its *own* shard: it neither replays nor skips data relative to the survivors.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import sysconfig
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from regent import settings
from regent.train.hf_stream import HFStreamBatches
from regent.train.position import BatchPosition
from regent.train.shards import ShardSet

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: bytes) -> np.ndarray: ...

    def cache_id(self) -> str:
        """Names this tokenizer's output exactly (token caches are keyed by it)."""
        ...


class ByteTokenizer:
    """One id per byte (0-255) plus BOS, EOS and PAD: no vocabulary file, works on any text."""

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def cache_id(self) -> str:
        return "bytes-1"


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (optional dependency: `pip install tokenizers`)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ValueError(
                f"tokenizer={path!r} needs the 'tokenizers' package; pip install tokenizers "
                "(or leave tokenizer unset for the byte-level tokenizer)"
            ) from None
        if not Path(path).is_file():
            raise ValueError(f"tokenizer file {path!r} does not exist; pass a tokenizer.json path")
        self._tok = _HF.from_file(path)
        self._digest = hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.bos_id = next((vocab[t] for t in ("<|begin_of_text|>", "<s>", "<bos>") if t in vocab), 0)
        self.eos_id = next((vocab[t] for t in ("<|end_of_text|>", "</s>", "<eos>") if t in vocab), 0)

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def cache_id(self) -> str:
        return f"hf-{self._digest}"


def build_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)


def builtin_corpus_files() -> list[Path]:
    """The installed Python standard library's .py sources (no tests, no site-packages), sorted by path.

    Listed once per process (the walk costs ~0.1-0.3 s, paid by every restarted trainer otherwise; warm spare
    processes list it before they are claimed: `regent.orchestrate.warm`)."""
    return list(_builtin_corpus_files())


@functools.cache
def _builtin_corpus_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def corpus_files(pattern: str | None) -> list[Path]:
    if pattern is None:
        files = builtin_corpus_files()
        if not files:
            raise ValueError("found no Python standard-library sources for the built-in corpus; pass --data GLOB")
        return files
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"data glob {pattern!r} matched no files; check the path or quote the glob")
    return files


def token_cache_dir() -> Path | None:
    """Where tokenized corpora are kept: $REGENT_TOKEN_CACHE, else $XDG_CACHE_HOME/regent/tokens (or
    ~/.cache/regent/tokens); REGENT_TOKEN_CACHE=off turns the cache off."""
    if settings.REGENT_TOKEN_CACHE.is_set():
        configured = settings.REGENT_TOKEN_CACHE.get()
        return None if configured is None else Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "regent" / "tokens"


def token_cache_key(files: list[Path], tokenizer: Tokenizer, max_bytes: int) -> str:
    """Changes when an input file that is read (path, size, modification time), the tokenizer or the byte
    budget does. Files past the budget are not read, so they are not looked at either (the built-in corpus
    has thousands)."""
    digest = hashlib.blake2b(f"{tokenizer.cache_id()}\0{max_bytes}\0".encode(), digest_size=16)
    covered = 0
    for path in files:
        if covered >= max_bytes:
            break
        stat = path.stat()
        covered += stat.st_size
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def load_token_stream(pattern: str | None, tokenizer: Tokenizer, max_bytes: int) -> np.ndarray:
    """Concatenate documents (EOS between them) into one int32 token stream, reading at most max_bytes.

    The stream is cached on disk (`token_cache_dir`) under a key of its inputs: every rank of every restarted
    replica needs the same stream, and tokenizing a real corpus again at each restart would cost minutes.
    """
    files = corpus_files(pattern)
    cache = token_cache_dir()
    if cache is None:
        return _tokenize(files, tokenizer, max_bytes)
    path = cache / f"{token_cache_key(files, tokenizer, max_bytes)}.npy"
    try:
        # memory-mapped: a restarted trainer does not read the whole stream before its first step (~0.2 s for the
        # built-in corpus on a busy machine), and every process on a host shares the same page cache
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        pass  # not cached yet (or unreadable): tokenize and cache
    tokens = _tokenize(files, tokenizer, max_bytes)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
        np.save(partial, tokens)
        os.replace(partial, path)  # atomic: ranks that tokenize at the same time never see half a file
    except OSError as exc:
        log.warning("could not cache the token stream in %s (%s); set REGENT_TOKEN_CACHE to a writable folder",
                    cache, exc)
    return tokens


def _tokenize(files: list[Path], tokenizer: Tokenizer, max_bytes: int) -> np.ndarray:
    pieces: list[np.ndarray] = []
    read = 0
    eos = np.asarray([tokenizer.eos_id], dtype=np.int32)
    for path in files:
        if read >= max_bytes:
            break
        try:
            text = path.read_bytes()[: max_bytes - read]
        except OSError as exc:
            log.warning("skipping unreadable corpus file %s: %s", path, exc)
            continue
        read += len(text)
        pieces.append(tokenizer.encode(text))
        pieces.append(eos)
    if not pieces:
        raise ValueError(f"the corpus ({len(files)} files from {files[0].parent}) is empty")
    return np.concatenate(pieces)


_MASK64 = (1 << 64) - 1
FEISTEL_ROUNDS = 6


def _mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int: a well-mixed 64-bit key from a small one."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def shuffled_positions(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where a seeded random permutation of [0, n) sends each of `positions`: O(len(positions)) time and memory.

    A permutation materialized per epoch (randperm) costs 8 bytes per sequence, which for a corpus of any size
    is no bound; this one is a Feistel network on the smallest even number of bits covering n, walked back into
    [0, n) (cycle walking keeps it a bijection), keyed by (seed, epoch). Pure: the same on every replica.
    """
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64(_mix64((seed * 1_000_003 + epoch) * 16 + r)) for r in range(FEISTEL_ROUNDS)]
    m1, m2, s30, s27, s31 = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(30),
                             np.uint64(27), np.uint64(31))

    def permute(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & mask
        for key in keys:
            f = right ^ key
            f = (f ^ (f >> s30)) * m1
            f = (f ^ (f >> s27)) * m2
            f = f ^ (f >> s31)
            left, right = right, left ^ (f & mask)
        return (left << half) | right

    out = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.arange(len(out))
    while len(todo):  # values that land in [n, 2^bits) take another turn until they are inside [0, n)
        out[todo] = permute(out[todo])
        todo = todo[out[todo] >= n]
    return out.astype(np.int64)


class ShardedBatches(BatchPosition):
    """Packed next-token batches for one (replica, rank) shard, with resumable state.

    The stream (an array, memory-mapped or not, or a `ShardSet` of token files) is cut into sequences of
    seq_len+1 tokens (inputs and shifted labels). Each epoch visits the sequences in a seeded random order
    (`shuffled_positions`); global batch n of the epoch is split into num_replicas*world_size disjoint shard
    batches of batch_size sequences. Leftover sequences at the end of an epoch are dropped. A batch reads only
    its own windows: memory per batch is O(batch_size * seq_len) whatever the corpus size.
    """

    def __init__(self, tokens: np.ndarray | ShardSet, *, seq_len: int, batch_size: int, seed: int,
                 shard_index: int, num_shards: int):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.shard_index, self.num_shards = shard_index, num_shards
        self.num_sequences = num_sequences = (len(tokens) - 1) // seq_len
        self.batches_per_epoch = num_sequences // (batch_size * num_shards)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"corpus has {len(tokens)} tokens = {num_sequences} sequences of {seq_len}, fewer than one global "
                f"batch ({batch_size} x {num_shards} shards); add data, or lower seq_len/batch_size"
            )
        self._tokens = tokens
        if isinstance(tokens, ShardSet):
            self.fingerprint = tokens.fingerprint
        else:
            self.fingerprint = hashlib.sha256(np.asarray(tokens[: 1 << 20]).tobytes()).hexdigest()[:16] + \
                f":{len(tokens)}"
        self.batches_consumed = 0

    def _windows(self, starts: np.ndarray) -> np.ndarray:
        if isinstance(self._tokens, ShardSet):
            return self._tokens.windows(starts, self.seq_len + 1)
        return np.asarray(self._tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]], dtype=np.int64)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` (0-based, counting from the start of training) of this shard: (inputs, labels)."""
        return self.shard_batch(index, self.shard_index)

    def shard_batch(self, index: int, shard_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` of any shard: a survivor of a smaller quorum covers a missing replica's shard with it
        (`ft.constant_batch`, `regent.train.coverage`)."""
        if not 0 <= shard_index < self.num_shards:
            raise ValueError(f"shard_index {shard_index} not in [0, {self.num_shards})")
        epoch, within = divmod(index, self.batches_per_epoch)
        first = (within * self.num_shards + shard_index) * self.batch_size
        sequence_ids = shuffled_positions(np.arange(first, first + self.batch_size), self.num_sequences, self.seed,
                                          epoch)
        window = torch.from_numpy(self._windows(sequence_ids * self.seq_len))
        return window[:, :-1], window[:, 1:]


def data_kind(data: str | None) -> str:
    """What `--train.data` names: 'builtin' (unset), 'hf' (hf:NAME[:split]), 'shards' (a shard directory), or
    'text' (a glob of text files, tokenized into memory up to data_max_bytes)."""
    from regent.train.shards import is_shard_dir

    if data is None:
        return "builtin"
    if data.startswith("hf:"):
        return "hf"
    return "shards" if is_shard_dir(data) else "text"


def build_batches(data: str | None, tokenizer: Tokenizer, *, seq_len: int, batch_size: int, seed: int,
                  shard_index: int, num_shards: int, max_bytes: int) -> ShardedBatches | HFStreamBatches:
    """The loader for `--train.data`: every kind has the same interface and state (batches consumed)."""
    kind = data_kind(data)
    if kind == "hf":
        assert data is not None
        return HFStreamBatches(data, tokenizer, seq_len=seq_len, batch_size=batch_size, shard_index=shard_index,
                               num_shards=num_shards)
    if kind == "shards":
        assert data is not None
        shards = ShardSet(data)
        shards.check_tokenizer(tokenizer)
        source: np.ndarray | ShardSet = shards
    else:
        source = load_token_stream(data, tokenizer, max_bytes)
    return ShardedBatches(source, seq_len=seq_len, batch_size=batch_size, seed=seed, shard_index=shard_index,
                          num_shards=num_shards)


def check_data(data: str | None, tokenizer: Tokenizer | None, *, seq_len: int, batch_size: int,
               num_shards: int) -> None:
    """Before launch: raise ValueError (one line: the problem and the fix) for data the trainers cannot use.

    Text globs must match files; a shard directory must be complete, its files the sizes and (at both ends) the
    bytes its manifest says, written by the same tokenizer, and hold at least one global batch; `hf:` needs
    `datasets`. `tokenizer` None skips the tokenizer match (it was refused on its own already)."""
    kind = data_kind(data)
    if kind == "text":
        corpus_files(data)
    elif kind == "hf":
        assert data is not None
        from regent.train.hf_stream import check_available

        check_available(data)
    elif kind == "shards":
        assert data is not None
        shards = ShardSet(data)
        shards.verify(full=False)
        if tokenizer is not None:
            shards.check_tokenizer(tokenizer)
        sequences = (len(shards) - 1) // seq_len
        if sequences < batch_size * num_shards:
            raise ValueError(f"shards in {data} hold {len(shards)} tokens = {sequences} sequences of {seq_len}, "
                             f"fewer than one global batch ({batch_size} x {num_shards} shards); add data, or "
                             "lower seq_len/batch_size")
