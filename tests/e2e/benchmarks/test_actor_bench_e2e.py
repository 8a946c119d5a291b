"""The actor benchmark's own logic (stats, targets, profile summaries) and one real Regent smoke run: the
cases that start processes (the others: tests/unit/benchmarks/test_actor_bench.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.unit.benchmarks.test_actor_bench import REPO


@pytest.mark.slow
def test_regent_smoke_run_writes_numbers(tmp_path):
    out = tmp_path / "actor.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "actor_bench.py"), "--quick", "--runtimes", "regent",
         "--only", "call_one,broadcast", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads(out.read_text())
    results = record["runs"]["regent"]["results"]
    assert set(results) == {"call_one", "broadcast"}
    assert results["call_one"]["median_ms"] > 0 and results["call_one"]["n"] == 200
    assert results["broadcast"]["median"] > 0  # the count check inside passed
    assert "monarch" not in record["runs"]
    assert "call_one round trip, median" in proc.stdout


@pytest.mark.slow
def test_stage_breakdown_runs_against_the_current_runtime():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "actor_bench.py"), "--stages", "--quick"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    total = [line for line in proc.stdout.splitlines() if line.startswith("total")]
    assert total, proc.stdout
    sync_us, async_us = (float(x) for x in total[0].split()[1:3])
    assert sync_us > 0 and async_us > 0
