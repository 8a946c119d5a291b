"""Adaptive hang detection, the chaos fault kinds (straggler, correlated, lighthouse), and the run's own
failure paths: pure tests first, then one real run with a Lighthouse kill and a hang: the cases that start
processes (the others: tests/unit/orchestrate/test_hang_and_chaos.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regent.orchestrate.run import RUN_MARKER_ENV, leaked_processes


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_leaked_processes_are_found_by_the_run_marker():
    marker = f"test-{os.getpid()}-{time.time()}"
    env = dict(os.environ, **{RUN_MARKER_ENV: marker})
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        assert leaked_processes(marker, grace_s=0.5) == [child.pid]
        assert leaked_processes("another-run", grace_s=0) == []
    finally:
        child.kill()
        child.wait()
    assert leaked_processes(marker, grace_s=0) == []


# -- one real run: the Lighthouse killed and restarted, then a hang ---------------------------------------------

LIGHTHOUSE_AT, HANG_AT = 12, 27  # the Lighthouse is back ~3 s after its kill


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_training_survives_lighthouse_kill_and_quick_hang_detection(tmp_path):
    sched = tmp_path / "faults.jsonl"
    sched.write_text(json.dumps({"at": LIGHTHOUSE_AT, "kind": "lighthouse"}) + "\n"
                     + json.dumps({"at": HANG_AT, "replica": 1, "kind": "hang", "rank": 0}) + "\n")
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "regent.cli", "train", "--replicas", "2", "--procs-per-replica", "1",
         "--model", "debug", "--no-live", "--duration", "45s", "--run-dir", str(run_dir), "--faults-file", str(sched),
         "--ft.sync-every", "5", "--train.seq-len", "64", "--train.batch-size", "4", "--ft.timeout-s", "10",
         "--ft.quorum-timeout-s", "120", "--lighthouse.join-timeout-ms", "10000",
         "--lighthouse.heartbeat-timeout-ms", "3000"],
        env=env, capture_output=True, text=True, timeout=380,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    faults = {json.loads(x)["kind"]: json.loads(x) for x in (run_dir / "faults.jsonl").read_text().splitlines()}
    assert faults["lighthouse"]["replica"] is None and faults["lighthouse"]["replicas"] == []
    assert faults["hang"]["replica"] == 1 and faults["hang"]["replicas"] == [1]

    def committed_after(t: float, replica: int | None = None) -> list[dict]:
        return [m for m in metrics if m["time"] > t and m.get("committed", True)
                and (replica is None or m["replica"] == replica)]

    # the Lighthouse: killed, started again on the same address, and quorums went on with increasing ids
    lh = next(e for e in events if e["kind"] == "fault_injected" and e["fault_kind"] == "lighthouse")
    assert lh["replica"] is None and lh["replicas"] == []
    restarted = [e for e in events if e["kind"] == "lighthouse_restarted" and e["time"] > lh["time"]]
    assert restarted and restarted[0]["cause"] == "injected", "the Lighthouse was not started again"
    address = next(line for line in proc.stdout.splitlines() if "Lighthouse http" in line).split()[2]
    assert restarted[0]["address"] == address
    ids_before = [e["quorum_id"] for e in events if e["kind"] == "quorum" and e["time"] < lh["time"]]
    ids_after = [e["quorum_id"] for e in events if e["kind"] == "quorum" and e["time"] > restarted[0]["time"]]
    assert ids_after and min(ids_after) > max(ids_before), "quorum ids went back after the Lighthouse restart"
    for r in (0, 1):
        assert len(committed_after(restarted[0]["time"], r)) >= 3, f"replica {r} stopped after the Lighthouse kill"
    # ... and while it was down, both replicas kept their last quorum and went on committing (ft.quorum_reuse):
    # every sync of the outage but the ones in its first moments (before the first failed call)
    down = (lh["time"] + 0.5, restarted[0]["time"] - 0.3)
    reused = [e for e in events if e["kind"] == "quorum_reused" and down[0] < e["time"] < down[1]]
    assert {e["replica"] for e in reused} == {0, 1}, "no step went on without the Lighthouse"
    for r in (0, 1):
        during = [m for m in committed_after(down[0], r) if m["time"] < down[1]]
        assert during, f"replica {r} committed nothing while the Lighthouse was down"

    # the hang: detected by the adaptive rule in well under the 15 s ceiling, and training went on after it
    hang = next(e for e in events if e["kind"] == "fault_injected" and e["fault_kind"] == "hang")
    assert hang["replica"] == 1 and hang["replicas"] == [1]
    detected = next(e for e in events if e["kind"] == "failure_detected" and e["replica"] == 1
                    and e["time"] >= hang["time"])
    assert "unresponsive" in detected["error"]
    assert detected["time"] - hang["time"] < 8.0, detected
    assert len(committed_after(detected["time"], 0)) >= 3, "the survivor did not train on"
    assert committed_after(detected["time"], 1), "the hung replica did not come back"
    # no false alarm: the only failure of the run is the hang
    assert [e["replica"] for e in events if e["kind"] == "failure_detected"] == [1]

    assert summary["replicas_consistent"] is True, summary.get("final_states")
    assert summary["run_failed"] is None and summary["leaked_pids"] == []
