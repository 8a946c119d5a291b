"""A replica that misses the run's last sync is caught up at the end, not left uncompared.

Seen in `make demo` on a loaded machine: a replica that rejoined a DiLoCo round late reached the round's sync 0.1 s
after the others' quorum formed, the others committed it and stopped there (the stop step), and it waited for a
quorum nobody would join until the controller gave up: "no final state of replica(s) [1]" (exit 3). Here the same
end is forced with a straggler: replica 1's trainer is paused across the stop, the survivor commits the last sync
without it, and replica 1 resumes into a quorum nobody joins. The controller must catch it up (`left_behind`):
restarted, it pulls the final committed state from the finished replica, and both are compared, equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PAUSE_AT, PAUSE_S, DURATION_S = 30, 25, 50


@pytest.mark.slow
@pytest.mark.long  # make test's budget (71 s in CI); the rule: test_orchestrate_pure's left_behind cases, and the
# heal at the end (`heal_at_end`, the same pull from a finished peer) in the case study's flip-after-the-last-vote run
@pytest.mark.timeout(420)
def test_a_replica_that_missed_the_last_sync_is_caught_up(tmp_path):
    sched = tmp_path / "faults.jsonl"
    sched.write_text(json.dumps({"at": PAUSE_AT, "replica": 1, "kind": "straggler", "rank": 0}) + "\n")
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "regent.cli", "train", "--replicas", "2", "--procs-per-replica", "1",
         "--model", "debug", "--no-live", "--duration", f"{DURATION_S}s", "--run-dir", str(run_dir),
         "--faults-file", str(sched), "--faults.straggler-s", str(PAUSE_S),
         # the pause must not look like a hang: this straggler outlasts the stop, not the hang rule
         "--faults.hang-timeout", "90", "--faults.hang-floor-s", "60",
         "--ft.sync-every", "5", "--train.seq-len", "64", "--train.batch-size", "4", "--ft.timeout-s", "20",
         "--ft.quorum-timeout-s", "300", "--lighthouse.join-timeout-ms", "10000",
         "--lighthouse.heartbeat-timeout-ms", "3000"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = next(e for e in events if e["kind"] == "training_stopped")
    behind = [e for e in events if e["kind"] == "left_behind"]
    assert [e["replica"] for e in behind] == [1], (behind, proc.stdout[-3000:])
    assert behind[0]["stop_step"] == stopped["stop_step"]
    # nothing failed: no failure is reported for the catch-up, and the straggler was not taken for a hang
    assert not [e for e in events if e["kind"] in ("failure_detected", "ended_failed", "gave_up")]
    finals = {s["replica"]: s for s in summary["final_states"]}
    assert sorted(finals) == [0, 1] and finals[0]["digest"] and finals[0]["digest"] == finals[1]["digest"]
    assert finals[0]["step"] == finals[1]["step"] == stopped["stop_step"]
    assert summary["replicas_consistent"] is True and summary["left_behind_at_end"] == [1]
    assert summary["run_failed"] is None and summary["leaked_pids"] == []
