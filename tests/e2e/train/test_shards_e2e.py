"""Pre-tokenized shards: prepare -> memory-mapped load, the same batches as the in-memory path, exact resume,
one clear line for bad input, and a `regent data prepare` killed with SIGKILL then run again: the cases that
start processes (the others: tests/unit/train/test_shards.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from regent.train.data import (
    ByteTokenizer,
)
from regent.train.shards import ShardError, ShardSet, prepare_shards

SRC = str(Path(__file__).resolve().parents[3] / "src")


def run_prepare(src: str, dst: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.Popen([sys.executable, "-m", "regent.cli", "data", "prepare", src, str(dst), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_prepare_killed_midway_resumes_to_the_same_shards(tmp_path):
    """SIGKILL `regent data prepare` after it finished some files: the directory is refused as half-written,
    and the same command finishes it to exactly the shards of an uninterrupted run."""
    corpus = tmp_path / "text"
    corpus.mkdir()
    rng = np.random.default_rng(1)
    for i in range(60):  # 60 documents of 256 KiB; every document closes a token file (--file-tokens 1)
        (corpus / f"{i:04d}.txt").write_bytes(rng.integers(32, 127, size=256 << 10, dtype=np.uint8).tobytes())
    dst = tmp_path / "killed"
    proc = run_prepare(str(corpus), dst, "--file-tokens", "1")
    state = dst / ".prepare" / "state.json"
    done = 0
    while proc.poll() is None and done < 3:
        try:
            done = len(json.loads(state.read_text())["files"])
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    assert proc.poll() is None, "prepare finished before it could be killed; make the corpus larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (dst / "manifest.json").exists()
    with pytest.raises(ShardError, match="half-written shard directory .* run the same `regent data prepare`"):
        ShardSet(dst)
    with pytest.raises(ShardError, match="from other inputs or settings"):
        prepare_shards(str(corpus), str(dst), ByteTokenizer(), file_tokens=2, progress=False)

    again = run_prepare(str(corpus), dst, "--file-tokens", "1")
    out, err = again.communicate()
    assert again.returncode == 0, err
    reference = run_prepare(str(corpus), tmp_path / "reference", "--file-tokens", "1")
    assert reference.wait() == 0
    killed = json.loads((dst / "manifest.json").read_text())
    whole = json.loads((tmp_path / "reference" / "manifest.json").read_text())
    assert killed["digest"] == whole["digest"] and killed["num_tokens"] == 60 * (256 << 10) + 60
    assert not (dst / ".prepare").exists() and not list(dst.glob("*.tmp"))
    ShardSet(dst).verify(full=True)
