"""`regent train --job slurm` end to end on a real SLURM cluster (the single-node one `make test` starts).

Two replicas, each in its own sbatch allocation. A `kill` fault first (the replica restarts in place, in the
same allocation), then a scheduler kill: the test `scancel`s replica 1's allocation in the middle of training.
The replica must notice that its allocation is gone, come back on a new one without first trying to restart on
the cancelled one, heal from replica 0, and both must end bit-identical. Skipped, with the reason, when SLURM is
not available here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regent.jobs.slurm import unavailable_reason
from tests.support.run_watch import committed_after, read_events, wait_for_events

_REASON = unavailable_reason()
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=f"real SLURM e2e: {_REASON}"), pytest.mark.slow,
              pytest.mark.timeout(420)]

ARGS = [
    "--job", "slurm", "--replicas", "2", "--procs-per-replica", "1", "--model", "debug", "--no-live",
    "--ft.sync-every", "5", "--train.seq-len", "64", "--train.batch-size", "4",
    "--ft.timeout-s", "10", "--ft.quorum-timeout-s", "120",
    "--faults.hang-timeout", "8", "--lighthouse.join-timeout-ms", "10000",
    "--lighthouse.heartbeat-timeout-ms", "3000",
    "--job.cpus-per-task", "1", "--job.time", "00:15:00", "--job.allocation-timeout", "120s",
]


def test_kill_and_scancel_under_slurm_heal_from_peer(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    faults = tmp_path / "faults.jsonl"
    faults.write_text(json.dumps({"at": 10, "replica": 0, "kind": "kill", "rank": 0}) + "\n")
    events_path = run_dir / "events.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "regent.cli", "train", *ARGS, "--job.shared-dir", str(tmp_path / "jobs"),
           "--duration", "50s", "--faults-file", str(faults), "--run-dir", str(run_dir)]
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    cancelled_job = None
    try:
        # 1. the kill fault on replica 0 heals (in place) and replica 0 commits again
        def kill_healed(events: list[dict]) -> bool:
            done = [e for e in events if e["kind"] == "restart_done" and e["replica"] == 0]
            return bool(done) and committed_after(events, 0, done[0]["time"]) >= 1
        events = wait_for_events(proc, events_path, "replica 0 to recover from the kill", kill_healed, 150)
        # 2. scancel replica 1's allocation while both train
        first = [e for e in events if e["kind"] == "allocation" and e["replica"] == 1]
        assert len(first) == 1 and first[0]["job_id"], first
        cancelled_job = first[0]["job_id"]
        t_cancel = time.time()
        subprocess.run(["scancel", cancelled_job], check=True, timeout=60)
        # 3. replica 1 comes back on a new allocation and commits again
        def back(events: list[dict]) -> bool:
            again = [e for e in events if e["kind"] == "allocation" and e["replica"] == 1 and e["time"] > t_cancel]
            return bool(again) and committed_after(events, 1, again[0]["time"]) >= 1
        wait_for_events(proc, events_path, "replica 1 to train on a new allocation", back, 150)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    train_log = (tmp_path / "train.log").read_text()
    assert proc.returncode == 0, train_log[-6000:]

    events = read_events(events_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    # both allocations of replica 1 are in the events: the first, then a new one that replaced it
    allocs = [e for e in events if e["kind"] == "allocation" and e["replica"] == 1]
    assert len(allocs) == 2, allocs
    assert allocs[0]["job_id"] == cancelled_job and allocs[1]["job_id"] != cancelled_job
    assert allocs[1]["previous"] == allocs[0]["job"]
    assert all(e["gpus_per_host"] is None for e in events if e["kind"] == "allocation")  # a CPU cluster: no GRES
    # replica 0 kept its one allocation through its kill fault (in-place restart)
    assert len([e for e in events if e["kind"] == "allocation" and e["replica"] == 0]) == 1
    kill_restart = next(e for e in events if e["kind"] == "restart_done" and e["replica"] == 0)
    assert kill_restart["action"] == "restart_in_place"
    # the cancellation was recognised as a lost allocation and went straight to a fresh one
    lost = [e for e in events if e["kind"] == "allocation_lost" and e["replica"] == 1]
    assert lost and "CANCELLED" in lost[0]["reason"] and lost[0]["job_id"] == cancelled_job, lost
    restarts = [e for e in events if e["kind"] == "restart_done" and e["replica"] == 1 and e["time"] > t_cancel]
    assert restarts and restarts[0]["action"] == "reallocate", restarts
    gen = restarts[0]["generation"]
    heals = [e for e in events if e["kind"] in ("heal_done", "early_heal_done") and e["replica"] == 1
             and e["generation"] == gen]
    assert heals and heals[0]["donor"].startswith("replica_0:"), "replica 1 did not heal from its peer"
    # replica 0 trained on while replica 1 was away
    during = [e for e in events if e["time"] <= heals[0]["time"] + 10]
    assert committed_after(during, 0, t_cancel) >= 1, "replica 0 did not keep training while replica 1 moved"
    assert not [e for e in events if e["kind"] == "failure_detected" and e["replica"] == 0 and e["time"] > t_cancel]
    assert summary["full_restarts"] == 0, summary
    assert summary["replicas_consistent"] is True, summary.get("final_states")
    assert not summary.get("invariant_violations"), summary["invariant_violations"]
    # no allocation is left behind
    squeue = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=60).stdout
    assert "regent-replica" not in squeue, squeue


@pytest.mark.long  # its parts: test_slurm_real's SIGKILLed-owner release and the local nothing-alive resume
def test_resume_after_losing_everything_frees_the_dead_replicas_slurm_allocations(tmp_path: Path) -> None:
    """The controller's whole process tree is SIGKILLed (its host rebooted): the replicas' sbatch allocations
    outlive it (their workers run under slurmd) and nothing is left to cancel them. `regent train --resume`
    finds nothing to adopt, cancels each allocation the run recorded, and finishes on new ones."""
    import signal

    from regent.orchestrate.invariants import check_run

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "regent.cli", "train", *ARGS, "--job.shared-dir", str(tmp_path / "jobs"),
           "--steps", "60", "--no-faults", "--ft.backstop-every-s", "2", "--controller-grace", "5m",
           "--run-dir", str(run_dir)]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def trained(events: list[dict]) -> bool:
            return (len({e["replica"] for e in events if e["kind"] == "allocation"}) == 2
                    and any(e["kind"] == "backstop_saved" for e in events)
                    and all(committed_after(events, r, 0) >= 2 for r in (0, 1)))
        events = wait_for_events(proc, run_dir / "events.jsonl", "both replicas training and a backstop", trained,
                                 240)
        jobs = sorted(e["job_id"] for e in events if e["kind"] == "allocation")
        os.killpg(proc.pid, signal.SIGKILL)  # the controller, its Lighthouse and the replica actors
        proc.wait()
        state = lambda j: subprocess.run(["squeue", "-h", "-t", "all", "-j", j, "-o", "%T"],  # noqa: E731
                                         capture_output=True, text=True, timeout=60).stdout.strip()
        assert [state(j) for j in jobs] == ["RUNNING", "RUNNING"]  # held, with nobody left to release them
        resumed = subprocess.run([sys.executable, "-m", "regent.cli", "train", "--resume", str(run_dir),
                                  "--no-live"], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=400)
        assert resumed.returncode == 0, log_path.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    events = read_events(run_dir / "events.jsonl")
    (restarted,) = [e for e in events if e["kind"] == "controller_restarted"]
    assert restarted["mode"] == "backstop", restarted
    released = [e for e in events if e["kind"] == "allocation_released"]
    assert sorted(e["replica"] for e in released) == [0, 1] and all("cancelled" in e["how"] for e in released)
    assert all(state(j) not in ("RUNNING", "PENDING") for j in jobs), [state(j) for j in jobs]
    fresh = [e["job_id"] for e in events if e["kind"] == "allocation" and e["time"] > released[-1]["time"]]
    assert len(fresh) == 2 and not set(fresh) & set(jobs), fresh  # the new replicas' own allocations
    assert check_run(run_dir) == [], check_run(run_dir)
    squeue = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=60).stdout
    assert "regent-replica" not in squeue, squeue
