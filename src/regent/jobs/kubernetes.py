"""Kubernetes backend: an Indexed Job of N pods, each serving a host with `regent worker`.

What `start()` creates (all labelled `regent.dev/job=<name>-<uid>` and deleted together by `kill()`):
- a `Secret` holding the job secret, mounted read-only (mode 0400) into every pod at
  `/var/run/regent/secret/secret` and passed as `--secret-file`;
- a headless `Service` (clusterIP None) so pods get stable DNS names `<job>-<index>.<service>`;
- a `batch/v1` Job with `completionMode: Indexed`, `completions = parallelism = hosts`, `restartPolicy:
  Never` and `backoffLimit: 0`: a dead worker is a dead host, and the orchestration layer decides whether to
  `renew()` the allocation, so Kubernetes must not quietly restart it.
Each pod runs `regent worker --address tcp://$(POD_IP):<port>`; Kubernetes substitutes the pod IP from the
downward API. A TCP readiness probe marks the pod Ready once the worker listens, and `worker_addresses()`
returns `tcp://<podIP>:<port>` of the Ready pods ordered by completion index.

GPUs: `gpus_per_host` becomes a `nvidia.com/gpu` (platform "cuda") or `amd.com/gpu` (platform "rocm")
limit. The platform is the `platform=` option, else $GPU_PLATFORM, else "cuda"; torch is never imported.

The controller must reach pod IPs: run it inside the cluster (it then uses the in-cluster service account)
or on a network that routes to pods; outside, set `kubeconfig=`/`context=` for the API and `host_network=True`
if only node addresses are routable.

Failures: `problem()` (asked by the orchestrator before an in-place restart) reports a pod that was preempted,
evicted, lost with its node (DisruptionTarget conditions, phase Unknown), whose worker exited or was OOM-killed,
or that vanished, and a deleted or failed Job: the replica then gets a fresh allocation.

Testing: the manifest builders are pure and unit-tested, and `regent k8s manifest` output validates against the
Kubernetes 1.30 schemas. The client path (create, poll pods, problem, delete) and `regent train --job k8s` run
against tests/support/kube_api_stub.py, a recorded-response stub of the REST API whose "kubelet" runs pods as
local processes. No real cluster was available, so scheduling, image pulls, the readiness probe and the way a
live API server reports failures are untested.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from regent import settings
from regent.jobs.base import Job, JobError, JobFailedError, JobTimeoutError, wait_until

logger = logging.getLogger(__name__)

JOB_LABEL = "regent.dev/job"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
SECRET_MOUNT_DIR = "/var/run/regent/secret"
DEFAULT_PORT = 26600
GPU_RESOURCE = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}
# Waiting reasons after which the pod will not start without someone changing something.
FATAL_WAITING_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError", "CrashLoopBackOff",
})


def gpu_resource_name(platform: str | None = None) -> str:
    """`nvidia.com/gpu` or `amd.com/gpu` for a regent.platform name ("cuda"/"rocm"); default from $GPU_PLATFORM."""
    chosen = (platform or settings.GPU_PLATFORM.get() or "cuda").lower()
    if chosen not in GPU_RESOURCE:
        raise ValueError(f"platform {chosen!r} has no Kubernetes GPU resource; use 'cuda' or 'rocm'")
    return GPU_RESOURCE[chosen]


@dataclass
class KubernetesSpec:
    """Everything the manifests depend on; the `build_*` functions turn it into API objects (dicts)."""

    name: str
    hosts: int
    image: str
    namespace: str = "default"
    port: int = DEFAULT_PORT
    gpus_per_host: int | None = None
    platform: str | None = None
    command: Sequence[str] = ("regent",)
    cpu: str | None = None
    memory: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    service_account: str | None = None
    image_pull_policy: str | None = None
    image_pull_secrets: Sequence[str] = ()
    host_network: bool = False
    shm_size: str | None = "16Gi"
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    ttl_seconds_after_finished: int | None = 600
    priority_class: str | None = None
    # The Secret the pods mount. None: `<name>-secret`, created per allocation by KubernetesJob. `regent k8s
    # manifest` points every replica's Job at one Secret the user creates out of band.
    secret_object: str | None = None

    @property
    def service_name(self) -> str:
        return self.name

    @property
    def secret_name(self) -> str:
        return self.secret_object or f"{self.name}-secret"

    def selector_labels(self) -> dict[str, str]:
        return {JOB_LABEL: self.name}

    def object_labels(self) -> dict[str, str]:
        return {**self.labels, **self.selector_labels(), "app.kubernetes.io/name": "regent-worker"}


def _metadata(spec: KubernetesSpec, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace, "labels": spec.object_labels()}
    if spec.annotations:
        meta["annotations"] = dict(spec.annotations)
    return meta


def build_secret_manifest(spec: KubernetesSpec, secret: str) -> dict[str, Any]:
    """An Opaque Secret with key `secret`, mounted as a file into the worker pods."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(spec, spec.secret_name),
        "type": "Opaque",
        "data": {"secret": base64.b64encode(secret.encode()).decode()},
    }


def build_service_manifest(spec: KubernetesSpec) -> dict[str, Any]:
    """A headless Service giving each pod a DNS name; publishes not-yet-ready pods so names resolve early."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, spec.service_name),
        "spec": {
            "clusterIP": "None",
            "selector": spec.selector_labels(),
            "publishNotReadyAddresses": True,
            "ports": [{"name": "regent-worker", "port": spec.port, "targetPort": spec.port, "protocol": "TCP"}],
        },
    }


def build_job_manifest(spec: KubernetesSpec) -> dict[str, Any]:
    """The Indexed Job: `hosts` pods, each running `regent worker` on its pod IP, never restarted."""
    if spec.hosts < 1:
        raise ValueError("hosts must be >= 1")
    if not spec.image:
        raise ValueError("a container image with regent installed is required (image=...)")
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    for key, value in spec.env.items():
        env.append({"name": key, "value": str(value)})
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if spec.gpus_per_host:
        limits[gpu_resource_name(spec.platform)] = str(spec.gpus_per_host)
    if spec.cpu:
        requests["cpu"] = limits["cpu"] = spec.cpu
    if spec.memory:
        requests["memory"] = limits["memory"] = spec.memory
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image,
        "command": list(spec.command),
        # $(POD_IP) is expanded by Kubernetes from the env above; no shell is involved.
        "args": ["worker", "--address", f"tcp://$(POD_IP):{spec.port}",
                 "--secret-file", f"{SECRET_MOUNT_DIR}/secret"],
        "env": env,
        "ports": [{"name": "regent-worker", "containerPort": spec.port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": spec.port}, "periodSeconds": 2, "failureThreshold": 3},
        "volumeMounts": [{"name": "regent-secret", "mountPath": SECRET_MOUNT_DIR, "readOnly": True}],
    }
    if limits or requests:
        container["resources"] = {k: v for k, v in (("limits", limits), ("requests", requests)) if v}
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    volumes: list[dict[str, Any]] = [
        {"name": "regent-secret", "secret": {"secretName": spec.secret_name, "defaultMode": 0o400}},
    ]
    if spec.shm_size:
        # PyTorch dataloaders and NCCL use /dev/shm; the container default (64 MiB) is far too small.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": spec.service_name,
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.service_account:
        pod_spec["serviceAccountName"] = spec.service_account
    if spec.priority_class:
        pod_spec["priorityClassName"] = spec.priority_class
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.hosts,
        "parallelism": spec.hosts,
        "backoffLimit": 0,
        "template": {"metadata": {"labels": spec.object_labels()}, "spec": pod_spec},
    }
    if spec.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(spec, spec.name), "spec": job_spec}


@dataclass
class PodView:
    """What worker discovery needs from a pod (extracted from the API object, so the rule is testable)."""

    name: str
    index: int | None
    phase: str
    ip: str | None
    ready: bool
    problem: str | None  # a reason the pod will not become ready by itself, or a scheduling note


def pod_view(pod: Any) -> PodView:
    """Flatten a V1Pod (client model) or a pod dict into a PodView."""
    get = _getter(pod)
    meta, status = get(pod, "metadata") or {}, get(pod, "status") or {}
    annotations = get(meta, "annotations") or {}
    labels = get(meta, "labels") or {}
    raw_index = annotations.get(INDEX_ANNOTATION, labels.get(INDEX_ANNOTATION))
    conditions = get(status, "conditions") or []
    ready = any(get(c, "type") == "Ready" and get(c, "status") == "True" for c in conditions)
    problem = None
    for c in conditions:
        if get(c, "type") == "PodScheduled" and get(c, "status") == "False":
            problem = f"unschedulable: {get(c, 'message') or get(c, 'reason')}"
    for cs in get(status, "container_statuses", "containerStatuses") or []:
        state = get(cs, "state") or {}
        waiting = get(state, "waiting")
        terminated = get(state, "terminated")
        if waiting and get(waiting, "reason") in FATAL_WAITING_REASONS:
            problem = f"fatal: {get(waiting, 'reason')}: {get(waiting, 'message') or ''}".rstrip(": ")
        if terminated:
            problem = (f"fatal: container exited with code {get(terminated, 'exit_code', 'exitCode')} "
                       f"({get(terminated, 'reason') or 'no reason'})")
    phase = get(status, "phase") or "Unknown"
    if phase == "Failed" and not (problem or "").startswith("fatal"):
        problem = f"fatal: pod failed ({get(status, 'reason') or 'no reason'}: {get(status, 'message') or ''})"
    return PodView(
        name=get(meta, "name") or "?",
        index=int(raw_index) if raw_index is not None else None,
        phase=phase,
        ip=get(status, "pod_ip", "podIP"),
        ready=ready,
        problem=problem,
    )


def _getter(_obj: Any) -> Any:
    def get(obj: Any, snake: str, camel: str | None = None) -> Any:
        if obj is None:
            return None
        if isinstance(obj, Mapping):
            for key in (snake, camel, _camel(snake)):
                if key and key in obj:
                    return obj[key]
            return None
        return getattr(obj, snake, None)

    return get


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(part.title() for part in rest)


# Reasons of the DisruptionTarget pod condition (Kubernetes >= 1.26): who took the pod away, and what helps.
DISRUPTION_REASONS = {
    "PreemptionByScheduler": "preempted by the scheduler for a higher-priority pod (a higher PriorityClass for "
                             "regent's pods, --job.priority-class, prevents it)",
    "DeletionByTaintManager": "deleted because its node was tainted NoExecute (the node was lost, became "
                              "unreachable or is being drained)",
    "EvictionByEvictionAPI": "evicted through the Eviction API (kubectl drain or the cluster autoscaler; a "
                             "PodDisruptionBudget holds voluntary evictions back)",
    "DeletionByPodGC": "deleted by the pod garbage collector: its node no longer exists",
    "TerminationByKubelet": "terminated by the kubelet (node pressure or a graceful node shutdown)",
}


def pod_loss(pod: Any) -> str | None:
    """Why a worker pod can no longer serve its host, or None while it may. Pure, for V1Pod or dict.

    restartPolicy is Never, so a pod that stopped, was disrupted, is being deleted or sits on a node that
    stopped reporting (phase Unknown) never serves again: its replica needs a fresh allocation."""
    get = _getter(pod)
    meta, status = get(pod, "metadata") or {}, get(pod, "status") or {}
    for c in get(status, "conditions") or []:
        if get(c, "type") == "DisruptionTarget" and get(c, "status") == "True":
            reason = get(c, "reason") or "unknown"
            return DISRUPTION_REASONS.get(reason, f"disrupted ({reason}: {get(c, 'message') or ''})")
    phase = get(status, "phase") or "Unknown"
    if get(status, "reason") == "Evicted":
        return f"evicted by the kubelet: {get(status, 'message') or 'node pressure'}"
    if phase == "Unknown":
        return "its node stopped reporting (phase Unknown: node lost or partitioned from the control plane)"
    if get(meta, "deletion_timestamp", "deletionTimestamp"):
        return "being deleted"
    if phase in ("Failed", "Succeeded"):
        for cs in get(status, "container_statuses", "containerStatuses") or []:
            terminated = get(get(cs, "state") or {}, "terminated")
            if terminated:
                reason = get(terminated, "reason") or "no reason"
                code = get(terminated, "exit_code", "exitCode")
                hint = "; raise --job.memory" if reason == "OOMKilled" else ""
                return f"its worker exited with code {code} ({reason}){hint}"
        return f"pod {phase.lower()} ({get(status, 'reason') or 'no reason'})"
    return None


def ready_addresses(pods: Sequence[PodView], hosts: int, port: int) -> list[str] | None:
    """Addresses of pods 0..hosts-1 in index order once all are Ready, else None. Raises on a fatal pod."""
    for pod in pods:
        if pod.problem and pod.problem.startswith("fatal"):
            raise JobFailedError(f"pod {pod.name} (index {pod.index}) cannot serve a host: {pod.problem}")
    by_index = {p.index: p for p in pods if p.index is not None and p.ready and p.ip}
    if all(i in by_index for i in range(hosts)):
        return [f"tcp://{by_index[i].ip}:{port}" for i in range(hosts)]
    return None


class KubernetesJob(Job):
    """An Indexed Job of `hosts` worker pods (see the module docstring). Needs `pip install kubernetes`.

    Options: `image` (required: an image with regent installed), `namespace`, `port`, `platform`
    ("cuda"/"rocm"), `command` (how to invoke regent in the image, default ["regent"]), `cpu`, `memory`,
    `env`, `node_selector`, `tolerations`, `service_account`, `image_pull_policy`, `image_pull_secrets`,
    `host_network`, `shm_size`, `labels`, `annotations`, `kubeconfig`, `context`, `priority_class` (a
    PriorityClass for the pods: a high one keeps the scheduler from preempting them)."""

    backend = "k8s"

    def __init__(
        self,
        hosts: int,
        *,
        name: str = "regent",
        gpus_per_host: int | None = None,
        secret: str | bytes | None = None,
        image: str = "",
        namespace: str = "default",
        port: int = DEFAULT_PORT,
        platform: str | None = None,
        command: Sequence[str] = ("regent",),
        cpu: str | None = None,
        memory: str | None = None,
        env: Mapping[str, str] | None = None,
        node_selector: Mapping[str, str] | None = None,
        tolerations: Sequence[Mapping[str, Any]] = (),
        service_account: str | None = None,
        image_pull_policy: str | None = None,
        image_pull_secrets: Sequence[str] = (),
        host_network: bool = False,
        shm_size: str | None = "16Gi",
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        priority_class: str | None = None,
    ) -> None:
        if not image:
            raise ValueError("KubernetesJob needs image=...: a container image with regent installed")
        super().__init__(
            hosts, name=name, gpus_per_host=gpus_per_host, secret=secret, image=image, namespace=namespace,
            port=port, platform=platform, command=tuple(command), cpu=cpu, memory=memory, env=dict(env or {}),
            node_selector=dict(node_selector or {}), tolerations=tuple(tolerations),
            service_account=service_account, image_pull_policy=image_pull_policy,
            image_pull_secrets=tuple(image_pull_secrets), host_network=host_network, shm_size=shm_size,
            labels=dict(labels or {}), annotations=dict(annotations or {}), kubeconfig=kubeconfig,
            context=context, priority_class=priority_class,
        )
        if gpus_per_host:
            gpu_resource_name(platform)  # fail before launch on a bad platform
        self.spec = KubernetesSpec(
            name=self.unique_name, hosts=hosts, image=image, namespace=namespace, port=port,
            gpus_per_host=gpus_per_host, platform=platform, command=tuple(command), cpu=cpu, memory=memory,
            env=dict(env or {}), node_selector=dict(node_selector or {}), tolerations=tuple(tolerations),
            service_account=service_account, image_pull_policy=image_pull_policy,
            image_pull_secrets=tuple(image_pull_secrets), host_network=host_network, shm_size=shm_size,
            labels=dict(labels or {}), annotations=dict(annotations or {}), priority_class=priority_class,
        )
        self._kubeconfig = kubeconfig
        self._context = context
        self._api: tuple[Any, Any, Any] | None = None

    def describe(self) -> str:
        return f"Kubernetes job {self.spec.namespace}/{self.spec.name}"

    # --- client plumbing ---------------------------------------------------------------------------
    def _clients(self) -> tuple[Any, Any, Any]:
        """(CoreV1Api, BatchV1Api, ApiException), configured in-cluster or from kubeconfig."""
        if self._api is None:
            self._api = _k8s_clients(self._kubeconfig, self._context)
        return self._api

    def start(self) -> None:
        if self._started:
            return
        if self._killed:
            raise JobError(f"{self.describe()} was killed; call renew() for a fresh allocation")
        core, batch, api_exception = self._clients()
        ns = self.spec.namespace
        self._mark_started()  # from here on kill() must clean up whatever got created
        try:
            core.create_namespaced_secret(ns, build_secret_manifest(self.spec, self.secret))
            core.create_namespaced_service(ns, build_service_manifest(self.spec))
            batch.create_namespaced_job(ns, build_job_manifest(self.spec))
        except api_exception as exc:
            self.kill()
            raise JobError(
                f"creating {self.describe()} failed: {exc.status} {exc.reason}: {_api_message(exc)}; check the "
                f"namespace exists and your account may create secrets, services and jobs in it"
            ) from exc
        except Exception as exc:  # the client validates objects itself (pydantic in kubernetes>=35): clean up too
            self.kill()
            raise JobError(f"creating {self.describe()} failed before reaching the API server: {exc}; check the "
                           f"job options (--job.KEY) against the Kubernetes object they set") from exc
        logger.info("created %s with %d worker pods", self.describe(), self.hosts)

    def pods(self) -> list[PodView]:
        core, _, _ = self._clients()
        listing = core.list_namespaced_pod(self.spec.namespace, label_selector=f"{JOB_LABEL}={self.spec.name}")
        return [pod_view(p) for p in listing.items]

    def worker_addresses(self, timeout: float) -> list[str]:
        if not self._started:
            raise JobError(f"{self.describe()} was not started; call start() first")
        seen: list[list[PodView]] = [[]]

        def poll() -> list[str] | None:
            if self._killed:
                raise JobFailedError(f"{self.describe()} was killed")
            pods = self.pods()
            seen[0] = pods
            addresses = ready_addresses(pods, self.hosts, self.spec.port)
            if addresses is None and not self._job_exists():
                raise JobFailedError(f"{self.describe()} no longer exists; was it deleted?")
            return addresses

        addresses = wait_until(poll, timeout, interval=1.0, max_interval=3.0)
        if addresses is None:
            pods = seen[0]
            ready = sum(p.ready for p in pods)
            notes = "; ".join(f"{p.name}: {p.phase}{' (' + p.problem + ')' if p.problem else ''}"
                              for p in pods if not p.ready) or "no pods were created yet"
            raise JobTimeoutError(
                f"{self.describe()}: {ready}/{self.hosts} worker pods Ready after {timeout:.0f} s ({notes}); "
                f"check `kubectl -n {self.spec.namespace} describe pods -l {JOB_LABEL}={self.spec.name}`"
            )
        return addresses

    def _job_exists(self) -> bool:
        _, batch, api_exception = self._clients()
        try:
            batch.read_namespaced_job(self.spec.name, self.spec.namespace)
        except api_exception as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def is_alive(self) -> bool:
        if not self._started or self._killed:
            return False
        _, batch, api_exception = self._clients()
        try:
            job = batch.read_namespaced_job(self.spec.name, self.spec.namespace)
        except api_exception as exc:
            if exc.status == 404:
                return False
            raise JobError(f"reading {self.describe()} failed: {exc.status} {exc.reason}") from exc
        status = job.status
        if status is None:
            return True
        if (status.failed or 0) > 0 or (status.succeeded or 0) > 0:
            return False
        return not any(
            c.type in ("Failed", "Complete", "FailureTarget") and c.status == "True" for c in status.conditions or []
        )

    def problem(self) -> str | None:
        """Why this allocation can no longer serve its hosts, with the cause; None while it looks healthy.

        The orchestrator asks before an in-place restart: a pod that was preempted, evicted, lost with its node
        or whose worker exited (pods are never restarted) means a fresh allocation, not a restart on it."""
        if not self._started:
            return None
        if self._killed:
            return f"{self.describe()} was released by this controller"
        _, batch, api_exception = self._clients()
        try:
            job = batch.read_namespaced_job(self.spec.name, self.spec.namespace)
        except api_exception as exc:
            if exc.status == 404:
                return (f"{self.describe()} no longer exists (deleted by someone, or by ttlSecondsAfterFinished); "
                        f"the replica moves to a fresh allocation")
            raise
        core, _, _ = self._clients()
        listing = core.list_namespaced_pod(self.spec.namespace, label_selector=f"{JOB_LABEL}={self.spec.name}")
        seen: set[int] = set()
        for pod in listing.items:
            view = pod_view(pod)
            if view.index is not None:
                seen.add(view.index)
            loss = pod_loss(pod)
            if loss:
                return (f"{self.describe()}: pod {view.name} (index {view.index}) {loss}; the replica moves to a "
                        f"fresh allocation (`kubectl -n {self.spec.namespace} describe pod {view.name}`)")
        missing = sorted(set(range(self.hosts)) - seen)
        if missing:
            return (f"{self.describe()}: the pod(s) of index {', '.join(map(str, missing))} are gone (deleted with "
                    f"their node?); the replica moves to a fresh allocation")
        status = job.status
        for c in (getattr(status, "conditions", None) or []):
            if c.type in ("Failed", "FailureTarget") and c.status == "True":
                return f"{self.describe()} failed ({c.reason}: {c.message or ''}); the replica moves to a fresh allocation"
        return None

    def kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        if not self._started:
            return
        _delete_objects(self._clients(), self.spec.namespace, self.spec.name, self.spec.service_name,
                        self.spec.secret_name, self.describe())

    def reference(self) -> dict[str, Any] | None:
        if not self._started:
            return None
        return {"backend": "k8s", "namespace": self.spec.namespace, "name": self.spec.name,
                "service": self.spec.service_name, "secret": self.spec.secret_name,
                "kubeconfig": self._kubeconfig, "context": self._context, "describe": self.describe()}

    @classmethod
    def release_reference(cls, ref: dict[str, Any]) -> str:
        describe = str(ref.get("describe") or f"Kubernetes job {ref['namespace']}/{ref['name']}")
        _delete_objects(_k8s_clients(ref.get("kubeconfig"), ref.get("context")), str(ref["namespace"]),
                        str(ref["name"]), str(ref["service"]), str(ref["secret"]), describe)
        return f"deleted {describe}"


def _api_message(exc: Any) -> str:
    import json

    try:
        return json.loads(exc.body).get("message", "")
    except (TypeError, ValueError, AttributeError):  # no body, not JSON, or not a JSON object: show it raw
        return str(getattr(exc, "body", "") or "")[:500]


def _k8s_clients(kubeconfig: str | None, context: str | None) -> tuple[Any, Any, Any]:
    """(CoreV1Api, BatchV1Api, ApiException), configured in-cluster or from kubeconfig."""
    try:
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
    except ImportError as exc:
        raise JobError(
            "the Kubernetes backend needs the official client: pip install 'regent-ml[k8s]' "
            "(or pip install kubernetes)"
        ) from exc
    api_client = None
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        try:
            api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
        except Exception as exc:  # the loader raises several unrelated types
            raise JobError(
                f"cannot load a kubeconfig ({exc}); set kubeconfig= or $KUBECONFIG, or run the "
                f"controller inside the cluster"
            ) from exc
    return client.CoreV1Api(api_client), client.BatchV1Api(api_client), ApiException


def _delete_objects(clients: tuple[Any, Any, Any], ns: str, name: str, service: str, secret: str,
                    describe: str) -> None:
    """Delete a job's Job (its pods with it), Service and Secret; one already gone (404) is fine."""
    core, batch, api_exception = clients
    deletions = (
        ("job", lambda: batch.delete_namespaced_job(name, ns, propagation_policy="Foreground")),
        ("service", lambda: core.delete_namespaced_service(service, ns)),
        ("secret", lambda: core.delete_namespaced_secret(secret, ns)),
    )
    for kind, delete in deletions:
        try:
            delete()
        except api_exception as exc:
            if exc.status != 404:
                logger.warning("deleting %s of %s failed: %s %s", kind, describe, exc.status, exc.reason)
    logger.info("deleted %s", describe)
