"""How Regent knows a file on disk is the one it wrote: the sha256 of a file, and the sha256 a JSON record keeps
of itself. Shared by the durable backstop (`regent.ft.backstop`), DCP checkpoints (`regent.train.checkpoint`) and
the checkpoint-restart baseline (`regent.orchestrate.session`), which all refuse, by name, state whose bytes or
record do not check out instead of loading it (no torch, no actors: hashlib and json only).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

# Read in blocks this large: big enough that hashing a multi-GB checkpoint is not call-bound, small enough to
# keep memory flat.
_BLOCK = 1 << 22


def file_sha256(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def self_digest(record: dict[str, Any], key: str) -> str:
    """The sha256 a record keeps of itself under `key`: of the canonical JSON (sorted keys, no spaces) of every
    other field, so any edit or damage to the record is seen before anything it describes is trusted."""
    body = {k: v for k, v in record.items() if k != key}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
