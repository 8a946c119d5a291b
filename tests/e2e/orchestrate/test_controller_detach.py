"""Issue 33, stage A: a killed controller does not end the run. The replicas and the Lighthouse train on for
`--controller-grace`, journaling everything they report; a replica that fails meanwhile stays down; after the
grace they stop and say why. Real `regent train`, real processes, SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regent.orchestrate.events import BALLOT_KINDS
from regent.orchestrate.relay import read_journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _journal_steps(run_dir: Path) -> dict[int, int]:
    """Each replica's highest step in its journal's metrics (what it trained while nobody listened)."""
    steps = {}
    for path in sorted((run_dir / "journal").glob("replica-*.jsonl")):
        r = int(path.stem.split("-")[1])
        steps[r] = max((i["payload"].get("step", 0) for i in read_journal(path) if i["kind"] == "metric"), default=0)
    return steps


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.long  # its parts: tests/e2e/actor/test_detach.py (grace, stop after it) and the resume case below
def test_replicas_train_on_without_the_controller_and_stop_after_the_grace(tmp_path):
    run_dir = tmp_path / "run"
    grace = 45
    cmd = [sys.executable, "-m", "regent.cli", "train", "--replicas", "3", "--procs-per-replica", "1", "--model",
           "debug", "--duration", "20m", "--no-faults", "--no-live", "--seed", "3", "--ft.sync-every", "5",
           "--controller-grace", f"{grace}s", "--run-dir", str(run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "controller.log", "w")  # noqa: SIM115 - closed in finally
    ctl = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs: list[int] = []
    try:
        _wait(lambda: len(_journal_steps(run_dir)) == 3 and min(_journal_steps(run_dir).values()) >= 10, 240,
              "every replica to train 10 steps")
        procs = _descendants(ctl.pid)
        trainer1 = [p for p in procs if _environ(p).get("REGENT_REPLICA") == "1"
                    and b"_proc_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert trainer1, "replica 1's trainer not found"
        os.kill(ctl.pid, signal.SIGKILL)
        ctl.wait()
        t_kill = time.monotonic()
        at_kill = _journal_steps(run_dir)

        # training goes on without it, journaled
        _wait(lambda: all(s >= at_kill[r] + 10 for r, s in _journal_steps(run_dir).items()), 90,
              f"every replica to train 10 more steps without the controller (from {at_kill})")

        # a replica that fails now stays down; the others go on
        for pid in trainer1:
            os.kill(pid, signal.SIGKILL)
        items = _wait(lambda: [i for i in read_journal(run_dir / "journal" / "replica-1.jsonl")
                               if i["kind"] == "event" and i["payload"]["kind"] == "failure_detected"], 60,
                      "replica 1's failure to be journaled")
        assert items[-1]["payload"].get("detached") is True
        down = _journal_steps(run_dir)
        _wait(lambda: all(_journal_steps(run_dir)[r] >= down[r] + 5 for r in (0, 2)), 90,
              "replicas 0 and 2 to train on without replica 1")
        kinds_1 = [i["payload"]["kind"] for i in read_journal(run_dir / "journal" / "replica-1.jsonl")
                   if i["kind"] == "event"]
        assert "restart_started" not in kinds_1[kinds_1.index("failure_detected"):]
        rseqs = [i["rseq"] for i in read_journal(run_dir / "journal" / "replica-0.jsonl")]
        assert rseqs == list(range(1, len(rseqs) + 1))

        # after the grace: everything stops, and says why
        _wait(lambda: not any(_alive(p) for p in procs), grace + 60 - (time.monotonic() - t_kill),
              "every process of the run to stop after the grace")
        logs = " ".join(p.read_text() for p in (run_dir / "controller").glob("detached-*.log"))
        assert "owner lost" in logs and "no owner for" in logs, logs[-2000:]
    finally:
        if ctl.poll() is None:
            ctl.kill()
        for p in procs:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        log.close()
        print((tmp_path / "controller.log").read_text()[-3000:])


@pytest.mark.long  # the rule itself: tests/e2e/actor/test_actor_lifecycle.py (procs without a grace end with their parent)
def test_controller_grace_zero_keeps_the_old_rule(tmp_path):
    """`--controller-grace 0`: the replicas stop with the controller at once (nothing trains unsupervised)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "regent.cli", "train", "--replicas", "2", "--procs-per-replica", "1", "--model",
           "debug", "--duration", "20m", "--no-faults", "--no-live", "--controller-grace", "0",
           "--run-dir", str(run_dir)]
    ctl = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    procs: list[int] = []
    try:
        _wait(lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size > 0, 240,
              "the first metrics")
        procs = _descendants(ctl.pid)
        os.kill(ctl.pid, signal.SIGKILL)
        ctl.wait()
        _wait(lambda: not any(_alive(p) for p in procs), 20, "the run's processes to stop with the controller")
        assert json.loads((run_dir / "config.json").read_text())["controller_grace"] == 0
    finally:
        for p in procs:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _start(run_dir: Path, log_path: Path, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "regent.cli", "train", *flags, "--run-dir", str(run_dir)]
    with open(log_path, "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                start_new_session=True)


def _events(run_dir: Path) -> list[dict]:
    from regent.orchestrate.events import read_jsonl

    return list(read_jsonl(run_dir / "events.jsonl"))


def _start_detachable(run_dir: Path, log: Path, replicas: int, steps: int) -> subprocess.Popen:
    """A fault-free DiLoCo run of `steps` steps whose replicas outlive its controller for 5 minutes."""
    return _start(run_dir, log, "--replicas", str(replicas), "--procs-per-replica", "1", "--model", "debug",
                  "--steps", str(steps), "--no-faults", "--no-live", "--seed", "3", "--ft.sync-every", "5",
                  "--controller-grace", "5m")


def _wait_trained(run_dir: Path, replicas: int, steps: int = 10) -> None:
    _wait(lambda: len(_journal_steps(run_dir)) == replicas and min(_journal_steps(run_dir).values()) >= steps, 240,
          f"every replica to train {steps} steps")


def test_resume_reattaches_restarts_what_failed_meanwhile_and_loses_nothing(tmp_path):
    """Issue 33's end-to-end case: SIGKILL the controller, training goes on, a trainer killed while no controller
    is there stays down, `regent train --resume` re-attaches, restarts and heals it, and the run ends at its
    stop step with every replica compared and `regent check` holding."""
    from regent.orchestrate.invariants import check_run

    run_dir, log = tmp_path / "run", tmp_path / "controller.log"
    steps = 90  # replica 1 is back by step ~20; the rest is margin for a loaded box
    ctl = _start_detachable(run_dir, log, 3, steps)
    procs: list[int] = []
    try:
        _wait_trained(run_dir, 3)
        procs = _descendants(ctl.pid)
        os.kill(ctl.pid, signal.SIGKILL)
        ctl.wait()
        at_kill = _journal_steps(run_dir)
        _wait(lambda: all(s >= at_kill[r] + 5 for r, s in _journal_steps(run_dir).items()), 90,
              "training to go on without the controller")
        trainer1 = [p for p in _descendants(procs[0]) + procs if _environ(p).get("REGENT_REPLICA") == "1"
                    and b"_proc_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        for pid in trainer1:
            os.kill(pid, signal.SIGKILL)
        _wait(lambda: any(i["kind"] == "event" and i["payload"]["kind"] == "failure_detected"
                          for i in read_journal(run_dir / "journal" / "replica-1.jsonl")), 60,
              "replica 1's failure to be journaled")
        # no controller to fan the failure out: replica 1 told its peers itself (their Manager's peer_abort)
        _wait(lambda: all(any(i["kind"] == "event" and i["payload"]["kind"] == "peer_abort"
                              and str(i["payload"].get("peer", "")).startswith("replica_1:")
                              for i in read_journal(run_dir / "journal" / f"replica-{r}.jsonl")) for r in (0, 2)),
              60, "the survivors to drop their collectives with replica 1")

        resumed = _start(run_dir, log, "--resume", str(run_dir), "--no-live")
        assert resumed.wait(timeout=420) == 0, log.read_text()[-5000:]
        events = _events(run_dir)
        kinds = [e["kind"] for e in events]
        assert kinds.count("run_started") == 1 and kinds.count("run_finished") == 1
        restarted = [e for e in events if e["kind"] == "controller_restarted"]
        assert len(restarted) == 1 and restarted[0]["mode"] == "reattached", restarted
        assert restarted[0]["stayed_down"] == [1]
        # replica 1 was restarted in a new generation and healed from a peer
        after = [e for e in events if e.get("replica") == 1 and e["time"] > restarted[0]["time"]]
        assert any(e["kind"] == "restart_done" for e in after), [e["kind"] for e in after]
        assert any(e["kind"] in ("heal_done", "early_heal_done") for e in after), [e["kind"] for e in after]
        # every journaled item reached the run's files exactly once
        for r in range(3):
            journaled = [i["rseq"] for i in read_journal(run_dir / "journal" / f"replica-{r}.jsonl")
                         if i["payload"].get("kind") not in BALLOT_KINDS]
            written = [rec["rseq"] for name in ("events.jsonl", "metrics.jsonl")
                       for rec in map(json.loads, (run_dir / name).read_text().splitlines())
                       if rec.get("replica") == r and "rseq" in rec]
            assert sorted(written) == journaled, (r, set(journaled) ^ set(written))
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["replicas_compared"] == 3 and summary["final_step"] == steps, summary
        assert check_run(run_dir) == [], check_run(run_dir)
        assert not any(_alive(p) for p in procs)
    finally:
        for p in procs + _descendants(ctl.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        print(log.read_text()[-4000:])


@pytest.mark.long  # its parts: test_resume_refusals (the lease, the stale holder ended) and the resume case above
def test_a_stopped_controller_is_replaced_by_resume_and_the_run_loses_nothing(tmp_path):
    """SIGSTOP, not SIGKILL: the controller holds its lock but supervises nothing. Training goes on; once its lease
    is stale, `--resume` ends it, re-attaches to the live replicas and finishes the run."""
    from regent.orchestrate.invariants import check_run
    from regent.orchestrate.resume import LEASE_STALE_S

    run_dir, log = tmp_path / "run", tmp_path / "controller.log"
    steps = 120
    ctl = _start_detachable(run_dir, log, 2, steps)
    procs: list[int] = []
    try:
        _wait_trained(run_dir, 2)
        procs = _descendants(ctl.pid)
        os.kill(ctl.pid, signal.SIGSTOP)
        at_stop = _journal_steps(run_dir)
        time.sleep(LEASE_STALE_S + 3)
        assert all(s > at_stop[r] for r, s in _journal_steps(run_dir).items()), "training stopped with it"
        resumed = _start(run_dir, log, "--resume", str(run_dir), "--no-live")
        assert resumed.wait(timeout=420) == 0, log.read_text()[-5000:]
        assert ctl.wait(timeout=10) == -signal.SIGKILL
        assert "has not renewed its lease" in log.read_text()
        events = _events(run_dir)
        (restarted,) = [e for e in events if e["kind"] == "controller_restarted"]
        assert restarted["mode"] == "reattached", restarted
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["replicas_compared"] == 2 and summary["final_step"] == steps, summary
        assert check_run(run_dir) == [], check_run(run_dir)
    finally:
        with contextlib.suppress(OSError):
            os.kill(ctl.pid, signal.SIGKILL)
        for p in procs + _descendants(ctl.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        print(log.read_text()[-4000:])


@pytest.mark.long  # its parts: the resume case above, and tests/e2e/ft/test_committed_state_e2e.py (every replica down: the backstop restored and counted)
def test_resume_with_nothing_alive_restores_the_backstop_and_counts_it(tmp_path):
    """The whole process tree killed (the machine rebooted): `--resume` starts a Lighthouse from its state file
    and new replicas, which restore the newest backstop; the loss is a counted `state_lost`, the run finishes."""
    from regent.orchestrate.invariants import check_run

    run_dir, log = tmp_path / "run", tmp_path / "controller.log"
    steps = 60
    ctl = _start(run_dir, log, "--replicas", "2", "--procs-per-replica", "1", "--model", "debug", "--steps",
                 str(steps), "--no-faults", "--no-live", "--seed", "3", "--ft.sync-every", "5",
                 "--ft.backstop-every-s", "2", "--controller-grace", "5m")
    procs: list[int] = []
    try:
        _wait(lambda: len(_journal_steps(run_dir)) == 2 and min(_journal_steps(run_dir).values()) >= 15
              and any((run_dir / "backstop").glob("step-*/rank0.done")), 240, "training and a backstop")
        procs = _descendants(ctl.pid)
        os.killpg(ctl.pid, signal.SIGKILL)  # everything: controller, Lighthouse, replicas, trainers, spares
        ctl.wait()
        _wait(lambda: not any(_alive(p) for p in procs), 30, "the run's processes to be gone")
        resumed = _start(run_dir, log, "--resume", str(run_dir), "--no-live")
        assert resumed.wait(timeout=420) == 0, log.read_text()[-5000:]
        events = _events(run_dir)
        restarted = [e for e in events if e["kind"] == "controller_restarted"]
        assert len(restarted) == 1 and restarted[0]["mode"] == "backstop", restarted
        lost = [e for e in events if e["kind"] == "state_lost" and e["time"] > restarted[0]["time"]]
        assert lost and lost[0]["cause"] == "backstop_restore", lost
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["replicas_compared"] == 2 and summary["final_step"] == steps, summary
        assert check_run(run_dir) == [], check_run(run_dir)
    finally:
        for p in procs + _descendants(ctl.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        print(log.read_text()[-4000:])
