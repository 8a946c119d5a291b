"""Data: a corpus that needs no download, a tokenizer, sequence packing and a resumable sharded loader.

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
import warnings
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

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
    configured = os.environ.get("REGENT_TOKEN_CACHE")
    if configured is not None:
        return None if configured.lower() in ("", "0", "off", "none") else Path(configured).expanduser()
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


class ShardedBatches:
    """Packed next-token batches for one (replica, rank) shard, with resumable state.

    The stream is cut into sequences of seq_len+1 tokens (inputs and shifted labels). Each epoch visits the
    sequences in a seeded random order; global batch n of the epoch is split into num_replicas*world_size
    disjoint shard batches of batch_size sequences. Leftover sequences at the end of an epoch are dropped.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int,
                 shard_index: int, num_shards: int):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.shard_index, self.num_shards = shard_index, num_shards
        num_sequences = (len(tokens) - 1) // seq_len
        self.batches_per_epoch = num_sequences // (batch_size * num_shards)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"corpus has {len(tokens)} tokens = {num_sequences} sequences of {seq_len}, fewer than one global "
                f"batch ({batch_size} x {num_shards} shards); add data, or lower seq_len/batch_size"
            )
        with warnings.catch_warnings():  # a memory-mapped stream is read-only, and batches only ever read it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self._tokens = torch.from_numpy(np.ascontiguousarray(tokens[: num_sequences * seq_len + 1]))
        self.fingerprint = hashlib.sha256(tokens[: 1 << 20].tobytes()).hexdigest()[:16] + f":{len(tokens)}"
        self.batches_consumed = 0
        self._order_epoch = -1
        self._order: torch.Tensor | None = None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            num_sequences = (len(self._tokens) - 1) // self.seq_len
            self._order = torch.randperm(num_sequences, generator=generator)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` (0-based, counting from the start of training) of this shard: (inputs, labels)."""
        epoch, within = divmod(index, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        first = (within * self.num_shards + self.shard_index) * self.batch_size
        sequence_ids = order[first: first + self.batch_size]
        starts = sequence_ids * self.seq_len
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self._tokens[offsets].long()
        return window[:, :-1], window[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.batch(self.batches_consumed)
        self.batches_consumed += 1
        return result

    def state_dict(self) -> dict:
        return {"batches_consumed": self.batches_consumed, "fingerprint": self.fingerprint,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "num_shards": self.num_shards}

    def check_compatible(self, state: dict) -> None:
        """Raise ValueError if `state` was produced by a loader over different data or a different layout."""
        for key in ("fingerprint", "seq_len", "batch_size", "num_shards"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data state mismatch: checkpoint has {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}; resume with the same data, seq_len, batch_size and replica/rank layout"
                )

    def load_state_dict(self, state: dict) -> None:
        self.check_compatible(state)
        self.batches_consumed = int(state["batches_consumed"])
