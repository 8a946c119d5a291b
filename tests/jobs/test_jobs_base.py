"""The job contract's shared pieces: registry, names, secrets, address publication, the worker launcher."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest

from regent.jobs import JOB_BACKENDS, get_job_class, make_job
from regent.jobs.base import (
    ADDRESS_MARKER,
    SECRET_ENV,
    JobError,
    address_file,
    decode_proc_net_address,
    environ_without_secret,
    format_address,
    interface_ip,
    is_listening,
    launcher_command,
    listening_sockets,
    parse_address_markers,
    parse_interface_addresses,
    pick_free_port,
    read_published_addresses,
    resolve_secret,
    run_command,
    validate_job_name,
    worker_command,
    write_secret_file,
)
from regent.jobs.slurm import SlurmJob


def test_registry_knows_every_backend_and_aliases() -> None:
    assert JOB_BACKENDS == ("local", "slurm", "k8s", "skypilot", "workers")
    assert get_job_class("slurm").__name__ == "SlurmJob"
    assert get_job_class("k8s").__name__ == "KubernetesJob"
    assert get_job_class("kubernetes") is get_job_class("k8s")
    assert get_job_class("SkyPilot").__name__ == "SkyPilotJob"
    assert get_job_class("workers").__name__ == "WorkersJob"
    with pytest.raises(ValueError, match="unknown job backend 'pbs'.*local, slurm, k8s, skypilot, workers"):
        get_job_class("pbs")


def test_local_backend_is_the_actor_runtimes_process_job() -> None:
    cls = get_job_class("local")
    assert cls.__name__ == "ProcessJob"


def test_make_job_passes_options_and_rejects_typos(tmp_path) -> None:
    job = make_job("slurm", 2, name="regent-replica-0", partition="gpu", shared_dir=tmp_path, secret="ab")
    assert job.hosts == 2 and job.name == "regent-replica-0" and job.spec.partition == "gpu"
    assert not job.started  # constructed, not launched
    with pytest.raises(TypeError, match="partiton"):
        make_job("slurm", 2, partiton="gpu")


def test_make_job_local_drops_contract_options_it_does_not_need() -> None:
    job = make_job("local", 2, name="regent-replica-1", gpus_per_host=None)
    assert type(job).__name__ == "ProcessJob"


def test_importing_regent_jobs_pulls_in_no_backend_or_torch() -> None:
    code = ("import sys, regent.jobs; "
            "bad = [m for m in ('torch', 'kubernetes', 'regent.jobs.slurm') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["regent", "replica-0", "a", "r2d2"])
def test_valid_job_names(name: str) -> None:
    assert validate_job_name(name) == name


@pytest.mark.parametrize("name", ["", "Regent", "-x", "x-", "under_score", "x" * 41, "dot.ted", "2fast"])
def test_invalid_job_names_are_rejected_before_launch(name: str) -> None:
    with pytest.raises(ValueError, match="lowercase letters, digits"):
        validate_job_name(name)


def test_explicit_secrets_are_hex_text() -> None:
    assert resolve_secret("ABCD01") == "abcd01"
    assert resolve_secret(b"\x01\xff") == "01ff"
    for bad in ("has space", "not-hex", "", b""):
        with pytest.raises(ValueError, match="secret"):
            resolve_secret(bad)
    with pytest.raises(ValueError, match="token_hex"):
        SlurmJob(1, secret="slurm-secret")  # rejected at construction, before anything launches


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


def test_environment_for_schedulers_drops_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "x")
    monkeypatch.setenv("REGENT_OTHER", "y")
    env = environ_without_secret()
    assert SECRET_ENV not in env and env["REGENT_OTHER"] == "y"


def test_secret_file_is_owner_only_and_replaced(tmp_path) -> None:
    path = write_secret_file(tmp_path / "d" / "secret", "one")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_secret_file(path, "two")
    assert path.read_text() == "two" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_secret_never_appears_on_the_worker_command_line() -> None:
    cmd = worker_command("tcp://10.0.0.1:5000", "/dir/secret", python="py")
    assert cmd == ["py", "-m", "regent.cli", "worker", "--address", "tcp://10.0.0.1:5000",
                   "--secret-file", "/dir/secret"]


def test_published_addresses_and_markers(tmp_path) -> None:
    address_file(tmp_path, 1).write_text("tcp://10.0.0.2:7\n")
    assert read_published_addresses(tmp_path, 3) == {1: "tcp://10.0.0.2:7"}
    assert read_published_addresses(tmp_path / "missing", 3) == {}
    log = (f"(head, rank=0) {ADDRESS_MARKER} rank=0 address=tcp://10.0.0.1:26600\n"
           f"(worker1) noise\n(worker1) {ADDRESS_MARKER} rank=1 address=tcp://10.0.0.2:26600\n")
    assert parse_address_markers(log) == {0: "tcp://10.0.0.1:26600", 1: "tcp://10.0.0.2:26600"}


def test_format_address_brackets_ipv6() -> None:
    assert format_address("10.0.0.1", 80) == "tcp://10.0.0.1:80"
    assert format_address("fd00::2", 80) == "tcp://[fd00::2]:80"


def test_listening_detection_sees_a_real_listener_on_its_own_address() -> None:
    port = pick_free_port("127.0.0.1")
    assert not is_listening("127.0.0.1", port)
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert is_listening("127.0.0.1", port)
        # Another address with the same port is a different socket (pods on one host share ports).
        assert not is_listening("127.0.0.2", port)
        sockets = listening_sockets()
        assert sockets is None or ("127.0.0.1", port) in sockets


def test_proc_net_addresses_decode() -> None:
    if sys.byteorder != "little":
        pytest.skip("the sample lines are from a little-endian host")
    assert decode_proc_net_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert decode_proc_net_address("00000000000000000000000001000000:0050") == ("::1", 80)


IP_ADDR = """\
2: eth0    inet6 fe80::1/64 scope link \\       valid_lft forever preferred_lft forever
2: eth0    inet 10.1.2.3/16 brd 10.1.255.255 scope global eth0\\       valid_lft forever preferred_lft forever
2: eth0    inet6 fd00::5/64 scope global \\       valid_lft forever preferred_lft forever
"""


def test_interface_addresses_prefer_ipv4_and_skip_link_local() -> None:
    assert parse_interface_addresses(IP_ADDR) == ["10.1.2.3", "fd00::5"]
    assert parse_interface_addresses("") == []


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 not installed")
def test_interface_ip_reads_a_real_interface() -> None:
    assert interface_ip("lo") == "127.0.0.1"
    with pytest.raises(JobError, match="interface 'regent-nope0' has no usable address"):
        interface_ip("regent-nope0")


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
