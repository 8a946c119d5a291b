"""`benchmarks/control_plane_sim.py --only round --round-clients 2` at a small size: a real Lighthouse with a front
end, joins sent by two client processes over connections warmed by one heartbeat each, every call answered in
every round. Counts and fields, not time: the times are the benchmark's to measure (RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.unit.benchmarks.test_actor_bench import REPO


@pytest.mark.slow
@pytest.mark.parametrize("cold", [False, True])
def test_round_rows_from_two_client_processes(tmp_path, cold):
    out = tmp_path / "round.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "control_plane_sim.py"), "--only", "round", "--round-groups",
           "48", "--rounds", "2", "--frontends", "1", "--round-clients", "2", "--full-up-to", "0", "--no-torchft",
           "--round-heartbeat-timeout-ms", "60000", "--out", str(out)] + (["--round-cold"] if cold else [])
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text()) if r["section"] == "round"]
    (row,) = rows
    assert "error" not in row, row
    assert (row["groups"], row["clients"], row["frontends"], row["warm"]) == (48, 2, 1, not cold)
    assert len(row["all_after_last_join_ms"]) == len(row["all_wall_ms"]) == 2
    assert 0 <= row["after_last_join_ms"] <= row["wall_ms"]
    assert row["bytes_per_answer"] > 0 and row["owner_cpu_ms"] > 0
