"""A wrong `regent train --resume` gets one clear line and changes nothing on disk (issue 33). Crafted run
directories, no processes: the checks run before anything is started or written."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import secrets
from pathlib import Path

import pytest

from regent.actor._runtime import machine_id
from regent.auth import fingerprint
from regent.cli import main
from regent.orchestrate.config import RunConfig


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def _craft(tmp_path: Path, *, machine: str | None = None, job: str | None = None, pid: int = 999_999_999,
           steps: int = 5, backstop: bool = True) -> Path:
    """A run directory as a controller that was SIGKILLed leaves it: config, events, metrics, attach.json, a
    secret file; its recorded processes long gone."""
    run = tmp_path / "run"
    (run / "controller").mkdir(parents=True)
    cfg = RunConfig(replicas=2, procs_per_replica=1, run_dir=str(run))
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), default=str))
    (run / "events.jsonl").write_text(json.dumps({"time": 1.0, "kind": "run_started", "replica": None}) + "\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"time": 2.0 + s, "step": s, "replica": 0}) + "\n"
                                               for s in range(1, steps + 1)))
    secret = secrets.token_bytes(32)
    (run / "controller" / "secret").write_text(secret.hex())
    refs = {"os_pids": {"p-0": pid}}
    (run / "controller" / "attach.json").write_text(json.dumps({
        "version": 1, "marker": "m" * 32, "job": job or fingerprint(secret), "secret": "file",
        "controller": {"pid": pid, "host": "elsewhere" if machine else "here", "machine": machine or machine_id()},
        "lighthouse": {"procs": refs, "actor": {}}, "replicas": {"procs": refs, "actor": {}}}))
    if backstop:
        (run / "backstop" / "step-00000004").mkdir(parents=True)
        (run / "backstop" / "step-00000004" / "rank0.done").write_text("{}")
    return run


def _resume(run: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    before = _tree(run) if run.exists() else None
    code = main(["train", "--resume", str(run), *flags])
    err = capsys.readouterr().err.strip()
    if before is not None:
        assert _tree(run) == before, "a refused --resume changed the run directory"
    assert len(err.splitlines()) == 1, err
    return code, err


def test_no_run_there(tmp_path, capsys):
    code, err = _resume(tmp_path / "nothing", capsys)
    assert code == 2 and "no run there" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _resume(empty, capsys)
    assert code == 2 and "no run there" in err


def test_a_finished_run(tmp_path, capsys):
    run = _craft(tmp_path)
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": 100.0, "kind": "run_finished", "replica": None}) + "\n")
    code, err = _resume(run, capsys)
    assert code == 2 and "finished at" in err and "nothing to resume" in err


def test_a_run_still_controlled(tmp_path, capsys):
    run = _craft(tmp_path)
    lock = run / "controller" / "lock"
    lock.write_text("")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live controller holds it
        code, err = _resume(run, capsys)
    finally:
        os.close(fd)
    assert code == 2 and "still controlled by pid" in err


def test_another_machine(tmp_path, capsys):
    code, err = _resume(_craft(tmp_path, machine="other-host:boot"), capsys)
    assert code == 2 and "resume it on elsewhere" in err and "--takeover" in err


def test_takeover_from_a_machine_that_is_gone_needs_a_backstop(tmp_path, capsys):
    """--takeover adopts nothing (it cannot see the other machine): the run goes on from its backstop, so with
    none it is refused like any run with nothing alive."""
    code, err = _resume(_craft(tmp_path, machine="other-host:boot", backstop=False), capsys, "--takeover")
    assert code == 1 and "no backstop" in err


def test_another_jobs_secret(tmp_path, capsys):
    code, err = _resume(_craft(tmp_path, job="0123456789abcdef"), capsys)
    assert code == 2 and "is not run" in err and "fingerprint" in err


def test_a_flag_that_contradicts_the_recorded_config(tmp_path, capsys):
    code, err = _resume(_craft(tmp_path), capsys, "--replicas", "4")
    assert code == 2 and "--replicas 4 contradicts run" in err and "replicas=2" in err


def test_nothing_alive_and_no_backstop(tmp_path, capsys):
    code, err = _resume(_craft(tmp_path, backstop=False), capsys)
    assert code == 1 and "no backstop" in err and "committed step 5 cannot be restored" in err


def test_allocations_to_release_are_each_replicas_newest_not_yet_released() -> None:
    from regent.orchestrate.resume import allocations_to_release

    def alloc(r: int, job: str, release: dict | None) -> dict:
        return {"kind": "allocation", "replica": r, "job": job, "release": release}

    slurm = lambda i: {"backend": "slurm", "job_id": str(i), "describe": f"SLURM job {i}"}  # noqa: E731
    events = [
        alloc(0, "SLURM job 1", slurm(1)), alloc(1, "SLURM job 2", slurm(2)),
        alloc(0, "SLURM job 3", slurm(3)),  # replica 0 moved on: job 1 was killed by it
        alloc(2, "local", None),  # local workers: nothing outlives the processes
        {"kind": "allocation_released", "replica": 1, "job": "SLURM job 2"},  # an earlier resume freed it
    ]
    assert allocations_to_release(events) == [(0, slurm(3))]
    assert allocations_to_release([]) == []


def _with_addresses(run: Path, tcp: str) -> None:
    """Give the crafted run's recorded processes an address (as a runtime records it in attach.json)."""
    path = run / "controller" / "attach.json"
    attach = json.loads(path.read_text())
    info = {"id": "p-0", "machine": "other-host:boot", "unix": "unix:///tmp/x/rt.sock", "tcp": tcp}
    for part in ("lighthouse", "replicas"):
        attach[part]["procs"]["infos"] = {"p-0": info}
    path.write_text(json.dumps(attach))


def test_cross_host_problem_names_what_keeps_another_machine_out() -> None:
    from regent.orchestrate.resume import cross_host_problem

    def attach(*tcp: str) -> dict:
        infos = {f"p-{i}": {"tcp": t} for i, t in enumerate(tcp)}
        return {"lighthouse": {"procs": {"infos": infos}}, "replicas": {"procs": {"infos": {}}}}

    assert "recorded no address" in cross_host_problem(attach(), "10.0.0.2")
    assert "loopback only (tcp://127.0.0.1:5" in cross_host_problem(attach("tcp://10.0.0.1:4", "tcp://127.0.0.1:5"),
                                                                    "10.0.0.2")
    assert "loopback only" in cross_host_problem(attach("tcp://[::1]:5"), "10.0.0.2")
    assert "REGENT_LISTEN_HOST" in cross_host_problem(attach("tcp://10.0.0.1:4"), "127.0.0.1")
    assert cross_host_problem(attach("tcp://10.0.0.1:4", "tcp://node7:5"), "10.0.0.2") is None
    assert cross_host_problem(attach("tcp://10.0.0.1:4"), "0.0.0.0") is None


def test_another_machine_whose_processes_listen_on_loopback_only(tmp_path, capsys):
    run = _craft(tmp_path, machine="other-host:boot")
    _with_addresses(run, "tcp://127.0.0.1:5")
    code, err = _resume(run, capsys)
    assert code == 2 and "loopback only" in err and "--takeover" in err


def test_another_machine_with_routable_processes_that_do_not_answer(tmp_path, capsys):
    """Adoptable from here in principle (they listen on a routable address), but nothing answers there: going on
    from the backstop is the user's call (--takeover), as for any run whose machine is gone."""
    from regent.orchestrate.resume import ResumeRefused, check_resumable

    run = _craft(tmp_path, machine="other-host:boot")
    _with_addresses(run, "tcp://192.0.2.1:9")  # TEST-NET-1: nobody answers
    with pytest.raises(ResumeRefused, match="nothing of run .* answers on elsewhere .*192.0.2.1:9.*--takeover"):
        check_resumable(run, environ={"REGENT_LISTEN_HOST": "10.0.0.2"})
    with pytest.raises(ResumeRefused, match="REGENT_LISTEN_HOST"):
        check_resumable(run, environ={})
    plan = check_resumable(run, environ={}, takeover=True)
    assert plan.remote is None and plan.alive == []
