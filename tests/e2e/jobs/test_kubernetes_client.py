"""KubernetesJob's client path, driven through the official `kubernetes` client against
`RecordedKubeApiStub` (tests/support/kube_api_stub.py), a recorded-response stub of the Kubernetes REST API:
create/read/delete of Secrets, Services and Jobs, listing Pods by label, the Job controller's pods, and in
"run" mode a tiny kubelet that runs each pod's container command as a local process.

This checks request shapes, polling, error handling and cleanup, not a cluster: scheduling, images and
networking are not exercised."""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from regent.jobs.base import JobError, JobFailedError, JobTimeoutError, pick_free_port
from regent.jobs.kubernetes import JOB_LABEL, KubernetesJob
from tests.support.kube_api_stub import RecordedKubeApiStub


@pytest.fixture
def api(tmp_path: Path):
    with RecordedKubeApiStub() as server:
        yield server


def _job(tmp_path: Path, api: RecordedKubeApiStub, **kw: Any) -> KubernetesJob:
    opts: dict[str, Any] = dict(image="registry.local/regent:test", namespace="ml", secret="6b38732d736563726574",
                                kubeconfig=api.write_kubeconfig(tmp_path / "kubeconfig"), gpus_per_host=2, platform="rocm")
    opts.update(kw)
    return KubernetesJob(3, **opts)


def test_start_wait_and_kill_through_the_rest_api(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    job = _job(tmp_path, api)
    job.start()
    name = job.spec.name
    assert api.names("secrets") == [f"{name}-secret"]
    assert api.names("services") == [name]
    assert api.names("jobs") == [name]
    secret = api.objects[("secrets", "ml", f"{name}-secret")]
    assert base64.b64decode(secret["data"]["secret"]) == b"6b38732d736563726574"
    created = api.objects[("jobs", "ml", name)]
    container = created["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"amd.com/gpu": "2"}
    assert created["metadata"]["labels"][JOB_LABEL] == name

    addresses = job.worker_addresses(timeout=60)
    assert addresses == ["tcp://10.8.0.10:26600", "tcp://10.8.0.11:26600", "tcp://10.8.0.12:26600"]
    assert api.lists > api.ready_after_lists  # it polled until the pods turned Ready
    assert job.is_alive()

    api.objects[("jobs", "ml", name)]["status"] = {
        "failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    assert not job.is_alive()

    job.kill()
    assert api.names("secrets") == api.names("services") == api.names("jobs") == api.names("pods") == []
    deletes = [path for method, path in api.requests if method == "DELETE"]
    assert any("jobs/" + name in p for p in deletes)
    count = len(api.requests)
    job.kill()
    assert len(api.requests) == count  # idempotent: nothing more sent


def test_renew_replaces_every_object(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    job = _job(tmp_path, api)
    job.start()
    fresh = job.renew()
    try:
        assert fresh.spec.name != job.spec.name and fresh.secret == job.secret
        assert api.names("jobs") == [fresh.spec.name]
        assert api.names("secrets") == [f"{fresh.spec.name}-secret"]
        assert fresh.worker_addresses(timeout=60)[0] == "tcp://10.8.0.10:26600"
    finally:
        fresh.kill()


def test_a_pod_that_cannot_pull_its_image_fails_the_wait(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    api.pod_mode = "image_pull_backoff"
    job = _job(tmp_path, api)
    job.start()
    try:
        with pytest.raises(JobFailedError, match="ImagePullBackOff: pull access denied"):
            job.worker_addresses(timeout=60)
    finally:
        job.kill()


def test_unschedulable_pods_time_out_with_the_schedulers_message(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    api.pod_mode = "unschedulable"
    job = _job(tmp_path, api)
    job.start()
    try:
        with pytest.raises(JobTimeoutError, match=r"0/3 worker pods Ready after 2 s .*Insufficient nvidia.com/gpu"
                                                  r".*kubectl -n ml describe pods"):
            job.worker_addresses(timeout=2)
    finally:
        job.kill()


def test_a_deleted_job_is_reported_not_waited_for(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    api.ready_after_lists = 10**9
    job = _job(tmp_path, api)
    job.start()
    del api.objects[("jobs", "ml", job.spec.name)]
    try:
        with pytest.raises(JobFailedError, match="no longer exists"):
            job.worker_addresses(timeout=60)
        assert not job.is_alive()
    finally:
        job.kill()


def test_a_forbidden_create_names_the_cause(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    api.forbid_creates = True
    job = _job(tmp_path, api)
    with pytest.raises(JobError, match=r"creating Kubernetes job ml/regent-\w+ failed: 403 .*forbidden"):
        job.start()
    assert not job.is_alive()


def test_missing_kubeconfig_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    job = KubernetesJob(1, image="img", secret="ab12", kubeconfig=str(tmp_path / "none"))
    with pytest.raises(JobError, match="cannot load a kubeconfig"):
        job.start()



def test_pods_run_the_generated_worker_command_and_serve_actors(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    import cloudpickle

    from regent.actor import Actor, endpoint

    class PodName(Actor):
        @endpoint
        def pod(self) -> str:
            return os.environ["POD_NAME"]

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    api.pod_mode, api.kubelet_dir = "run", tmp_path / "kubelet"
    job = _job(tmp_path, api, secret=None, gpus_per_host=None, port=pick_free_port("127.0.0.1"))
    try:
        hosts = job.host_mesh(timeout=120)
        procs = hosts.spawn_procs(per_host={"procs": 1})
        names = list(procs.spawn("pod", PodName).pod.call().get(timeout=120).values())
        assert [n.rsplit("-", 2)[-2] for n in names] == ["0", "1", "2"]  # ranks follow completion indices
        assert all(n.startswith(job.spec.name) for n in names)
        procs.stop().get(timeout=60)
    finally:
        job.kill()
    assert all(p.poll() is not None for p in api.processes.values()) and not api.processes


@pytest.mark.parametrize("scenario,expected", [
    ("preempted", "preempted by the scheduler for a higher-priority pod"),
    ("evicted", "terminated by the kubelet (node pressure"),
    ("node_lost", "tainted NoExecute (the node was lost"),
    ("oom_killed", "its worker exited with code 137 (OOMKilled); raise --job.memory"),
])
def test_problem_names_a_lost_pod_so_the_replica_reallocates(
    tmp_path: Path, api: RecordedKubeApiStub, scenario: str, expected: str,
) -> None:
    """What the orchestrator asks before an in-place restart (`problem()`), per recorded pod status."""
    job = _job(tmp_path, api)
    job.start()
    try:
        job.worker_addresses(timeout=60)
        assert job.problem() is None  # healthy pods: an in-place restart is fine
        victim = api.pods_of(job.spec.name)[1]["metadata"]["name"]
        api.disrupt(victim, scenario)
        problem = job.problem()
        assert problem is not None and f"pod {victim} (index 1)" in problem, problem
        assert expected in problem, problem
        assert "fresh allocation" in problem
    finally:
        job.kill()
    assert job.problem() == f"{job.describe()} was released by this controller"


def test_problem_sees_a_vanished_pod_and_a_deleted_job(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    job = _job(tmp_path, api)
    job.start()
    try:
        job.worker_addresses(timeout=60)
        api.delete_pod(api.pods_of(job.spec.name)[2]["metadata"]["name"])
        assert "pod(s) of index 2 are gone" in (job.problem() or "")
        del api.objects[("jobs", "ml", job.spec.name)]
        assert "no longer exists" in (job.problem() or "")
    finally:
        job.kill()


def test_objects_that_fail_the_1_30_schema_are_refused_like_an_api_server(
    tmp_path: Path, api: RecordedKubeApiStub,
) -> None:
    """The stub admits only what validates (strict), so every object KubernetesJob created in these tests did;
    and a bad option is refused with a JobError that names it, leaving nothing behind."""
    import json
    import urllib.error
    import urllib.request

    pytest.importorskip("kubernetes_validate")
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"clusterIp": "None"}}
    request = urllib.request.Request(f"{api.url}/api/v1/namespaces/ml/services", data=json.dumps(bad).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 422 and "clusterIp" in json.loads(refused.value.read())["message"]

    job = _job(tmp_path, api, tolerations=[{"key": "gpu", "operatr": "Exists"}])  # a misspelt field
    with pytest.raises(JobError, match=r"(?s)failed before reaching the API server: .*operatr"):
        job.start()
    assert api.names("jobs") == api.names("secrets") == api.names("services") == []  # cleaned up
    good = _job(tmp_path, api, cpu="4", memory="16Gi", priority_class="regent-high")
    good.start()
    try:
        kinds = [o["kind"] for o in api.created]
        assert kinds[-3:] == ["Secret", "Service", "Job"]
        pod_spec = api.created[-1]["spec"]["template"]["spec"]
        assert pod_spec["priorityClassName"] == "regent-high"
    finally:
        good.kill()


def test_pod_bootstrap_reads_the_secret_from_the_mounted_file_only(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    """The pod side, as local processes: `regent worker` gets the secret from the 0400 Secret volume file; the
    secret is on no command line and in no environment (the stub's kubelet gives pods none of the controller's)."""
    secret = "a1b2c3d4e5f60718293a4b5c6d7e8f90"
    api.pod_mode, api.kubelet_dir = "run", tmp_path / "kubelet"
    job = _job(tmp_path, api, secret=secret, gpus_per_host=None, port=pick_free_port("127.0.0.1"))
    try:
        job.start()
        addresses = job.worker_addresses(timeout=120)
        assert len(addresses) == 3
        for pod in api.pods_of(job.spec.name):
            pid = api.processes[pod["metadata"]["name"]].pid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode()
            assert secret not in cmdline and secret not in environ
            secret_file = cmdline.split("\0")[cmdline.split("\0").index("--secret-file") + 1]
            assert Path(secret_file).read_text() == secret
            assert Path(secret_file).stat().st_mode & 0o777 == 0o400
    finally:
        job.kill()


def test_a_recorded_allocation_is_released_after_its_owner_died(tmp_path: Path, api: RecordedKubeApiStub) -> None:
    """A replica process SIGKILLed with its job never ran kill(): the record its `allocation` event carries is
    enough for a resumed controller to delete the Job, Service and Secret (and a second release is harmless)."""
    from regent.jobs.base import release_recorded

    job = _job(tmp_path, api)
    job.start()
    ref = json.loads(json.dumps(job.reference()))  # as it travels: through events.jsonl
    del job  # the owner is gone; kill() never runs
    assert api.names("jobs") and api.names("services") and api.names("secrets")
    assert release_recorded(ref).startswith("deleted Kubernetes job ml/")
    assert api.names("secrets") == api.names("services") == api.names("jobs") == []
    release_recorded(ref)  # already gone: 404s are fine
    assert KubernetesJob(1, image="x", namespace="ml").reference() is None  # not started: nothing to release
