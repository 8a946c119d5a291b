"""benchmarks/lighthouse_outage.py's figures, on a synthetic run directory (the runs themselves: RESULTS.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("lighthouse_outage_under_test", REPO / "benchmarks" / "lighthouse_outage.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)


def test_the_gap_across_a_kill_is_measured_from_each_steps_first_commit(tmp_path, monkeypatch):
    def commit(t: float, replica: int, step: int) -> dict:
        return {"time": t, "kind": "commit", "replica": replica, "step": step, "committed": True}

    # three replicas commit steps 10, 20, 30, 40 two seconds apart (each a little after the first); the
    # Lighthouse is killed at 4.5 and step 30 comes 3 s late
    events = [{"time": 0.0, "kind": "run_started"}]
    for step, t in ((10, 2.0), (20, 4.0), (30, 9.0), (40, 11.0)):
        events += [commit(t + 0.05 * r, r, step) for r in range(3)]
    events.append({"time": 4.5, "kind": "fault_injected", "fault_kind": "lighthouse", "replica": None})
    events.append({"time": 4.6, "kind": "commit", "replica": 0, "step": 29, "committed": False})
    # each replica's group ranks built their groups once at the start; replica 1's rank 0 rebuilt after the kill
    events += [{"time": 1.0, "kind": "quorum", "replica": r, "rank": k} for r in range(3) for k in range(2)]
    events.append({"time": 8.0, "kind": "quorum", "replica": 1, "rank": 0})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "summary.json").write_text(json.dumps({"global_committed_step": 40, "steps_without_lighthouse": 0,
                                                       "max_stall_seconds": 5.0}))
    (tmp_path / "metrics.jsonl").write_text("")
    seen = []
    # the checker has its own tests; here only the figures (and that it is asked about this run)
    monkeypatch.setattr("regent.orchestrate.invariants.check_run", lambda run_dir: seen.append(run_dir) or [])
    f = bench.figures(tmp_path)
    assert seen == [tmp_path]
    assert f["lighthouse_faults"] == 1
    assert f["gap_around_fault_p50"] == pytest.approx(5.0)  # step 20 at 4.0 -> step 30 at 9.0
    assert f["usual_gap_p50"] == pytest.approx(2.0)  # 2, 5, 2: not the 0.05 s between replicas of one step
    assert f["global_step"] == 40 and f["violations"] == []
    assert f["rebuilds_after_first"] == 1
