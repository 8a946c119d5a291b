"""A wrong `regent train --resume` gets one clear line and changes nothing on disk (issue 33): the cases that
start processes (the others: tests/unit/orchestrate/test_resume_refusals.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.orchestrate.test_resume_refusals import _craft, _resume, _tree  # noqa: F401 - fixtures shared with the unit cases

_HOLDER = """
import os, sys, time
from pathlib import Path
from regent.orchestrate.resume import ControllerLease, ControllerLock
run = Path(sys.argv[1])
lock = ControllerLock(run)
lock.acquire()
ControllerLease(run, on_replaced=lambda holder: (print("replaced by", holder["pid"], flush=True), os._exit(4))).start()
print("holding", flush=True)
time.sleep(600)
"""


def _holder(run: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc


def _wait(pred, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_stopped_controller_is_told_by_its_lease_and_ended_by_the_resume(tmp_path, capsys):
    """A controller that holds its lock but is SIGSTOPped supervises nothing: once its lease is stale, --resume
    plans to end it (a working one is refused, naming how fresh its lease is), SIGKILLs it and gets the lock."""
    import signal

    from regent.orchestrate.commands import _end_stale_controller
    from regent.orchestrate.resume import check_resumable, lease_age, lock_is_held

    run = _craft(tmp_path)
    proc = _holder(run)
    try:
        code, err = _resume(run, capsys)
        assert code == 2 and "still controlled" in err and "lease renewed" in err
        os.kill(proc.pid, signal.SIGSTOP)
        _wait(lambda: (lease_age(run) or 0.0) > 1.5)
        plan = check_resumable(run, lease_stale_s=1.0)
        assert plan.stale_holder == proc.pid
        assert _end_stale_controller(plan)
        assert proc.wait(timeout=10) == -signal.SIGKILL and not lock_is_held(run)
    finally:
        proc.kill()


def test_a_replaced_controller_exits_when_it_wakes(tmp_path):
    """The fence: a successor wrote the lease (it took over from another machine while this one was stopped):
    at its next renewal the old controller exits without touching the run."""
    from regent.orchestrate.resume import LEASE_FILE, write_json_atomic

    run = _craft(tmp_path)
    proc = _holder(run)
    try:
        write_json_atomic(run / "controller" / LEASE_FILE, {"pid": 4242, "host": "other", "machine": "m-other",
                                                            "renewed": 1e12})
        assert proc.wait(timeout=20) == 4
        assert proc.stdout is not None and "replaced by 4242" in proc.stdout.read()
    finally:
        proc.kill()


def test_a_stale_controller_elsewhere_needs_takeover(tmp_path, capsys):
    import time

    from regent.orchestrate.resume import LEASE_FILE, check_resumable

    run = _craft(tmp_path)
    proc = _holder(run)
    try:
        import signal

        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2.5)  # past its last renewal
        lease = json.loads((run / "controller" / LEASE_FILE).read_text())
        (run / "controller" / LEASE_FILE).write_text(json.dumps({**lease, "machine": "m-other", "host": "far"}))
        with pytest.raises(Exception, match="--takeover"):
            check_resumable(run, lease_stale_s=1.0)
    finally:
        proc.kill()
