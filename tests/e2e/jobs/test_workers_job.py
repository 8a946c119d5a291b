"""`--job workers`: claims on real `regent worker` processes (loopback), spares, dead hosts, clear errors.

The workers are real `regent worker` processes started with the controller's secret in a 0600 file; a "host"
dies by SIGKILL of its worker. Namespaced hosts (several IPs) are in test_multihost_netns.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from regent.actor import Actor, endpoint
from regent.actor._process import get_runtime
from regent.jobs import make_job
from regent.jobs.base import JobFailedError, JobTimeoutError
from regent.jobs.workers import WorkersJob, parse_worker_addresses
from regent.orchestrate.config import ConfigError, RunConfig, validate


class Where(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _start_worker(secret_file: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGENT_JOB_SECRET")}
    proc = subprocess.Popen([sys.executable, "-m", "regent.cli", "worker", "--address", "tcp://127.0.0.1:0",
                             "--secret-file", str(secret_file)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**env, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("regent worker serving "), line
    return proc, line.split()[-1]


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    """Three live workers on loopback sharing this process's runtime secret (0600 file)."""
    secret_file = tmp_path / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(get_runtime().secret.hex())
    started = [_start_worker(secret_file) for _ in range(3)]
    try:
        yield started
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_bad_addresses_fail_before_anything_is_contacted():
    with pytest.raises(ValueError, match=r"'10\.0\.0\.2:26600' is not a worker address; give tcp://HOST:PORT"):
        parse_worker_addresses("10.0.0.2:26600")
    with pytest.raises(ValueError, match="listed twice"):
        parse_worker_addresses("tcp://a:1,tcp://a:1")
    with pytest.raises(ValueError, match="needs --job.addresses"):
        parse_worker_addresses("")
    with pytest.raises(ValueError, match="not a worker address"):
        parse_worker_addresses("tcp://a:70000")
    assert parse_worker_addresses(["tcp://a:1,tcp://[::1]:2", "tcp://b.c:3"]) == \
        ["tcp://a:1", "tcp://[::1]:2", "tcp://b.c:3"]
    with pytest.raises(ValueError, match="only 1 address"):
        make_job("workers", 2, addresses="tcp://a:1")


def test_config_names_the_fix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("REGENT_JOB_SECRET_FILE", raising=False)
    cfg = RunConfig(job="workers", job_options={"addresses": "tcp://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="set REGENT_JOB_SECRET_FILE"):
        validate(cfg)
    monkeypatch.setenv("REGENT_JOB_SECRET_FILE", "/nonexistent")
    with pytest.raises(ConfigError, match="not a worker address"):
        validate(RunConfig(job="workers", job_options={"addresses": "127.0.0.1:1"}))
    with pytest.raises(ConfigError, match="needs --job.addresses"):
        validate(RunConfig(job="workers"))
    with pytest.raises(ConfigError, match="unknown option 'adresses'"):
        validate(RunConfig(job="workers", job_options={"addresses": "tcp://127.0.0.1:1", "adresses": "x"}))


def test_unreachable_workers_fail_at_once_with_the_fix(tmp_path: Path):
    job = make_job("workers", 1, name="regent-replica-0", addresses="tcp://127.0.0.1:9,tcp://127.0.0.1:7",
                   claim_dir=str(tmp_path / "claims"))
    t0 = time.monotonic()
    with pytest.raises(JobFailedError, match=r"no `regent worker` answers .*refused.*start `regent worker"):
        job.host_mesh(timeout=60)
    assert time.monotonic() - t0 < 10
    job.kill()


def test_replicas_claim_distinct_hosts_and_move_to_a_spare(workers, tmp_path: Path):
    addrs = [a for _, a in workers]
    opts = {"addresses": ",".join(addrs), "claim_dir": str(tmp_path / "claims"), "probe_timeout": "1"}
    jobs = [make_job("workers", 1, name=f"regent-replica-{i}", gpus_per_host=None, **opts) for i in range(2)]
    fresh = None
    try:
        got = [j.worker_addresses(timeout=10) for j in jobs]
        assert got == [[addrs[0]], [addrs[1]]]  # each replica its own slot; the third is a spare
        assert addrs[0] in jobs[0].describe()
        # a real attach through the claimed worker (the probe's bare connection did not upset it)
        procs = jobs[0].host_mesh(timeout=10).spawn_procs(per_host={"gpus": 1})
        assert procs.spawn("where", Where).pid.call_one().get(timeout=60) > 0
        procs.stop().get(timeout=30)
        assert jobs[0].problem() is None and jobs[0].is_alive()

        workers[0][0].send_signal(signal.SIGKILL)  # replica 0's host dies
        workers[0][0].wait(10)
        problem = jobs[0].problem()
        assert problem and addrs[0] in problem and "is gone" in problem
        # the fresh allocation (made before the old one is released, as the orchestrator does) takes the spare
        fresh = make_job("workers", 1, name="regent-replica-0", **opts)
        assert fresh.worker_addresses(timeout=10) == [addrs[2]]
        jobs[0].kill()
        # no spare left and replica 1's host taken: a third replica waits, then says what it waited for
        third = make_job("workers", 1, name="regent-replica-2", **opts)
        with pytest.raises(JobTimeoutError, match=r"in use by pid .*down \(.*list spare hosts"):
            third.worker_addresses(timeout=2)
        third.kill()
        # a claim is released by kill(): the host is free again
        jobs[1].kill()
        again = make_job("workers", 1, name="regent-replica-1", **opts)
        assert again.worker_addresses(timeout=10) == [addrs[1]]
        again.kill()
    finally:
        for j in jobs:
            j.kill()
        if fresh is not None:
            fresh.kill()


def test_renew_keeps_options_and_claims_anew(workers, tmp_path: Path):
    addrs = [a for _, a in workers]
    job = WorkersJob(2, name="regent-replica-0", addresses=addrs, claim_dir=str(tmp_path / "claims"))
    assert job.worker_addresses(timeout=10) == addrs[:2]
    fresh = job.renew()
    try:
        assert not job.is_alive()
        assert fresh.worker_addresses(timeout=10) == addrs[:2] and fresh.secret == job.secret
    finally:
        fresh.kill()
