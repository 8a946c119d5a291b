"""benchmarks/digest_bench.py runs on CPU and reports the three rows (the recorded figures are in RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_digest_bench_runs_on_cpu_and_reports_every_row(tmp_path):
    out = tmp_path / "digest.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/digest_bench.py"), "--model", "debug", "--steps", "2",
         "--repeats", "1", "--warmup", "1", "--device", "cpu", "--threads", "1", "--seq-len", "32",
         "--batch-size", "2", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    names = ("Regent on-device digest", "anchor host sha256 params-only", "anchor host sha256 full state")
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0][2:] for line in table[1:]] == list(names)
    result = json.loads(out.read_text())
    assert [row["name"] for row in result["rows"]] == list(names)
    digest, params, full = result["rows"]
    # the digest and the full-state anchor cover the same bytes: parameters and both AdamW moments (and more)
    assert digest["bytes"] == full["bytes"] == result["state_bytes"] >= 3 * params["bytes"] > 0
    assert result["step_time_s"] > 0 and len(result["digest"]) == 64
    for row in result["rows"]:
        assert row["seconds"] > 0 and row["min_k"] >= 1
        assert set(row["pct_of_k_steps"]) == {"1", "10", "100"}
