"""SkyPilotJob's pure parts (task YAML, `sky status` parsing) and its error when the CLI is missing.

SkyPilot and cloud credentials are not available here, so `sky launch/logs/status/down` is not run."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from regent.jobs.base import ADDRESS_MARKER, JobError, JobFailedError, parse_address_markers
from regent.jobs.skypilot import (
    REMOTE_SECRET,
    SkyPilotJob,
    SkyPilotSpec,
    build_task,
    build_task_yaml,
    parse_cluster_status,
)


def _spec(**kw) -> SkyPilotSpec:
    base = dict(name="regent-1234abcd", hosts=4, secret_path="/tmp/regent-sky/secret")
    base.update(kw)
    return SkyPilotSpec(**base)


def test_task_has_one_node_per_host_and_opens_the_worker_port() -> None:
    task = build_task(_spec(gpus_per_host=8, accelerator="MI300X", cloud="kubernetes", use_spot=True))
    assert task["name"] == "regent-1234abcd" and task["num_nodes"] == 4
    assert task["resources"] == {"accelerators": "MI300X:8", "cloud": "kubernetes", "use_spot": True}
    assert build_task(_spec(open_port=True))["resources"]["ports"] == [26600]  # public only when asked
    assert task["file_mounts"] == {REMOTE_SECRET: "/tmp/regent-sky/secret"}
    assert f"chmod 600 {REMOTE_SECRET}" in task["setup"]
    assert "pip install regent-ml" in task["setup"]


def test_run_step_starts_the_launcher_on_the_node_ip() -> None:
    run = build_task(_spec(python="/opt/py/bin/python"))["run"]
    exec_line = [line for line in run.splitlines() if line.startswith("exec ")][0]
    argv = shlex.split(exec_line.removeprefix("exec ").replace('"$NODE_IP"', "NODE_IP"))
    assert argv[0] == "/opt/py/bin/python" and argv[1] == "-c"
    assert "launch_worker" in argv[2]
    assert argv[3:] == ["--rank-env", "SKYPILOT_NODE_RANK", "--port", "26600", "--secret-file", REMOTE_SECRET,
                        "--host", "NODE_IP"]
    assert 'sed -n "$((SKYPILOT_NODE_RANK + 1))p"' in run


def test_yaml_is_valid_and_carries_no_secret_value(tmp_path) -> None:
    job = SkyPilotJob(2, secret="c0ffee0042", env={"HF_HOME": "/data/hf"}, setup=["pip install -e ."])
    text = build_task_yaml(job.spec)
    assert "c0ffee0042" not in text
    task = json.loads(text)  # JSON is a YAML subset
    assert task["envs"]["HF_HOME"] == "/data/hf"
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(text) == task


def test_accelerator_without_count_and_no_gpus() -> None:
    assert "accelerators" not in build_task(_spec())["resources"]
    assert build_task(_spec(accelerator="tpu-v5-8"))["resources"]["accelerators"] == "tpu-v5-8"


STATUS = """\
Clusters
NAME              INFRA             RESOURCES                          STATUS   AUTOSTOP  LAUNCHED
regent-1234abcd   Kubernetes (ctx)  4x(gpus=H100:8, cpus=64, mem=512)  UP       -         3 mins ago
regent-ffff0000   AWS (us-east-1)   2x(gpus=H100:8)                    STOPPED  -         1 day ago

Managed jobs
No in-progress managed jobs.
"""


def test_parse_cluster_status() -> None:
    assert parse_cluster_status(STATUS, "regent-1234abcd") == "UP"
    assert parse_cluster_status(STATUS, "regent-ffff0000") == "STOPPED"
    assert parse_cluster_status(STATUS, "regent-absent") is None
    assert parse_cluster_status("No existing clusters.\n", "regent-1234abcd") is None


def test_addresses_come_from_marker_lines_in_sky_logs() -> None:
    log = "\n".join([
        "(setup pid=1) Successfully installed regent-ml",
        f"(head, rank=0, pid=2) {ADDRESS_MARKER} rank=0 address=tcp://10.0.0.4:26600",
        f"(worker1, rank=1, pid=3) {ADDRESS_MARKER} rank=1 address=tcp://10.0.0.5:26600",
    ])
    assert parse_address_markers(log) == {0: "tcp://10.0.0.4:26600", 1: "tcp://10.0.0.5:26600"}


def test_missing_sky_cli_is_a_clear_error() -> None:
    job = SkyPilotJob(2, secret="ab12", sky="regent-no-such-sky")
    with pytest.raises(JobError, match="SkyPilot CLI `regent-no-such-sky` is not installed.*pip install"):
        job.start()
    assert not job.is_alive()
    job.kill()
    job.kill()


@pytest.mark.skipif(shutil.which("false") is None, reason="no `false` binary")
def test_a_failed_background_launch_is_reported_and_leaves_no_secret_copy() -> None:
    """`false` stands in for a `sky` whose launch fails: start() returns at once (launch runs in the
    background), and the wait reports the failure instead of polling logs of a cluster that never came up."""
    job = SkyPilotJob(2, secret="ab12", sky="false")
    job.start()
    try:
        assert Path(job.spec.secret_path).exists()  # while launching, the file mount source must exist
        with pytest.raises(JobFailedError, match=r"`sky launch` for SkyPilot cluster regent-\w+ failed with exit code 1"):
            job.worker_addresses(timeout=60)
        assert not Path(job.spec.secret_path).exists()
    finally:
        job.kill()
    assert not job.is_alive()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_setup_and_run_are_valid_bash() -> None:
    import subprocess

    task = build_task(_spec(setup=("pip install 'regent-ml[k8s]'",), env={"A": "b c"}))
    for script in (task["setup"], task["run"]):
        proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr



@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_step_serves_a_worker_as_it_would_on_a_node(tmp_path: Path) -> None:
    """Run the generated run step with the variables SkyPilot sets on node 1 of 2 (no cloud needed)."""
    import os
    import signal
    import subprocess
    import sys

    from regent.jobs.base import is_listening, pick_free_port, write_secret_file

    port = pick_free_port("127.0.0.1")
    task = build_task(_spec(hosts=2, port=port, python=sys.executable))
    write_secret_file(tmp_path / ".regent" / "job-secret", "00ff00ff")
    env = dict(os.environ, HOME=str(tmp_path), SKYPILOT_NODE_RANK="1", SKYPILOT_NODE_IPS="10.9.9.9\n127.0.0.1",
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(["bash", "-c", task["run"]], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        while line and ADDRESS_MARKER not in line:
            line = proc.stdout.readline()
        assert parse_address_markers(line) == {1: f"tcp://127.0.0.1:{port}"}
        assert is_listening("127.0.0.1", port)
        proc.send_signal(signal.SIGTERM)  # what `sky down` delivers; exec made bash the launcher itself
        proc.wait(timeout=30)
        assert not is_listening("127.0.0.1", port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
