"""A new controller takes over the procs and actors of one that died or hangs (docs/design/controller-resume.md,
stage B): `reference()`, `adopt_proc_mesh`, `attach_actor_mesh`. Controller A is a subprocess
(`adopt_controller.py`) sharing this process's job secret; this test process is controller B."""

from __future__ import annotations

import inspect
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest

import regent.actor
from regent.actor import (
    AdoptError,
    ForeignJobError,
    HostMesh,
    SupervisionError,
    adopt_proc_mesh,
    attach_actor_mesh,
)
from regent.actor._process import get_runtime
from regent.auth import fingerprint
from tests.e2e.actor.test_actor_lifecycle import pid_alive, wait_for

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "support")
TIMEOUT = 30


def sock_dirs(ref: dict) -> list[str]:
    return [os.path.dirname(info["unix"][len("unix://"):]) for info in ref["infos"].values()]


def start_controller_a(tmp_path, procs: int, detach_grace: float | None = None) -> tuple[subprocess.Popen, dict]:
    """Controller A with this process's secret; returns it and the references it wrote."""
    out = tmp_path / "refs.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    env.update(REGENT_JOB_SECRET=get_runtime().secret.hex(), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
    code = f"import adopt_controller; adopt_controller.main({str(out)!r}, {procs}, {detach_grace!r})"
    with open(tmp_path / "controller-a.log", "w") as log:
        a = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=subprocess.STDOUT)
    if not wait_for(lambda: out.exists() or a.poll() is not None, timeout=TIMEOUT) or not out.exists():
        a.kill()
        a.wait()
        pytest.fail(f"controller A wrote no references:\n{(tmp_path / 'controller-a.log').read_text()}")
    return a, json.loads(out.read_text())


def end_controller_a(a: subprocess.Popen, refs: dict) -> None:
    """SIGKILL A (stopped or not) and anything of its procs still running; remove what killed procs left."""
    if a.poll() is None:
        a.kill()  # also when stopped
        a.wait()
    for pid in refs["pids"]:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    for path in sock_dirs(refs["procs"]):
        shutil.rmtree(path, ignore_errors=True)


def test_adopt_is_refused_while_the_owner_lives_and_forced_takeover_owns_everything(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HERE)  # the actor class, adopt_controller:Counter
    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    a, refs = start_controller_a(tmp_path, procs=3)
    pids = refs["pids"]
    try:
        assert json.loads(json.dumps(refs["procs"])) == refs["procs"]
        assert refs["procs"]["os_pids"] == dict(zip(refs["procs"]["rank_procs"], pids))
        assert refs["counters"]["cls"] == "adopt_controller:Counter"

        # a reference of another job: refused before anything is sent
        other = fingerprint(secrets.token_bytes(32))
        with pytest.raises(ForeignJobError, match="another job"):
            adopt_proc_mesh(dict(refs["procs"], job=other))
        with pytest.raises(ForeignJobError, match="another job"):
            attach_actor_mesh(dict(refs["counters"], job=other))

        # A is alive and connected to its procs: no second controller
        with pytest.raises(AdoptError, match=f"owned by live controller {refs['controller']}") as refused:
            adopt_proc_mesh(refs["procs"])
        assert sorted(refused.value.refused) == sorted(refs["procs"]["rank_procs"]) and not refused.value.adopted

        # A hangs: its connections stay open, so it still counts as alive, but force takes over
        os.kill(a.pid, signal.SIGSTOP)
        with pytest.raises(AdoptError, match="owned by live controller"):
            adopt_proc_mesh(refs["procs"])
        pm = adopt_proc_mesh(refs["procs"], force=True)
        counters = attach_actor_mesh(refs["counters"], pm)
        assert counters.add.call(1).get(timeout=TIMEOUT).values() == [6, 6, 6]  # the actors' state is intact
        mine = pm.reference()  # B can hand the procs on in turn
        assert json.loads(json.dumps(mine)) == mine and mine["os_pids"] == refs["procs"]["os_pids"]
        assert mine["mesh_id"] == refs["procs"]["mesh_id"]

        # a rank killed outright is a failure of the attached handle, as for a mesh B spawned itself
        os.kill(pids[0], signal.SIGKILL)
        assert wait_for(lambda: faults), "no failure reached the fault hook"
        time.sleep(0.5)  # a second report (of the proc mesh) would come within this
        assert len(faults) == 1 and faults[0].mesh is counters and faults[0].crashed_ranks == [0], faults
        with pytest.raises(SupervisionError):
            counters.add.call(1).get(timeout=TIMEOUT)
        assert counters.slice(procs=1).add.call_one(1).get(timeout=TIMEOUT) == 7
        # an actor A spawned that raises under broadcast reports to B now (its proc lives on)
        counters.slice(procs=1).boom.broadcast()
        assert wait_for(lambda: len(faults) == 2), "the actor failure did not reach the fault hook"
        assert faults[1].mesh is counters and faults[1].crashed_ranks == [1] and "boom" in faults[1].report()

        # stop: rank 1's proc exits, rank 2 hangs and is killed by B after the timeout (A, its parent, cannot)
        os.kill(pids[2], signal.SIGSTOP)
        started = time.monotonic()
        pm.stop(timeout=1.0).get(timeout=TIMEOUT)
        assert time.monotonic() - started < 8
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=10), [p for p in pids if pid_alive(p)]
        assert len(faults) == 2  # stopping is no failure
        rt = get_runtime()
        assert refs["procs"]["mesh_id"] not in rt.owned_proc_meshes and not set(pids) & {
            entry[0] for entry in rt.adopted_os_pids.values()}
        # the stopped proc removed its socket directory, and B the one of the proc it killed
        assert not any(os.path.exists(d) for d in sock_dirs(refs["procs"])[1:])
    finally:
        end_controller_a(a, refs)


def test_adopt_after_the_controller_was_killed(tmp_path, monkeypatch):
    if "detach_grace" not in inspect.signature(HostMesh.spawn_procs).parameters:
        pytest.skip("needs detach_grace (stage A)")
    monkeypatch.syspath_prepend(HERE)
    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    a, refs = start_controller_a(tmp_path, procs=2, detach_grace=30.0)
    pids = refs["pids"]
    try:
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        time.sleep(2.0)  # past the procs' orphan watch (1 s ticks): they noticed, and train on
        assert all(pid_alive(p) for p in pids)
        pm = adopt_proc_mesh(refs["procs"])  # no force needed: the owner is gone
        counters = attach_actor_mesh(refs["counters"], pm)
        assert counters.add.call(1).get(timeout=TIMEOUT).values() == [6, 6]
        os.kill(pids[0], signal.SIGKILL)
        assert wait_for(lambda: faults), "no failure reached the fault hook"
        assert faults[0].mesh is counters and faults[0].crashed_ranks == [0]
        pm.stop().get(timeout=TIMEOUT)
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=10), [p for p in pids if pid_alive(p)]
    finally:
        end_controller_a(a, refs)


def test_adopt_with_lost_ok_takes_the_live_procs_of_a_mesh_whose_proc_died(tmp_path, monkeypatch):
    """A proc that died while no controller was there: `lost_ok=True` adopts the others; the dead one's rank is
    in `lost_ranks`, its calls fail at once, no failure is delivered for it, and `stop` ends the rest. Without
    `lost_ok` the adoption fails, naming it."""
    monkeypatch.syspath_prepend(HERE)
    faults = []
    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", faults.append)
    a, refs = start_controller_a(tmp_path, procs=3, detach_grace=30.0)
    pids = refs["pids"]
    try:
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: not pid_alive(pids[1]))
        with pytest.raises(AdoptError, match="unreachable") as strict:
            adopt_proc_mesh(refs["procs"])
        assert list(strict.value.unreachable) == [refs["procs"]["rank_procs"][1]]
        pm = adopt_proc_mesh(refs["procs"], lost_ok=True)
        assert list(pm.lost_ranks) == [1] and pm.lost_ranks[1], pm.lost_ranks
        counters = attach_actor_mesh(refs["counters"], pm)
        assert counters.slice(procs=0).add.call_one(1).get(timeout=TIMEOUT) == 6
        assert counters.slice(procs=2).add.call_one(2).get(timeout=TIMEOUT) == 7
        with pytest.raises(SupervisionError):
            counters.slice(procs=1).add.call_one(1).get(timeout=TIMEOUT)
        time.sleep(0.5)
        assert faults == []  # the adopter knows: nothing is reported for the lost proc
        pm.stop().get(timeout=TIMEOUT)
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=10), [p for p in pids if pid_alive(p)]
        assert faults == []
    finally:
        end_controller_a(a, refs)
