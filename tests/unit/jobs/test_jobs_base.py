"""The job contract's shared pieces: registry, names, secrets, address publication, the worker launcher."""

from __future__ import annotations

import shutil
import socket
import stat
import sys

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
    listening_sockets,
    parse_address_markers,
    parse_interface_addresses,
    pick_free_port,
    read_published_addresses,
    resolve_secret,
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
