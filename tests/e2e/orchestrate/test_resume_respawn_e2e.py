"""Issue 33: a replica's supervising process (its ReplicaActor proc, not only its trainer) died while no controller
was attached. `regent train --resume` respawns that replica (a new ReplicaActor proc and trainer mesh), heals it from
a live peer and finishes the run with every replica compared; the next resume adopts the respawned replica where
attach.json recorded it. Real `regent train`, real processes, SIGKILL."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from regent.orchestrate.relay import read_journal
from tests.e2e.orchestrate.test_controller_detach import (
    _alive,
    _descendants,
    _events,
    _start,
    _wait,
    _wait_trained,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def replica_proc_pids(run_dir: Path) -> list[int]:
    """The OS pid of each replica's ReplicaActor proc, in replica order, as controller/attach.json records it."""
    ref = json.loads((run_dir / "controller" / "attach.json").read_text())["replicas"]["procs"]
    return [int(ref["os_pids"][proc]) for proc in ref["rank_procs"]]


def _committed_in_generation(run_dir: Path, replica: int, generation: int) -> bool:
    return any(i["kind"] == "metric" and (i["payload"].get("generation") or 0) >= generation
               for i in read_journal(run_dir / "journal" / f"replica-{replica}.jsonl"))


# 50 to 100 s on a loaded 2-core box (three controller starts); its actor-layer part, adopting the live procs of
# a mesh whose proc died, is tests/e2e/actor/test_adopt.py
@pytest.mark.long
def test_resume_respawns_a_replica_whose_replica_proc_died_and_heals_it(tmp_path):
    from regent.orchestrate.invariants import check_run

    run_dir, log = tmp_path / "run", tmp_path / "controller.log"
    steps = 80
    ctl = _start(run_dir, log, "--replicas", "3", "--procs-per-replica", "1", "--model", "debug", "--steps",
                 str(steps), "--no-faults", "--no-live", "--seed", "3", "--ft.sync-every", "5",
                 "--ft.timeout-s", "10", "--controller-grace", "5m")
    procs: list[int] = []
    try:
        _wait_trained(run_dir, 3, steps=5)
        procs = _descendants(ctl.pid)
        os.kill(ctl.pid, signal.SIGKILL)
        ctl.wait()
        victim = replica_proc_pids(run_dir)[1]
        assert victim in procs, (victim, procs)
        trainers = _descendants(victim)
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: not any(_alive(p) for p in [victim, *trainers]), 30, "replica 1's processes to be gone")
        rseq_before = max((i["rseq"] for i in read_journal(run_dir / "journal" / "replica-1.jsonl")), default=0)

        resumed = _start(run_dir, log, "--resume", str(run_dir), "--no-live")
        # the respawned replica trains again; then this controller is lost too, and the next one adopts replica 1
        # on the mesh attach.json now records for it
        _wait(lambda: _committed_in_generation(run_dir, 1, 1), 240, "the respawned replica 1 to commit")
        respawned = json.loads((run_dir / "controller" / "attach.json").read_text())["replicas"]["respawned"]
        assert list(respawned) == ["1"], respawned
        procs += _descendants(resumed.pid)
        os.kill(resumed.pid, signal.SIGKILL)
        resumed.wait()
        again = _start(run_dir, log, "--resume", str(run_dir), "--no-live")
        assert again.wait(timeout=420) == 0, log.read_text()[-5000:]
        events = _events(run_dir)
        restarted, second = [e for e in events if e["kind"] == "controller_restarted"]
        assert second["mode"] == "reattached" and second["respawned"] == [] and second["stayed_down"] == [], second
        assert sorted(second["resent"]) == ["0", "1", "2"], second
        assert restarted["mode"] == "reattached" and restarted["respawned"] == [1], restarted
        # its loss is recorded like any replica failure (the resumed controller saw it), then it restarts in a new
        # generation and heals from a live peer
        (lost,) = [e for e in events if e["kind"] == "failure_detected" and e["replica"] == 1]
        assert lost["detached"] and "ReplicaActor" in lost["error"] and lost["time"] <= restarted["time"], lost
        after = [e for e in events if e.get("replica") == 1 and e["time"] > restarted["time"]]
        kinds = [e["kind"] for e in after]
        assert kinds[0] == "restart_started" and "restart_done" in kinds, kinds
        assert any(k in ("heal_done", "early_heal_done") for k in kinds), kinds
        (done,) = [e for e in after if e["kind"] == "restart_done"]
        assert done["action"] == "respawn" and done["generation"] > lost["generation"], (done, lost)
        # the respawned replica's journal goes on from the dead one's sequence numbers
        rseqs = [i["rseq"] for i in read_journal(run_dir / "journal" / "replica-1.jsonl")]
        assert rseqs == list(range(1, len(rseqs) + 1)) and rseqs[-1] > rseq_before
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["replicas_compared"] == 3 and summary["final_step"] == steps, summary
        assert summary["controller_restarts"] == 2 and summary["recoveries"] == 1, summary
        assert check_run(run_dir) == [], check_run(run_dir)
        assert not any(_alive(p) for p in procs)
    finally:
        for p in procs + _descendants(ctl.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        print(log.read_text()[-4000:])
