"""Memory of the data path at a corpus size that memory would not comfortably hold: `regent data prepare` over a
few hundred MB of text, then the memory-mapped loader reading batches spread over the whole corpus.

Each phase runs in its own process; its peak RSS comes from wait4 (ru_maxrss), and the loader also reports its
anonymous (private) and file-backed (page cache, reclaimable) resident memory from /proc/self/status. The
baseline is a process that only imports the same modules, so "growth" is what the data path itself adds.

    python benchmarks/data_bench.py --mb 300 [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SRC = str(Path(__file__).resolve().parents[1] / "src")

LOADER = r"""
import json, sys, time
import numpy as np
def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out
from regent.train.data import ByteTokenizer, build_batches
before = status()
start = time.perf_counter()
loader = build_batches(sys.argv[1], ByteTokenizer(), seq_len=1024, batch_size=8, seed=0, shard_index=1,
                       num_shards=2, max_bytes=1)
opened = time.perf_counter() - start
count = int(sys.argv[2])
indices = np.linspace(0, 3 * loader.batches_per_epoch, count).astype(int)  # spread over three epochs
start = time.perf_counter()
for n in indices:
    inputs, labels = loader.batch(int(n))
elapsed = time.perf_counter() - start
after = status()
print(json.dumps({"before": before, "after": after, "open_s": opened, "batches": count, "batch_ms": 1e3 * elapsed / count,
                  "batches_per_epoch": loader.batches_per_epoch, "tokens": len(loader._tokens)}))
"""

BASELINE = "import regent.train.data, regent.train.commands, rich.progress"


def run(args: list[str]) -> tuple[int, int, str, float]:
    """(exit code, peak RSS in bytes, stdout, seconds) of a child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, env=dict(os.environ, PYTHONPATH=SRC, REGENT_TOKEN_CACHE="off"),
                            stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024, out, time.perf_counter() - start


def make_corpus(root: Path, mb: int, file_mb: int = 16) -> int:
    """`mb` MiB of word text in files of `file_mb` MiB, written a block at a time (bounded memory)."""
    rng = np.random.default_rng(0)
    text = b"the of and to in is for that with as on by at from data shard token memory replica heal step batch quorum\n"
    words = np.array(text.split())
    words[-1] += b"\n"
    root.mkdir(parents=True, exist_ok=True)
    written, index = 0, 0
    while written < mb << 20:
        with open(root / f"part-{index:04d}.txt", "wb") as f:
            for _ in range(file_mb):
                block = b" ".join(rng.choice(words, size=200_000))[: 1 << 20]
                f.write(block)
                written += len(block)
        index += 1
    return written


def bench(mb: int, workdir: Path, batches: int = 2000) -> dict[str, Any]:
    corpus, shards = workdir / "text", workdir / "shards"
    text_bytes = make_corpus(corpus, mb)
    py = sys.executable
    code, base_rss, _, _ = run([py, "-c", BASELINE])
    assert code == 0
    code, prep_rss, out, prep_s = run([py, "-m", "regent.cli", "data", "prepare", str(corpus), str(shards),
                                       "--no-progress"])
    assert code == 0, out
    shard_bytes = sum(p.stat().st_size for p in shards.glob("tokens-*.bin"))
    code, load_rss, out, _ = run([py, "-c", LOADER, str(shards), str(batches)])
    assert code == 0, out
    loaded = json.loads(out)
    return {
        "text_mb": text_bytes / 2**20, "shard_mb": shard_bytes / 2**20, "shard_files": len(list(shards.glob("*.bin"))),
        "prepare_s": prep_s, "prepare_mb_per_s": text_bytes / 2**20 / prep_s,
        "baseline_peak_rss_mb": base_rss / 2**20, "prepare_peak_rss_mb": prep_rss / 2**20,
        "prepare_growth_mb": (prep_rss - base_rss) / 2**20,
        "loader_peak_rss_mb": load_rss / 2**20,
        "loader_anon_growth_mb": (loaded["after"]["RssAnon"] - loaded["before"]["RssAnon"]) / 2**20,
        "loader_file_rss_mb": loaded["after"]["RssFile"] / 2**20,
        "loader_open_s": loaded["open_s"], "loader_batch_ms": loaded["batch_ms"], "batches": loaded["batches"],
        "in_memory_int32_mb": loaded["tokens"] * 4 / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="MiB of text to make (default 300)")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temp dir)")
    args = parser.parse_args()
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="regent-data-bench-"))
    try:
        result = bench(args.mb, workdir, args.batches)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
