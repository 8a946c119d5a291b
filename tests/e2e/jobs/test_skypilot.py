"""SkyPilotJob's pure parts (the task), its run step on a "node", and the launch flow through SkyPilot's Python
API against SkyApiStub (tests/support/sky_api_stub.py), a stub of the `sky` module named as such.

SkyPilot and cloud credentials are not available here: the real API server and a cloud are not exercised."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from regent.actor import Actor, endpoint
from regent.jobs.base import (
    ADDRESS_MARKER,
    JobError,
    JobFailedError,
    JobTimeoutError,
    parse_address_markers,
    pick_free_port,
)
from regent.jobs.skypilot import (
    REMOTE_SECRET,
    SkyPilotJob,
    SkyPilotSpec,
    build_task,
    build_task_yaml,
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


def test_addresses_come_from_marker_lines_in_sky_logs() -> None:
    log = "\n".join([
        "(setup pid=1) Successfully installed regent-ml",
        f"(head, rank=0, pid=2) {ADDRESS_MARKER} rank=0 address=tcp://10.0.0.4:26600",
        f"(worker1, rank=1, pid=3) {ADDRESS_MARKER} rank=1 address=tcp://10.0.0.5:26600",
    ])
    assert parse_address_markers(log) == {0: "tcp://10.0.0.4:26600", 1: "tcp://10.0.0.5:26600"}


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


# --- the launch flow through the `sky` Python API, against SkyApiStub -----------------------------------

@pytest.fixture
def sky_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    from tests.support.sky_api_stub import SkyApiStub

    api, records = getattr(request, "param", ("requests", "dict"))
    stub = SkyApiStub(tmp_path / "cloud", api=api, records=records)
    monkeypatch.setitem(sys.modules, "sky", stub.module)
    try:
        yield stub
    finally:
        stub.close()


def _sky_job(**kw) -> SkyPilotJob:
    opts = dict(secret="5c1e5c1e5c1e5c1e", setup=(), python=sys.executable, port=pick_free_port("127.0.0.1"))
    opts.update(kw)
    return SkyPilotJob(2, **opts)


class NodeRank(Actor):
    @endpoint
    def rank(self) -> str:
        import os

        return os.environ["SKYPILOT_NODE_RANK"]


@pytest.mark.parametrize("sky_stub", [("requests", "dict"), ("direct", "object")], indirect=True,
                         ids=["sdk-requests", "sdk-direct"])
def test_launch_flow_through_the_python_api_serves_workers(sky_stub) -> None:
    """start -> sky.launch(Task) -> nodes run the task -> addresses from sky.tail_logs -> actors on both nodes
    -> sky.status says UP -> kill -> sky.down. Both SDK generations: request ids + sky.get, and direct results."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    job = _sky_job(idle_minutes_to_autostop=30, secret=None)  # this controller's runtime secret
    try:
        hosts = job.host_mesh(timeout=120)
        (launch,) = [c for c in sky_stub.calls if c[0] == "launch"]
        task, kwargs = launch[1][0], launch[2]
        assert task.config == build_task(job.spec)  # the task handed to sky.launch is exactly build_task's
        assert kwargs["cluster_name"] == job.cluster
        assert kwargs["idle_minutes_to_autostop"] == 30 and kwargs["down"] is True
        assert kwargs.get("detach_run") is (True if sky_stub.api == "direct" else None)
        assert job.secret not in json.dumps(task.config)  # the secret is a file mount, never inline
        assert sky_stub.uploaded_secrets[job.cluster] == job.secret
        assert not Path(job.spec.secret_path).exists()  # the local copy is gone once uploaded
        assert job.sky_job_id == 1

        procs = hosts.spawn_procs(per_host={"procs": 1})
        ranks = sorted(procs.spawn("rank", NodeRank).rank.call().get(timeout=120).values())
        assert ranks == ["0", "1"]
        procs.stop().get(timeout=60)

        assert job.status() == "UP" and job.is_alive() and job.problem() is None
        status_calls = [c for c in sky_stub.calls if c[0] == "status"]
        assert status_calls and all(c[2]["cluster_names"] == [job.cluster] for c in status_calls)
        tails = [c for c in sky_stub.calls if c[0] == "tail_logs"]
        assert tails and all(c[1] == (job.cluster, 1) and c[2]["follow"] is False for c in tails)
        if sky_stub.api == "requests":
            assert [c for c in sky_stub.calls if c[0] == "get"]  # every request id was resolved with sky.get
    finally:
        job.kill()
    assert [c[1] for c in sky_stub.calls if c[0] == "down"] == [(job.cluster,)]
    assert job.cluster not in sky_stub.clusters and not job.is_alive()
    job.kill()  # idempotent: no second sky.down
    assert len([c for c in sky_stub.calls if c[0] == "down"]) == 1


def test_a_failed_launch_is_reported_with_skypilots_error_and_torn_down(sky_stub) -> None:
    sky_stub.fail_launch = True
    job = _sky_job()
    job.start()
    try:
        # (the secret copy exists only while the launch runs: this one fails at once, so it may be gone already)
        with pytest.raises(JobFailedError, match=r"launching SkyPilot cluster regent-\w+ failed: "
                                                 r"ResourcesUnavailableError: Failed to provision .*sky check"):
            job.worker_addresses(timeout=60)
        assert not Path(job.spec.secret_path).exists()
    finally:
        job.kill()
    assert [c[1] for c in sky_stub.calls if c[0] == "down"] == [(job.cluster,)]  # anything half made goes too


def test_a_launch_still_running_times_out_and_is_cancelled(sky_stub) -> None:
    sky_stub.launch_delay.clear()  # provisioning never finishes within the wait
    job = _sky_job()
    job.start()
    try:
        with pytest.raises(JobTimeoutError, match="the launch is still running after 1 s"):
            job.worker_addresses(timeout=1)
    finally:
        job.kill()
        sky_stub.launch_delay.set()
    assert [c for c in sky_stub.calls if c[0] == "api_cancel"]  # the launch request was cancelled
    assert [c for c in sky_stub.calls if c[0] == "down"]


def test_spot_preemption_is_a_lost_allocation(sky_stub) -> None:
    """A preempted spot cluster reports STOPPED: problem() says so (the orchestrator then reallocates)."""
    job = _sky_job(use_spot=True)
    try:
        job.start()
        job.worker_addresses(timeout=120)
        assert job.problem() is None
        sky_stub.preempt(job.cluster)
        assert job.status() == "STOPPED" and not job.is_alive()
        problem = job.problem()
        assert problem is not None and "is STOPPED (spot preemption" in problem and "fresh cluster" in problem
        del sky_stub.clusters[job.cluster]
        assert "no longer listed by sky.status" in (job.problem() or "")
    finally:
        job.kill()


def test_missing_skypilot_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sky", None)  # `import sky` raises ImportError
    job = SkyPilotJob(2, secret="ab12")
    with pytest.raises(JobError, match=r"SkyPilot is not installed \(cannot import sky\): pip install "
                                       r"'skypilot\[<cloud>\]'"):
        job.start()
    assert not job.is_alive()
    job.kill()
    job.kill()
