"""SlurmJob against a real SLURM cluster (the single-node one `.ci/install_slurm.sh` starts).

Skipped with a reason when SLURM is not installed or its controller does not answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regent.jobs.base import SECRET_ENV, JobError, JobFailedError, JobTimeoutError
from regent.jobs.slurm import SlurmJob, unavailable_reason

_REASON = unavailable_reason()  # one check, shared with the other real-SLURM tests
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=_REASON or ""), pytest.mark.slow]



def _worker_pids(address: str) -> list[int]:
    """Pids of `regent worker` processes serving `address` (read from /proc, no cooperation needed)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in argv and address.encode() in argv:
            pids.append(int(entry.name))
    return pids


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _wait_gone(job: SlurmJob, addresses: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job.scheduler_state()
        if (state is None or state[0] not in ("RUNNING", "COMPLETING", "PENDING")) and not any(
            _worker_pids(a) for a in addresses
        ):
            return
        time.sleep(0.5)
    raise AssertionError(f"{job.describe()} still has workers after scancel: state {job.scheduler_state()}")


def _job(tmp_path: Path, **kw) -> SlurmJob:
    opts = dict(ntasks_per_node=2, cpus_per_task=1, shared_dir=tmp_path, secret="5eed0123",
                python=sys.executable, env={"OMP_NUM_THREADS": "1"})
    opts.update(kw)
    return SlurmJob(2, **opts)


def test_two_hosts_under_slurm_then_renew_and_scancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(tmp_path, name="regent-real", secret=None)  # the controller runtime's secret
    monkeypatch.setenv(SECRET_ENV, job.secret)  # sbatch copies the environment: the job must drop this
    renewed = None
    try:
        job.start()
        job.start()  # idempotent
        assert job.job_id and job.is_alive()
        addresses = job.worker_addresses(timeout=180)
        assert len(addresses) == 2 and len(set(addresses)) == 2
        for address in addresses:
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host.strip("[]"), int(port)), timeout=10):
                pass
            pids = _worker_pids(address)
            assert pids, f"no worker process serves {address}"
            env = _environ(pids[0])
            assert env.get("SLURM_JOB_ID") == job.job_id  # it really runs inside the allocation
            assert SECRET_ENV not in env  # the secret reached it by file only
        assert job.scheduler_state()[0] == "RUNNING"
        squeue = subprocess.run(["squeue", "-h", "-j", job.job_id, "-o", "%j"], capture_output=True, text=True)
        assert squeue.stdout.strip() == job.unique_name

        _call_an_actor_on(job)

        renewed = job.renew()
        assert not job.is_alive() and renewed.job_id != job.job_id
        assert not (job.job_dir / "secret").exists() and job.log_path.exists()
        assert renewed.secret == job.secret and renewed.hosts == 2
        _wait_gone(job, addresses)
        new_addresses = renewed.worker_addresses(timeout=180)
        assert len(new_addresses) == 2
        renewed.kill()
        renewed.kill()  # idempotent
        _wait_gone(renewed, new_addresses)
        assert not renewed.is_alive()
    finally:
        job.kill()
        if renewed is not None:
            renewed.kill()


def _call_an_actor_on(job: SlurmJob) -> None:
    """Attach to the SLURM workers, spawn one proc per host, and call an endpoint on each."""
    import cloudpickle

    from regent.actor import Actor, endpoint

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class WhereAmI(Actor):
        @endpoint
        def where(self) -> str | None:
            return os.environ.get("SLURM_JOB_ID")

    hosts = job.host_mesh(timeout=180)
    assert job.host_mesh() is hosts and job.state().hosts is hosts  # attached once, Monarch-style state()
    assert hosts.extent["hosts"] == 2
    procs = hosts.spawn_procs(per_host={"procs": 1})
    try:
        where = procs.spawn("where", WhereAmI)
        values = list(where.where.call().get(timeout=120).values())
        assert values == [job.job_id, job.job_id]  # the actors' processes run inside the allocation
    finally:
        procs.stop().get(timeout=60)


def test_a_job_that_cannot_start_workers_fails_fast_with_its_log(tmp_path: Path) -> None:
    job = _job(tmp_path, python="/nonexistent/python3")
    try:
        job.start()
        with pytest.raises(JobFailedError, match=r"(ended in state FAILED|no longer known).*slurm-\d+\.out"):
            job.worker_addresses(timeout=120)
        assert not job.is_alive()
    finally:
        job.kill()


def test_a_pending_job_times_out_naming_the_reason(tmp_path: Path) -> None:
    job = _job(tmp_path, sbatch_args=("--begin=now+1hour",))
    try:
        job.start()
        assert job.is_alive()  # pending counts as alive
        with pytest.raises(JobTimeoutError, match=r"still PENDING \(reason: BeginTime\)"):
            job.worker_addresses(timeout=3)
    finally:
        job.kill()
    deadline = time.monotonic() + 30
    while job.scheduler_state() is not None and job.scheduler_state()[0] == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.scheduler_state() is None or job.scheduler_state()[0] == "CANCELLED"


def test_sbatch_rejection_is_a_job_error(tmp_path: Path) -> None:
    job = _job(tmp_path, partition="regent-no-such-partition")
    try:
        with pytest.raises(JobError, match="sbatch.*exit code.*[Ii]nvalid partition"):
            job.start()
        assert job.job_id is None and not job.is_alive()
        job.kill()
        assert not (job.job_dir / "secret").exists()
    finally:
        job.kill()


@pytest.mark.parametrize("kill_on_exit", [True, False])
def test_controller_exit_releases_the_allocation_unless_told_not_to(tmp_path: Path, kill_on_exit: bool) -> None:
    code = (
        "from regent.jobs.slurm import SlurmJob, unavailable_reason\n"
        f"job = SlurmJob(1, secret='ab12', shared_dir={str(tmp_path)!r}, sbatch_args=['--begin=now+1hour'])\n"
        f"job.kill_on_exit = {kill_on_exit}\n"
        "job.start()\n"
        "print(job.job_id)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    state = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                           text=True).stdout.strip()
    try:
        assert state == ("CANCELLED" if kill_on_exit else "PENDING")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


def test_an_allocation_whose_owner_was_sigkilled_is_released_from_its_record(tmp_path: Path) -> None:
    """SIGKILL runs no atexit: the job stays queued. Its `reference()` (recorded in the run's events) lets a
    resumed controller cancel it; a second release of an ended job is harmless."""
    import json
    import signal

    from regent.jobs.base import release_recorded

    code = (
        "import json, os, signal\n"
        "from regent.jobs.slurm import SlurmJob\n"
        f"job = SlurmJob(1, secret='ab12', shared_dir={str(tmp_path)!r}, sbatch_args=['--begin=now+1hour'])\n"
        "job.start()\n"
        "print(json.dumps(job.reference()), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    state = lambda: subprocess.run(["squeue", "-h", "-t", "all", "-j", ref["job_id"], "-o", "%T"],  # noqa: E731
                                   capture_output=True, text=True).stdout.strip()
    try:
        assert state() == "PENDING"  # the owner died; nothing released it
        assert Path(ref["secret_file"]).exists()
        assert release_recorded(ref).startswith("cancelled SLURM job")
        assert state() == "CANCELLED" and not Path(ref["secret_file"]).exists()
        assert release_recorded(ref)  # again: scancel of an ended job is reported, not raised
    finally:
        subprocess.run(["scancel", ref["job_id"]], capture_output=True)
