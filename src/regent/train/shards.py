"""Pre-tokenized shards: a directory of token files, memory-mapped, of any total size.

Layout of a shard directory (written by `regent data prepare`, `prepare_shards`):

    DST/manifest.json        written last: its presence means the directory is complete
    DST/tokens-00000.bin     raw little-endian uint16 (vocabulary <= 65536) or uint32 tokens, no header
    DST/tokens-00001.bin     ...
    DST/.prepare/            only while `regent data prepare` runs or after it was killed: the resume state

The files hold one token stream, in manifest order: each document's tokens followed by EOS (the same stream the
in-memory loader builds from the same text files with the same tokenizer). A manifest may also name `.npy` files
(one-dimensional, an unsigned integer dtype), memory-mapped the same way.

Nothing here reads the corpus into memory: `ShardSet.windows` reads only the tokens of the requested windows
(O(batch) memory), and `prepare_shards` holds one input chunk at a time.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import mmap
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "regent-tokens"
VERSION = 1
STATE_DIR = ".prepare"
CHUNK_BYTES = 8 << 20  # input read per tokenizer call: bounds prepare's memory
DEFAULT_FILE_TOKENS = 100_000_000  # tokens per output file (200 MB as uint16): the resume granularity
SPOT_BYTES = 1 << 20  # bytes at each end of a file hashed into its spot digest (cheap check before launch)


class ShardError(ValueError):
    """A shard directory, or a request to write one, that cannot be used; the message names the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (half the disk and page cache for vocabularies up to 65536)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def is_shard_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `--train.data` names a shard directory (complete or not) rather than a text glob."""
    p = Path(os.path.expanduser(str(path)))
    return p.is_dir() and ((p / MANIFEST).exists() or (p / STATE_DIR).exists() or any(p.glob("tokens-*.bin")))


def _digest_file(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _spot_digest(path: Path) -> str:
    """blake2b of the size and the first and last SPOT_BYTES: catches truncation and most overwrites in O(1)."""
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(SPOT_BYTES))
        if size > SPOT_BYTES:
            f.seek(max(SPOT_BYTES, size - SPOT_BYTES))
            digest.update(f.read(SPOT_BYTES))
    return digest.hexdigest()


@dataclass(frozen=True)
class ShardFile:
    name: str
    num_tokens: int
    blake2b: str
    spot: str


class ShardSet:
    """The token stream of a shard directory, memory-mapped file by file.

    Opening checks the manifest and each file's size (cheap, every trainer rank does it); `verify(full=True)`
    also hashes every byte (`regent data verify`). A window may span two files.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(os.path.expanduser(str(root)))
        self.manifest = read_manifest(self.root)
        m = self.manifest
        self.dtype = np.dtype(m["dtype"])
        self.vocab_size, self.tokenizer_id = int(m["vocab_size"]), str(m["tokenizer"])
        self.files = [ShardFile(f["name"], int(f["num_tokens"]), f["blake2b"], f["spot"]) for f in m["files"]]
        self._starts = [0]
        for f in self.files:
            self._starts.append(self._starts[-1] + f.num_tokens)
        self.num_tokens = self._starts[-1]
        if self.num_tokens != int(m["num_tokens"]):
            raise ShardError(f"{self.root / MANIFEST}: num_tokens {m['num_tokens']} is not the sum of its files' "
                             f"({self.num_tokens}); the manifest is corrupt: run `regent data prepare` again")
        self._maps: list[np.ndarray | None] = [None] * len(self.files)
        for f in self.files:
            self._check_size(f)
        # names the data exactly (data state and checkpoints compare it): the content digest and the length
        self.fingerprint = f"shards-{m['digest'][:16]}:{self.num_tokens}"

    def _check_size(self, f: ShardFile) -> None:
        path = self.root / f.name
        if not path.is_file():
            raise ShardError(f"shard file {path} named in the manifest is missing; restore it or run "
                             "`regent data prepare` again")
        if path.suffix == ".npy":
            try:
                arr = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise ShardError(f"shard file {path} is not a readable .npy ({exc})") from None
            if arr.ndim != 1 or arr.dtype != self.dtype or len(arr) != f.num_tokens:
                raise ShardError(f"shard file {path} holds {arr.dtype}{list(arr.shape)}, the manifest says "
                                 f"{self.dtype}[{f.num_tokens}]; the manifest does not describe this file")
            return
        expected = f.num_tokens * self.dtype.itemsize
        size = path.stat().st_size
        if size != expected:
            raise ShardError(f"shard file {path} has {size} bytes, the manifest says {expected} "
                             f"({f.num_tokens} x {self.dtype}); it is truncated or replaced: run "
                             "`regent data prepare` again")

    def __len__(self) -> int:
        return self.num_tokens

    def _map(self, i: int) -> np.ndarray:
        arr = self._maps[i]
        if arr is None:
            path = self.root / self.files[i].name
            if path.suffix == ".npy":
                arr = np.load(path, mmap_mode="r")
            elif self.files[i].num_tokens == 0:
                arr = np.zeros(0, dtype=self.dtype)  # mmap refuses an empty file
            else:
                arr = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.files[i].num_tokens,))
                try:  # windows are read at random: no readahead of pages no batch asked for
                    arr._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]
                except (AttributeError, OSError, ValueError):
                    pass
            self._maps[i] = arr
        return arr

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, as int64 (copied out of the page cache)."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside the stream of {self.num_tokens}")
        out = np.empty(length, dtype=np.int64)
        filled, pos = 0, start
        i = bisect.bisect_right(self._starts, pos) - 1
        while filled < length:
            arr = self._map(i)
            lo = pos - self._starts[i]
            take = min(length - filled, len(arr) - lo)
            out[filled: filled + take] = arr[lo: lo + take]
            filled, pos, i = filled + take, pos + take, i + 1
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """A (len(starts), length) int64 array of windows; memory O(len(starts) * length)."""
        return np.stack([self.read(int(s), length) for s in starts]) if len(starts) else \
            np.empty((0, length), dtype=np.int64)

    def head(self, n: int) -> np.ndarray:
        return self.read(0, min(n, self.num_tokens))

    def verify(self, full: bool = False, progress: Callable[[int], None] | None = None) -> None:
        """Raise ShardError naming the first file whose bytes differ from the manifest's digest: the spot digest
        (both ends of every file, O(files)), or with `full` every byte. `progress(bytes)` is told as files end."""
        for f in self.files:
            path = self.root / f.name
            if _spot_digest(path) != f.spot or (full and _digest_file(path) != f.blake2b):
                raise ShardError(f"shard file {path} does not match its checksum in {self.root / MANIFEST}; it "
                                 "was changed or damaged: run `regent data prepare` again")
            if progress is not None:
                progress(path.stat().st_size)

    def check_tokenizer(self, tokenizer: Any, option: str = "--train.tokenizer") -> None:
        """Refuse a tokenizer other than the one the shards were written with (ids would mean other text)."""
        if tokenizer.cache_id() != self.tokenizer_id or int(tokenizer.vocab_size) != self.vocab_size:
            made = self.manifest.get("tokenizer_path") or ("the byte tokenizer" if self.tokenizer_id == "bytes-1"
                                                           else self.tokenizer_id)
            given = "the byte tokenizer" if tokenizer.cache_id() == "bytes-1" else tokenizer.cache_id()
            raise ShardError(f"shards in {self.root} were tokenized with {made} (vocab {self.vocab_size}) but "
                             f"{option} gives {given} (vocab {tokenizer.vocab_size}); pass the tokenizer used by "
                             "`regent data prepare`")


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a complete shard directory, or ShardError saying what is wrong with the directory."""
    path = root / MANIFEST
    if not root.exists():
        raise ShardError(f"shard directory {root} does not exist; create it with `regent data prepare SRC {root}`")
    if not path.is_file():
        if (root / STATE_DIR).exists():
            raise ShardError(f"{root} is a half-written shard directory (`regent data prepare` did not finish); "
                             "run the same `regent data prepare` command again to resume it")
        raise ShardError(f"{root} has no {MANIFEST}: not a Regent shard directory; create one with "
                         f"`regent data prepare SRC {root}`")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardError(f"{path} is not valid JSON ({exc}); the manifest is corrupt: run `regent data prepare` "
                         "again") from None
    need = ("format", "version", "dtype", "vocab_size", "tokenizer", "num_tokens", "files", "digest")
    if not isinstance(m, dict) or any(k not in m for k in need) or m["format"] != FORMAT:
        raise ShardError(f"{path} is not a {FORMAT} manifest (needs {', '.join(need)}); run `regent data prepare` "
                         "again")
    if m["version"] != VERSION:
        raise ShardError(f"{path} has format version {m['version']}; this Regent reads version {VERSION}")
    if m["dtype"] not in ("uint16", "uint32"):
        raise ShardError(f"{path}: dtype {m['dtype']!r} is not uint16 or uint32")
    if not isinstance(m["files"], list) or any(
            not isinstance(f, dict) or not {"name", "num_tokens", "blake2b", "spot"} <= set(f) for f in m["files"]):
        raise ShardError(f"{path}: every entry of files needs name, num_tokens, blake2b and spot")
    return m


# ------------------------------------------------------------------------------------------------ prepare
@dataclass
class Cursor:
    """Where prepare stands in its input: document `doc` (a file, or a dataset row), byte `offset` into it."""
    doc: int = 0
    offset: int = 0


class TextSource:
    """Text files as documents (one file, one document), read in chunks cut after a newline."""

    def __init__(self, src: str):
        self.src = src
        path = Path(os.path.expanduser(src))
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif path.is_file():
            files = [path]
        else:
            files = sorted(Path(p) for p in glob.glob(os.path.expanduser(src), recursive=True) if Path(p).is_file())
        if not files:
            raise ShardError(f"{src!r} matched no files; pass a text file, a directory or a quoted glob")
        self.files = files
        self.total_bytes = sum(p.stat().st_size for p in files)
        if self.total_bytes == 0:
            raise ShardError(f"{src!r}: its {len(files)} file(s) are all empty; there is nothing to tokenize")

    def identity(self) -> dict[str, Any]:
        """Changes when an input does: a resumed prepare refuses inputs other than those it started on."""
        digest = hashlib.blake2b(digest_size=16)
        for p in self.files:
            st = p.stat()
            digest.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        return {"kind": "text", "src": self.src, "files": len(self.files), "bytes": self.total_bytes,
                "digest": digest.hexdigest()}

    def done_bytes(self, cursor: Cursor) -> int:
        return sum(p.stat().st_size for p in self.files[: cursor.doc]) + cursor.offset

    def chunks(self, cursor: Cursor) -> Iterator[tuple[bytes, bool, Cursor]]:
        """(text, ends_document, cursor after it), starting at `cursor`."""
        for doc in range(cursor.doc, len(self.files)):
            offset = cursor.offset if doc == cursor.doc else 0
            with open(self.files[doc], "rb") as f:
                f.seek(offset)
                carry = b""
                while True:
                    block = f.read(CHUNK_BYTES)
                    if not block:
                        yield carry, True, Cursor(doc + 1, 0)
                        break
                    data = carry + block
                    cut = data.rfind(b"\n") + 1  # whole lines per tokenizer call when there are any
                    if cut == 0 and len(data) < 4 * CHUNK_BYTES:
                        carry = data
                        continue
                    cut = cut or len(data)  # a line longer than 4 chunks is cut where the chunk ends
                    carry = data[cut:]
                    yield data[:cut], False, Cursor(doc, f.tell() - len(carry))


class HFSource:
    """The rows of a Hugging Face dataset, streamed (`datasets`, optional), one row one document."""

    def __init__(self, spec: str, column: str | None = None):
        from regent.train.hf_stream import open_stream, parse_hf

        self.name, self.split = parse_hf(spec)
        self.src, self.column = spec, column
        self._open = open_stream
        self.total_bytes = 0  # unknown ahead of time

    def identity(self) -> dict[str, Any]:
        return {"kind": "hf", "src": self.src, "name": self.name, "split": self.split}

    def done_bytes(self, cursor: Cursor) -> int:
        return 0

    def chunks(self, cursor: Cursor) -> Iterator[tuple[bytes, bool, Cursor]]:
        rows = self._open(self.name, self.split, skip=cursor.doc, column=self.column)
        for i, text in enumerate(rows, start=cursor.doc):
            yield text.encode("utf-8"), True, Cursor(i + 1, 0)


def _source(src: str) -> TextSource | HFSource:
    return HFSource(src) if src.startswith("hf:") else TextSource(src)


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_shards(src: str, dst: str, tokenizer: Any, *, tokenizer_path: str | None = None,
                   file_tokens: int = DEFAULT_FILE_TOKENS, force: bool = False,
                   progress: bool | None = None) -> dict[str, Any]:
    """Tokenize `src` (text files: a file, a directory, a glob; or `hf:NAME[:split]`) into a shard directory.

    Streaming: one input chunk in memory at a time. Atomic: each output file is written under a temporary name,
    synced and renamed; the resume state (`.prepare/state.json`) is replaced after each file; the manifest comes
    last. Killed at any point, the same command resumes after the last finished file (the inputs must be
    unchanged: a changed input is refused). Returns the manifest.
    """
    if file_tokens <= 0:
        raise ShardError(f"--file-tokens must be positive, got {file_tokens}")
    source = _source(src)
    root = Path(os.path.expanduser(dst))
    state_dir = root / STATE_DIR
    dtype = token_dtype(tokenizer.vocab_size)
    params = {"source": source.identity(), "tokenizer": tokenizer.cache_id(), "vocab_size": tokenizer.vocab_size,
              "dtype": dtype.name, "file_tokens": file_tokens}
    if root.exists() and not root.is_dir():
        raise ShardError(f"{root} exists and is not a directory; choose another DST")
    if (root / MANIFEST).exists() and not force:
        try:
            done = read_manifest(root)
        except ShardError:
            done = None
        if done is not None and done.get("source") == params["source"] and done["tokenizer"] == params["tokenizer"] \
                and done.get("file_tokens", file_tokens) == file_tokens:
            shutil.rmtree(state_dir, ignore_errors=True)  # killed between the manifest and this cleanup
            return {**done, "already_prepared": True}  # the same command again: already done
    if (root / MANIFEST).exists():
        if not force:
            raise ShardError(f"{root} already holds prepared shards; pass --force to overwrite them, or choose "
                             "another DST")
        shutil.rmtree(root)
    state: dict[str, Any] | None = None
    if state_dir.exists():
        try:
            state = json.loads((state_dir / "state.json").read_text())
        except (OSError, ValueError):
            state = None  # killed before the first state was written: nothing finished, start over
        if state is not None and state.get("params") != params and not force:
            raise ShardError(f"{root} is a half-written shard directory from other inputs or settings "
                             f"({state.get('params')}); re-run that command to resume it, or pass --force to "
                             "start over")
        if state is not None and state.get("params") != params:
            state = None
    elif root.exists() and any(root.iterdir()):
        if not force:
            raise ShardError(f"{root} is not empty and not a Regent shard directory; choose an empty or new DST "
                             "(or --force to replace its contents)")
        shutil.rmtree(root)
    state_dir.mkdir(parents=True, exist_ok=True)
    if state is None:
        for stale in root.glob("tokens-*"):
            stale.unlink()
        state = {"params": params, "files": [], "cursor": [0, 0], "documents": 0}
        _write_json(state_dir / "state.json", state)
    files: list[dict[str, Any]] = state["files"]
    for entry in files:  # finished files must be intact; anything after them is a partial write
        path = root / entry["name"]
        if not path.is_file() or path.stat().st_size != entry["num_tokens"] * dtype.itemsize \
                or _spot_digest(path) != entry["spot"]:
            raise ShardError(f"{path} was finished by an earlier run but is missing or changed; pass --force to "
                             "prepare from scratch")
    finished = {e["name"] for e in files}
    for stale in root.glob("tokens-*"):
        if stale.name not in finished:
            stale.unlink()
    cursor = Cursor(*state["cursor"])
    documents = int(state["documents"])
    resumed = bool(files)

    bar = _Progress(source.total_bytes, enabled=sys.stderr.isatty() if progress is None else progress)
    bar.start(source.done_bytes(cursor), sum(e["num_tokens"] for e in files), resumed)
    eos = np.asarray([tokenizer.eos_id], dtype=dtype)
    out: _OutFile | None = None
    try:
        for text, ends_doc, after in source.chunks(cursor):
            if out is None:
                out = _OutFile(root, len(files), dtype)
            ids = tokenizer.encode(text) if text else np.zeros(0, dtype=np.int64)
            if len(ids) and (int(ids.max()) >= tokenizer.vocab_size or int(ids.min()) < 0):
                raise ShardError(f"the tokenizer produced id {int(ids.max())} outside its vocabulary "
                                 f"({tokenizer.vocab_size}); it is inconsistent")
            out.write(ids.astype(dtype, copy=False))
            if ends_doc:
                out.write(eos)
                documents += 1
            bar.advance(source.done_bytes(after) if source.total_bytes else 0, len(ids) + int(ends_doc))
            if out.count >= file_tokens:
                files.append(out.finish())
                out = None
                state.update(files=files, cursor=[after.doc, after.offset], documents=documents)
                _write_json(state_dir / "state.json", state)
        if out is not None and out.count:
            files.append(out.finish())
        elif out is not None:
            out.discard()
    finally:
        bar.stop()
    total = sum(e["num_tokens"] for e in files)
    if total == 0 or documents == 0:
        raise ShardError(f"{src!r} gave no tokens; there is nothing to train on")
    digest = hashlib.blake2b(digest_size=16)
    for e in files:
        digest.update(f"{e['name']}\0{e['num_tokens']}\0{e['blake2b']}\0".encode())
    manifest = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab_size": int(tokenizer.vocab_size),
                "tokenizer": tokenizer.cache_id(), "tokenizer_path": tokenizer_path,
                "bos_id": int(tokenizer.bos_id), "eos_id": int(tokenizer.eos_id), "num_tokens": total,
                "num_documents": documents, "file_tokens": file_tokens, "files": files, "digest": digest.hexdigest(),
                "source": params["source"]}
    _write_json(root / MANIFEST, manifest)
    shutil.rmtree(state_dir)
    return manifest


class _OutFile:
    """One output file being written: `.tmp` until `finish` syncs, hashes and renames it."""

    def __init__(self, root: Path, index: int, dtype: np.dtype):
        self.path = root / f"tokens-{index:05d}.bin"
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.dtype, self.count = dtype, 0
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - open across write() calls; finish/discard close it
        self._digest = hashlib.blake2b(digest_size=16)

    def write(self, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, dtype=self.dtype.newbyteorder("<")).tobytes()
        self._f.write(data)
        self._digest.update(data)
        self.count += len(ids)

    def finish(self) -> dict[str, Any]:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        return {"name": self.path.name, "num_tokens": self.count, "blake2b": self._digest.hexdigest(),
                "spot": _spot_digest(self.path)}

    def discard(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


class _Progress:
    """A rich progress bar over input bytes (or documents for a dataset of unknown size), tokens and rate."""

    def __init__(self, total_bytes: int, enabled: bool):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.enabled = enabled
        columns: list[Any] = [TextColumn("[bold]tokenizing"), BarColumn()]
        columns += [DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()] if total_bytes else \
            [MofNCompleteColumn()]
        columns += [TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn()]
        self._progress = Progress(*columns, disable=not enabled, transient=False)
        self._task = self._progress.add_task("prepare", total=total_bytes or None, tokens=0)
        self.tokens = 0

    def start(self, done_bytes: int, tokens: int, resumed: bool) -> None:
        self.tokens = tokens
        self._progress.update(self._task, completed=done_bytes, tokens=tokens)
        if resumed and self.enabled:
            self._progress.console.print(f"resuming after {tokens:,} tokens already written")
        self._progress.start()

    def advance(self, done_bytes: int, tokens: int) -> None:
        self.tokens += tokens
        if done_bytes:
            self._progress.update(self._task, completed=done_bytes, tokens=self.tokens)
        else:
            self._progress.update(self._task, advance=1, tokens=self.tokens)

    def stop(self) -> None:
        self._progress.stop()
