"""`benchmarks/control_plane_sim.py --only owner` on a small round: the front ends' pre-decoded frames through a
real owner link handler, answered to the last call (with and without a job secret). Counts, not time: its speed is
the benchmark's to measure."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_owner_benchmark_answers_every_call_of_its_rounds() -> None:
    spec = importlib.util.spec_from_file_location("control_plane_sim", REPO / "benchmarks" / "control_plane_sim.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["control_plane_sim"] = bench
    spec.loader.exec_module(bench)
    for secret in (False, True):
        (row,) = bench.owner_join_rows([48], rounds=2, batch=5, secret=secret, tune=False)
        assert (row["groups"], row["batch"], row["secret"], len(row["all_ms"])) == (48, 5, secret, 2)
