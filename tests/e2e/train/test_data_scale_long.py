"""Data at real scale (`long`): 300 MiB of text through `regent data prepare` and the memory-mapped loader, with
memory bounded by the chunk and the batch, not the corpus (benchmarks/data_bench.py; numbers in RESULTS.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.long


def test_prepare_and_load_300_mib_in_bounded_memory(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "data_bench", Path(__file__).resolve().parents[3] / "benchmarks" / "data_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.bench(300, tmp_path, batches=2000)
    assert result["shard_mb"] > 550  # 300 MiB of bytes as uint16 tokens
    # prepare holds one 8 MiB chunk and its tokens; the in-memory path would hold the whole stream as int32
    assert result["prepare_growth_mb"] < 160 < result["in_memory_int32_mb"]
    # the loader's private memory does not grow with the corpus; the mapped pages it touched are page cache
    assert result["loader_anon_growth_mb"] < 64
