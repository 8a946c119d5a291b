"""The GPU benchmark scripts' own logic, and one CPU run of the step profiler (the GPU runs are in RESULTS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))  # the scripts import their `_common` as a sibling
spec = importlib.util.spec_from_file_location("profile_step_under_test", REPO / "benchmarks/gpu/profile_step.py")
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


def test_busy_time_counts_overlapping_streams_once():
    assert profile_step.busy_seconds([]) == 0
    # two streams overlapping on [2, 3), one interval inside another, a gap between 5 and 6
    intervals = [(0.0, 3.0), (2.0, 5.0), (2.5, 4.0), (6.0, 7.0)]
    assert profile_step.busy_seconds(intervals) == 6.0
    assert profile_step.busy_seconds(list(reversed(intervals))) == 6.0


def test_profile_step_runs_on_cpu_and_records_a_trace(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/gpu/profile_step.py"), "--model", "debug", "--gpus", "1",
         "--batch-size", "2", "--seq-len", "32", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert record["bench"] == "profile_step" and record["wall_s_per_step"] > 0
    assert (tmp_path / "trace_debug_g1_b2.json.gz").stat().st_size > 0
