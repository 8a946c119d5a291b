"""`regent train --job k8s` end to end against RecordedKubeApiStub (a recorded-response stub of the Kubernetes
REST API; tests/support/kube_api_stub.py), whose "kubelet" runs each worker pod as local processes.

No Kubernetes cluster runs here. What is real: the `regent train` command, the official `kubernetes` client
talking HTTP, KubernetesJob's create/poll/problem/delete logic, the pod's `regent worker` command line with the
secret read from the mounted Secret file, training, faults and heals. What is stubbed: the API server's
storage, the Job controller and the kubelet (local processes on 127.0.0.N instead of containers on nodes).

Two replicas, each its own Indexed Job. Once both train together, the test SIGKILLs replica 0's trainer process
inside its pod (the worker lives on): replica 0 restarts in place, since its pod is healthy. Then the test preempts replica 1's pod (the stub SIGKILLs the pod's processes and reports the recorded
`DisruptionTarget: PreemptionByScheduler` status): replica 1 must see its allocation is lost, go to a fresh Job
at once, heal from replica 0, and both end bit-identical with nothing left in the API.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from regent.jobs.base import pick_free_port
from tests.support.kube_api_stub import RecordedKubeApiStub
from tests.support.run_watch import committed_after, read_events, wait_for_events

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(540)]  # make test-long

ARGS = [
    "--job", "k8s", "--replicas", "2", "--procs-per-replica", "1", "--model", "debug", "--no-live",
    "--ft.sync-every", "5", "--train.seq-len", "64", "--train.batch-size", "4",
    "--ft.timeout-s", "10", "--ft.quorum-timeout-s", "120",
    "--faults.hang-timeout", "8", "--lighthouse.join-timeout-ms", "10000",
    "--lighthouse.heartbeat-timeout-ms", "3000",
    "--job.image", "registry.local/regent:test", "--job.namespace", "ml", "--job.gpus-per-node", "0",
    "--job.allocation-timeout", "120s",
]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), deepest last."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        out += children
        frontier = children
    return out


def test_train_on_k8s_kill_in_place_and_preemption_reallocates(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    events_path = run_dir / "events.jsonl"
    with RecordedKubeApiStub() as api:
        api.pod_mode, api.kubelet_dir = "run", tmp_path / "kubelet"
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("KUBERNETES_SERVICE_HOST", None)
        cmd = [sys.executable, "-m", "regent.cli", "train", *ARGS, "--job.kubeconfig", kubeconfig,
               "--job.port", str(pick_free_port("127.0.0.1")), "--duration", "120s", "--no-faults",
               "--run-dir", str(run_dir)]
        log = (tmp_path / "train.log").open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            # 1. once both replicas commit together, kill replica 0's trainer inside its (healthy) pod
            def together(events: list[dict]) -> bool:
                return any(e["kind"] == "commit" and e.get("committed") and e.get("participants") == 2
                           for e in events)
            events = wait_for_events(proc, events_path, "both replicas to commit together", together, 240)
            (pod0,) = api.pods_of([e for e in events if e["kind"] == "allocation" and e["replica"] == 0][0]["job"]
                                  .rsplit("/", 1)[-1])
            trainers = _descendants(api.processes[pod0["metadata"]["name"]].pid)
            assert trainers, "the pod's worker started no trainer process"
            for pid in trainers:
                os.kill(pid, signal.SIGKILL)

            def kill_healed(events: list[dict]) -> bool:
                done = [e for e in events if e["kind"] == "restart_done" and e["replica"] == 0]
                return bool(done) and committed_after(events, 0, done[0]["time"]) >= 1
            events = wait_for_events(proc, events_path, "replica 0 to recover from the kill", kill_healed, 240)
            # 2. preempt replica 1's pod while both train
            first = [e for e in events if e["kind"] == "allocation" and e["replica"] == 1]
            assert len(first) == 1, first
            preempted_job = first[0]["job"].rsplit("/", 1)[-1]
            (victim,) = api.pods_of(preempted_job)
            t_preempt = time.time()
            api.disrupt(victim["metadata"]["name"], "preempted")

            # 3. replica 1 comes back on a new Job and commits again
            def back(events: list[dict]) -> bool:
                again = [e for e in events if e["kind"] == "allocation" and e["replica"] == 1
                         and e["time"] > t_preempt]
                return bool(again) and committed_after(events, 1, again[0]["time"]) >= 1
            wait_for_events(proc, events_path, "replica 1 to train on a new allocation", back, 200)
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        train_log = (tmp_path / "train.log").read_text()
        assert proc.returncode == 0, train_log[-6000:]
        # every allocation was released: nothing left in the API, no pod process running
        assert api.names("jobs") == api.names("services") == api.names("secrets") == api.names("pods") == []
        assert not api.processes
        created_jobs = [o["metadata"]["name"] for o in api.created if o["kind"] == "Job"]

    events = read_events(events_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    allocs = [e for e in events if e["kind"] == "allocation" and e["replica"] == 1]
    assert len(allocs) == 2, allocs
    assert allocs[1]["previous"] == allocs[0]["job"] and allocs[1]["job"] != allocs[0]["job"]
    assert len(created_jobs) == 3  # replica 0's one Job, replica 1's first and its replacement
    assert all(e["gpus_per_host"] is None for e in events if e["kind"] == "allocation")
    assert len([e for e in events if e["kind"] == "allocation" and e["replica"] == 0]) == 1
    kill_restart = next(e for e in events if e["kind"] == "restart_done" and e["replica"] == 0)
    assert kill_restart["action"] == "restart_in_place"  # a healthy pod: no allocation_lost for replica 0
    assert not [e for e in events if e["kind"] == "allocation_lost" and e["replica"] == 0]
    lost = [e for e in events if e["kind"] == "allocation_lost" and e["replica"] == 1]
    assert lost and "preempted by the scheduler" in lost[0]["reason"], lost
    restarts = [e for e in events if e["kind"] == "restart_done" and e["replica"] == 1 and e["time"] > t_preempt]
    assert restarts and restarts[0]["action"] == "reallocate", restarts
    gen = restarts[0]["generation"]
    heals = [e for e in events if e["kind"] in ("heal_done", "early_heal_done") and e["replica"] == 1
             and e["generation"] == gen]
    assert heals and heals[0]["donor"].startswith("replica_0:"), "replica 1 did not heal from its peer"
    assert summary["full_restarts"] == 0, summary
    assert summary["replicas_consistent"] is True, summary.get("final_states")
    assert not summary.get("invariant_violations"), summary["invariant_violations"]
