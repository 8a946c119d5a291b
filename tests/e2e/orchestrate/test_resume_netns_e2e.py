"""Issue 33: `regent train --resume` from another machine than the lost controller's re-adopts the live Lighthouse
and replicas over the network, from what the run directory recorded (their addresses, the job secret's file).

Two "hosts" are network namespaces with their own addresses and host names (tests/support/netns.py): the run starts
on host A (REGENT_LISTEN_HOST set to A's address, as a multi-host run is), its controller is SIGKILLed, and the
resume runs on host B, which reaches A's processes only through the lab's bridge. Namespaces on one machine, not
separate physical machines (they share the file system: the run directory stands for a shared one). Skipped,
with the reason, where namespaces cannot be made.
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

from tests.e2e.orchestrate.test_controller_detach import _journal_steps, _wait
from tests.support.netns import Host, lab_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]  # make test-long


def _namespace_pids(host: Host) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=20).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _env(base: dict[str, str], host: Host) -> dict[str, str]:
    """A controller of `host`: its actor runtime (and its procs') listen on the host's address, the trainers it
    may start advertise it to their peers."""
    return {**base, "REGENT_LISTEN_HOST": host.address, "REGENT_FT_HOSTNAME": host.address,
            "GLOO_SOCKET_IFNAME": Host.ifname}


def test_resume_on_another_host_reattaches_to_the_live_run(tmp_path: Path) -> None:
    from regent.orchestrate.invariants import check_run

    with lab_or_skip() as lab:
        a, b = lab.add_host("ctla"), lab.add_host("ctlb")
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("REGENT_JOB_SECRET", "REGENT_LISTEN", "REGENT_FT_", "TORCHFT_"))}
        base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        run_dir, log_path = tmp_path / "run", tmp_path / "controller.log"
        steps = 40
        train = [sys.executable, "-m", "regent.cli", "train"]
        with open(log_path, "w") as log:
            ctl = a.popen([*train, "--replicas", "2", "--procs-per-replica", "1", "--model", "debug", "--steps",
                           str(steps), "--no-faults", "--no-live", "--seed", "3", "--ft.sync-every", "5",
                           "--lighthouse.bind", f"{a.address}:0", "--controller-grace", "5m",
                           "--run-dir", str(run_dir)], hostname="rgt-ctla", env=_env(base, a), stdout=log,
                          stderr=subprocess.STDOUT)
        try:
            _wait(lambda: len(_journal_steps(run_dir)) == 2 and min(_journal_steps(run_dir).values()) >= 5, 240,
                  "every replica to train 5 steps")
            attach = json.loads((run_dir / "controller" / "attach.json").read_text())
            assert attach["secret"] == "file" and attach["controller"]["host"] == "rgt-ctla", attach["controller"]
            os.kill(ctl.pid, signal.SIGKILL)
            ctl.wait()
            at_kill = _journal_steps(run_dir)
            _wait(lambda: all(s > at_kill[r] for r, s in _journal_steps(run_dir).items()), 90,
                  "training to go on without the controller")

            # host B's controller must itself be reachable from host A: refused, in one line, while it listens
            # on loopback
            refused = subprocess.run(b.command([*train, "--resume", str(run_dir), "--no-live"], hostname="rgt-ctlb"),
                                     env={**base, "REGENT_LISTEN_HOST": "127.0.0.1"}, capture_output=True,
                                     text=True, timeout=120)
            assert refused.returncode == 2 and "REGENT_LISTEN_HOST" in refused.stderr, refused.stderr

            t_resume = time.time()
            with open(log_path, "a") as log:
                resumed = b.popen([*train, "--resume", str(run_dir), "--no-live"], hostname="rgt-ctlb",
                                  env=_env(base, b), stdout=log, stderr=subprocess.STDOUT)
            assert resumed.wait(timeout=420) == 0, log_path.read_text()[-5000:]
        finally:
            if ctl.poll() is None:
                ctl.kill()
        text = log_path.read_text()
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        (restarted,) = [e for e in events if e["kind"] == "controller_restarted"]
        assert restarted["mode"] == "reattached" and restarted["lighthouse"] == "adopted", restarted
        assert (restarted["previous_host"], restarted["host"]) == ("rgt-ctla", "rgt-ctlb"), restarted
        assert all(n >= 1 for n in restarted["resent"].values()), restarted  # they trained on, journaled
        # nothing restarted: the same replica processes on host A trained through to the end
        assert not [e for e in events if e["kind"] in ("restart_started", "state_lost") and e["time"] > t_resume]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["replicas_compared"] == 2 and summary["final_step"] == steps, summary
        assert check_run(run_dir) == [], check_run(run_dir)
        attach = json.loads((run_dir / "controller" / "attach.json").read_text())
        assert attach["controller"]["host"] == "rgt-ctlb" and attach["previous"]["host"] == "rgt-ctla"
        # the resumed controller stopped host A's processes at the end, over the network
        _wait(lambda: not _namespace_pids(a), 30, f"host A's processes to end: {_namespace_pids(a)}")
        print(f"\n[resume netns] {text[-1500:]}")
    assert not lab.leftovers()
