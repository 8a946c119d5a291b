"""KubernetesJob's pure parts: manifests, pod readiness rules, GPU resource names."""

from __future__ import annotations

import base64

import pytest

from regent.jobs.base import JobFailedError
from regent.jobs.kubernetes import (
    INDEX_ANNOTATION,
    JOB_LABEL,
    KubernetesJob,
    KubernetesSpec,
    build_job_manifest,
    build_secret_manifest,
    build_service_manifest,
    gpu_resource_name,
    pod_view,
    ready_addresses,
)


def _spec(**kw) -> KubernetesSpec:
    base = dict(name="regent-1234abcd", hosts=3, image="ghcr.io/x/regent:1", namespace="ml")
    base.update(kw)
    return KubernetesSpec(**base)


def test_job_manifest_is_an_indexed_job_of_never_restarted_workers() -> None:
    m = build_job_manifest(_spec())
    assert (m["apiVersion"], m["kind"]) == ("batch/v1", "Job")
    assert m["metadata"]["name"] == "regent-1234abcd" and m["metadata"]["namespace"] == "ml"
    spec = m["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 3
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"][JOB_LABEL] == "regent-1234abcd"
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == "regent-1234abcd"
    (container,) = pod["containers"]
    assert container["command"] == ["regent"]
    assert container["args"] == ["worker", "--address", "tcp://$(POD_IP):26600",
                                 "--secret-file", "/var/run/regent/secret/secret"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["readinessProbe"]["tcpSocket"]["port"] == 26600
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["regent-secret"]["secret"] == {"secretName": "regent-1234abcd-secret", "defaultMode": 0o400}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert "resources" not in container


@pytest.mark.parametrize("platform,resource", [("cuda", "nvidia.com/gpu"), ("rocm", "amd.com/gpu")])
def test_gpus_use_the_platforms_resource_name(platform: str, resource: str) -> None:
    container = build_job_manifest(_spec(gpus_per_host=8, platform=platform, cpu="32", memory="256Gi"))[
        "spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {resource: "8", "cpu": "32", "memory": "256Gi"}
    assert container["resources"]["requests"] == {"cpu": "32", "memory": "256Gi"}


def test_gpu_platform_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_PLATFORM", "rocm")
    assert gpu_resource_name() == "amd.com/gpu"
    monkeypatch.delenv("GPU_PLATFORM")
    assert gpu_resource_name() == "nvidia.com/gpu"
    with pytest.raises(ValueError, match="use 'cuda' or 'rocm'"):
        gpu_resource_name("tpu")
    with pytest.raises(ValueError, match="use 'cuda' or 'rocm'"):
        KubernetesJob(2, image="img", gpus_per_host=1, platform="cpu", secret="ab12")


def test_optional_pod_settings() -> None:
    pod = build_job_manifest(_spec(
        node_selector={"gpu": "h200"}, tolerations=[{"key": "gpu", "operator": "Exists"}],
        service_account="trainer", image_pull_secrets=["regcred"], host_network=True, shm_size=None,
        env={"NCCL_DEBUG": "INFO"}, port=30000, command=["python", "-m", "regent.cli"]))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["serviceAccountName"] == "trainer"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert [v["name"] for v in pod["volumes"]] == ["regent-secret"]
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "regent.cli"]
    assert "tcp://$(POD_IP):30000" in container["args"]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in container["env"]


def test_secret_and_service_manifests() -> None:
    spec = _spec()
    secret = build_secret_manifest(spec, "s3cr3t")
    assert secret["metadata"]["name"] == "regent-1234abcd-secret"
    assert base64.b64decode(secret["data"]["secret"]) == b"s3cr3t"
    assert "s3cr3t" not in repr(build_job_manifest(spec))
    service = build_service_manifest(spec)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {JOB_LABEL: "regent-1234abcd"}
    assert service["spec"]["ports"][0]["port"] == 26600


def test_image_is_required() -> None:
    with pytest.raises(ValueError, match="needs image="):
        KubernetesJob(2, secret="ab12")


def _pod(index: int, ready: bool = True, ip: str | None = "10.1.0.1", **status) -> dict:
    return {
        "metadata": {"name": f"w-{index}", "annotations": {INDEX_ANNOTATION: str(index)}},
        "status": {"phase": "Running" if ready else "Pending", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}], **status},
    }


def test_addresses_are_ordered_by_completion_index_once_all_ready() -> None:
    pods = [pod_view(_pod(1, ip="10.0.0.2")), pod_view(_pod(0, ip="10.0.0.1"))]
    assert ready_addresses(pods, 2, 26600) == ["tcp://10.0.0.1:26600", "tcp://10.0.0.2:26600"]
    assert ready_addresses(pods + [pod_view(_pod(2, ready=False))], 3, 26600) is None
    assert ready_addresses(pods[:1], 2, 26600) is None


def test_a_pod_that_cannot_start_fails_the_wait() -> None:
    stuck = _pod(0, ready=False, containerStatuses=[
        {"name": "worker", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}}])
    view = pod_view(stuck)
    assert view.problem == "fatal: ImagePullBackOff: not found"
    with pytest.raises(JobFailedError, match="pod w-0 .* ImagePullBackOff"):
        ready_addresses([view], 1, 26600)
    died = pod_view(_pod(1, ready=False, phase="Failed", containerStatuses=[
        {"name": "worker", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]))
    assert died.problem == "fatal: container exited with code 1 (Error)"


def test_unschedulable_is_reported_but_not_fatal() -> None:
    view = pod_view({"metadata": {"name": "w-0", "labels": {INDEX_ANNOTATION: "0"}},
                     "status": {"phase": "Pending", "conditions": [
                         {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                          "message": "0/4 nodes have enough nvidia.com/gpu"}]}})
    assert view.index == 0 and not view.ready
    assert view.problem == "unschedulable: 0/4 nodes have enough nvidia.com/gpu"
    assert ready_addresses([view], 1, 26600) is None
