"""The job contract's shared pieces: registry, names, secrets, address publication, the worker launcher: the
cases that start processes (the others: tests/unit/jobs/test_jobs_base.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from regent.jobs.base import (
    ADDRESS_MARKER,
    SECRET_ENV,
    JobError,
    address_file,
    is_listening,
    launcher_command,
    run_command,
    write_secret_file,
)


def test_importing_regent_jobs_pulls_in_no_backend_or_torch() -> None:
    code = ("import sys, regent.jobs; "
            "bad = [m for m in ('torch', 'kubernetes', 'regent.jobs.slurm') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_secret_is_the_controller_runtimes(tmp_path) -> None:
    """Without secret=, a job uses the actor runtime's secret (itself from $REGENT_JOB_SECRET), so
    host_mesh() attaches with no configuration. Run in a fresh process: it starts a runtime."""
    code = (
        "from regent.jobs.slurm import SlurmJob\n"
        f"job = SlurmJob(1, shared_dir={str(tmp_path)!r})\n"
        "assert job._secret is None  # constructing starts nothing\n"
        "from regent.actor._process import get_runtime\n"
        "print(job.secret, get_runtime().secret.hex())\n"
    )
    env = dict(os.environ, **{SECRET_ENV: "00aa11bb"})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["00aa11bb", "00aa11bb"]


def test_run_command_names_a_missing_binary() -> None:
    with pytest.raises(JobError, match="`regent-no-such-tool` not found on PATH"):
        run_command(["regent-no-such-tool"])
    with pytest.raises(JobError, match="exit code 3"):
        run_command([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_launcher_refuses_to_run_outside_a_scheduler(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_PROCID"}
    proc = subprocess.run(launcher_command(sys.executable, ["--address-dir", str(tmp_path)]),
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "$SLURM_PROCID is not set" in proc.stderr


def test_launcher_publishes_address_only_once_listening_and_forwards_sigterm(tmp_path) -> None:
    # HOME points at tmp_path so "~/secret" exercises the expansion SkyPilot's run step relies on.
    env = dict(os.environ, SLURM_PROCID="3", OMP_NUM_THREADS="1", HOME=str(tmp_path))
    write_secret_file(tmp_path / "secret", "0123456789abcdef")
    proc = subprocess.Popen(
        launcher_command(sys.executable, ["--address-dir", str(tmp_path), "--interface", "lo",
                                          "--secret-file", "~/secret"]),
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the worker's own output may come first
        while line and not line.startswith(ADDRESS_MARKER):
            line = proc.stdout.readline()
        assert line.startswith(f"{ADDRESS_MARKER} rank=3 address=tcp://127.0.0.1:"), line
        address = address_file(tmp_path, 3).read_text().strip()
        assert line.split("address=")[1].strip() == address
        port = int(address.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
        proc.terminate()
        proc.wait(timeout=30)
        assert not is_listening("127.0.0.1", port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (parent-death signal)")
def test_worker_does_not_outlive_a_sigkilled_launcher(tmp_path) -> None:
    env = dict(os.environ, SLURM_PROCID="0", OMP_NUM_THREADS="1")
    write_secret_file(tmp_path / "secret", "0123456789abcdef")
    proc = subprocess.Popen(
        launcher_command(sys.executable, ["--address-dir", str(tmp_path), "--host", "127.0.0.1",
                                          "--secret-file", str(tmp_path / "secret")]),
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith(ADDRESS_MARKER):
            line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1])
        assert is_listening("127.0.0.1", port)
    finally:
        proc.kill()  # SIGKILL: the launcher cannot forward anything
        proc.wait()
    deadline = time.monotonic() + 30
    while is_listening("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not is_listening("127.0.0.1", port)


def test_attaching_with_a_secret_the_runtime_does_not_share_is_explained() -> None:
    code = (
        "from regent.actor import attach_to_workers\n"
        "from regent.actor._process import get_runtime\n"
        "from regent.jobs.base import JobError, _call_attach\n"
        "mesh = _call_attach(attach_to_workers, ['tcp://127.0.0.1:9'], get_runtime().secret.hex(), 'ok')\n"
        "print(type(mesh).__name__)\n"
        "try:\n"
        "    _call_attach(attach_to_workers, ['tcp://127.0.0.1:9'], 'ab12', 'bad')\n"
        "except JobError as exc:\n"
        "    print('JobError:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "HostMesh"
    assert lines[1].startswith("JobError: the workers of this job use a different secret")
    assert "create the job without secret=" in lines[1]
