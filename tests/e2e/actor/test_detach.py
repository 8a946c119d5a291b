"""A detach grace: procs that outlive a killed controller (for `regent train --resume`), and what happens when
nobody adopts them. Real processes; the controller is a script killed with SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.e2e.actor.test_actor_lifecycle import pid_alive, wait_for

CONTROLLER = textwrap.dedent("""
    import json, os, sys, threading, time
    from regent.actor import Actor, endpoint, this_host

    class Nested(Actor):
        @endpoint
        def pid(self):
            return os.getpid()

    class Counter(Actor):
        def __init__(self, path):
            self.path = path
            self.inner = this_host().spawn_procs(per_host={"gpus": 1}).spawn("n", Nested)
            threading.Thread(target=self._count, daemon=True).start()

        def _count(self):
            n = 0
            while True:
                n += 1
                with open(self.path, "w") as f:
                    f.write(str(n))
                time.sleep(0.2)

        @endpoint
        def pids(self):
            return [os.getpid(), *self.inner.pid.call().get(timeout=60).values()]

        def __cleanup__(self, exc):
            with open(self.path + ".cleanup", "w") as f:
                f.write("cleaned up")
            print("counter cleaned up", flush=True)

    out, grace, logs = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    procs = this_host().spawn_procs(per_host={"gpus": 1}, detach_grace=grace, detach_log_dir=logs)
    counter = procs.spawn("c", Counter, out)
    print(json.dumps(counter.pids.call_one().get(timeout=120)), flush=True)
    time.sleep(600)
""")


def _start(tmp_path: Path, grace: float) -> tuple[subprocess.Popen, list[int], Path, Path]:
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    out, logs = tmp_path / "count", tmp_path / "logs"
    env = dict(os.environ, REGENT_ORPHAN_TIMEOUT="600", OMP_NUM_THREADS="1")
    # its own session, like a controller on a login node: the test's SIGHUP to its group reaches the procs too
    ctl = subprocess.Popen([sys.executable, str(script), str(out), str(grace), str(logs)], stdout=subprocess.PIPE,
                           text=True, env=env, start_new_session=True)
    pids = json.loads(ctl.stdout.readline())
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    return ctl, pids, out, logs


def _count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _kill(ctl: subprocess.Popen) -> None:
    os.kill(ctl.pid, signal.SIGKILL)
    ctl.wait()


def test_procs_with_a_grace_outlive_a_killed_controller_and_a_hangup(tmp_path):
    ctl, pids, out, logs = _start(tmp_path, grace=60)
    try:
        pgid = os.getpgid(pids[0])
        _kill(ctl)
        os.killpg(pgid, signal.SIGHUP)  # the terminal the controller ran in closed
        time.sleep(3)
        before = _count(out)
        assert wait_for(lambda: _count(out) >= before + 5, timeout=10), "the actor stopped working"
        assert all(pid_alive(p) for p in pids), "a proc (or the one it owns) died with the controller"
        log = next(logs.glob("detached-*.log")).read_text()
        assert "owner lost" in log and "detach grace" in log, log
    finally:
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_unadopted_procs_stop_after_the_grace_running_cleanup(tmp_path):
    ctl, pids, out, logs = _start(tmp_path, grace=3)
    try:
        _kill(ctl)
        time.sleep(1.5)
        assert pid_alive(pids[0]), "exited before its grace was over"
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=20), [p for p in pids if pid_alive(p)]
        assert (tmp_path / "count.cleanup").read_text() == "cleaned up"  # __cleanup__ ran: allocations released
        log = next(logs.glob("detached-*.log")).read_text()
        assert "no owner for" in log and "counter cleaned up" in log, log
    finally:
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
