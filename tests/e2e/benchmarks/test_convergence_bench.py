"""benchmarks/convergence_bench.py end to end at smoke size (`long`, ~3 min on 2 cores): three real `regent train`
runs (two fault-free seeds, one with faults), the comparison table and figure, `regent check` holding on every
run (the sample ledger included), and the faulted run's report showing the figure. Not timing: the figures of a
full-size run are in RESULTS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[3]


def test_convergence_bench_smoke_produces_the_table_and_every_run_checks(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/convergence_bench.py"), "--duration", "45s", "--fault-every", "8s",
         "--rows", "4", "--out", str(out), "--faults.warmup", "5s", "--faults.holdoff", "5s"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((out / "convergence.json").read_text())
    runs = {r["run"]: r for r in record["runs"]}
    assert list(runs) == ["fault-free seed A", "fault-free seed B", "faults every 8s"]
    assert all(r["check"] == "holds" and r["exit"] == 0 for r in runs.values()), runs
    assert runs["faults every 8s"]["faults_injected"] >= 1
    assert all(r["samples_skipped"] == 0 for r in runs.values())  # a constant global batch skips nothing
    rows = record["comparison"]["rows"]
    assert len(rows) == 4 and all(r["noise"] >= 0 and r["faults every 8s"]["gap"] is not None for r in rows)
    table = (out / "convergence.md").read_text()
    assert "| samples | loss seed A | loss seed B | noise band |" in table and "within noise at" in table
    assert (out / "convergence.png").stat().st_size > 10_000
    faulted = out / "runs" / "faults-8s"
    assert "Convergence against fault-free runs" in (faulted / "report.html").read_text()
    assert (faulted / "convergence.png").exists() and (faulted / "check.txt").read_text().strip().endswith("holds")
