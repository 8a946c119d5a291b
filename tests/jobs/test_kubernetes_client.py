"""KubernetesJob's client path, driven through the official `kubernetes` client against a real HTTP server
that speaks the part of the Kubernetes REST API the backend uses (create/read/delete of Secrets, Services
and Jobs, and listing Pods by label). The server plays the Job controller too: creating a Job makes one pod
per completion index, which turns Ready after a few polls (or gets stuck, as the test asks).

This checks request shapes, polling, error handling and cleanup. It is not a cluster: scheduling, image
pulls and the readiness probe are not exercised."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

pytest.importorskip("kubernetes")

from regent.jobs.base import JobError, JobFailedError, JobTimeoutError  # noqa: E402
from regent.jobs.kubernetes import INDEX_ANNOTATION, JOB_LABEL, KubernetesJob  # noqa: E402

KINDS = {("api/v1", "secrets"), ("api/v1", "services"), ("apis/batch/v1", "jobs"), ("api/v1", "pods")}


class FakeApiServer:
    """In-memory objects keyed by (resource, namespace, name), served over HTTP."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.pod_mode = "ready"  # "ready" | "image_pull_backoff" | "unschedulable"
        self.ready_after_lists = 1
        self.forbid_creates = False
        self.lists = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.handle(self, "GET")

            def do_POST(self) -> None:
                server.handle(self, "POST")

            def do_DELETE(self) -> None:
                server.handle(self, "DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def names(self, resource: str) -> list[str]:
        return sorted(name for (res, _ns, name) in self.objects if res == resource)

    # --- request handling ---------------------------------------------------------------------------
    def handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(req.path)
        length = int(req.headers.get("Content-Length") or 0)
        body = json.loads(req.rfile.read(length)) if length else None
        with self.lock:
            self.requests.append((method, req.path))
            code, payload = self.route(method, url.path.strip("/").split("/"), parse_qs(url.query), body)
        data = json.dumps(payload).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    @staticmethod
    def status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                      "message": message, "code": code}

    def route(self, method: str, parts: list[str], query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        # api/v1/namespaces/NS/RES[/NAME]  or  apis/batch/v1/namespaces/NS/RES[/NAME]
        prefix_len = 2 if parts[0] == "api" else 3
        group, rest = "/".join(parts[:prefix_len]), parts[prefix_len:]
        if len(rest) < 3 or rest[0] != "namespaces" or (group, rest[2]) not in KINDS:
            return self.status(404, "NotFound", f"no route {'/'.join(parts)}")
        ns, resource, name = rest[1], rest[2], (rest[3] if len(rest) > 3 else None)
        key = (resource, ns, name or "")
        if method == "POST" and name is None:
            if self.forbid_creates:
                return self.status(403, "Forbidden", f'{resource} is forbidden: cannot create in "{ns}"')
            key = (resource, ns, body["metadata"]["name"])
            if key in self.objects:
                return self.status(409, "AlreadyExists", f"{key[2]} already exists")
            obj = json.loads(json.dumps(body))
            obj["metadata"]["uid"] = f"uid-{len(self.objects)}"
            if resource == "jobs":
                obj["status"] = {"active": obj["spec"]["parallelism"]}
                self.make_pods(ns, obj)
            self.objects[key] = obj
            return 201, obj
        if method == "GET" and resource == "pods" and name is None:
            self.lists += 1
            selector = query.get("labelSelector", [""])[0]
            want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
            items = [self.pod_status(obj) for (res, pns, _), obj in sorted(self.objects.items())
                     if res == "pods" and pns == ns
                     and all(obj["metadata"]["labels"].get(k) == v for k, v in want.items())]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if method == "GET" and name is not None:
            if key not in self.objects:
                return self.status(404, "NotFound", f'{resource} "{name}" not found')
            return 200, self.objects[key]
        if method == "DELETE" and name is not None:
            if key not in self.objects:
                return self.status(404, "NotFound", f'{resource} "{name}" not found')
            obj = self.objects.pop(key)
            if resource == "jobs":
                for pod_key in [k for k, o in self.objects.items()
                                if k[0] == "pods" and o["metadata"]["labels"].get("job-name") == name]:
                    del self.objects[pod_key]
            return 200, obj
        return self.status(405, "MethodNotAllowed", f"{method} {'/'.join(parts)}")

    def make_pods(self, ns: str, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        for index in range(job["spec"]["completions"]):
            labels = dict(job["spec"]["template"]["metadata"]["labels"], **{"job-name": name})
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"{name}-{index}-x7k2p", "namespace": ns, "labels": labels,
                                "annotations": {INDEX_ANNOTATION: str(index)}},
                   "spec": job["spec"]["template"]["spec"], "_index": index}
            self.objects[("pods", ns, pod["metadata"]["name"])] = pod

    def pod_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in pod.items() if k != "_index"}
        index = pod["_index"]
        if self.pod_mode == "unschedulable":
            out["status"] = {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
        elif self.pod_mode == "image_pull_backoff":
            out["status"] = {"phase": "Pending", "podIP": f"10.8.0.{index + 10}", "containerStatuses": [
                {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                 "state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]}
        else:
            ready = self.lists > self.ready_after_lists
            out["status"] = {"phase": "Running", "podIP": f"10.8.0.{index + 10}", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}
        return out


@pytest.fixture
def api(tmp_path: Path):
    with FakeApiServer() as server:
        yield server


def _kubeconfig(tmp_path: Path, url: str) -> str:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
              "clusters": [{"name": "fake", "cluster": {"server": url}}],
              "users": [{"name": "u", "user": {"token": "test-token"}}],
              "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    return str(path)


def _job(tmp_path: Path, api: FakeApiServer, **kw: Any) -> KubernetesJob:
    opts: dict[str, Any] = dict(image="registry.local/regent:test", namespace="ml", secret="6b38732d736563726574",
                                kubeconfig=_kubeconfig(tmp_path, api.url), gpus_per_host=2, platform="rocm")
    opts.update(kw)
    return KubernetesJob(3, **opts)


def test_start_wait_and_kill_through_the_rest_api(tmp_path: Path, api: FakeApiServer) -> None:
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


def test_renew_replaces_every_object(tmp_path: Path, api: FakeApiServer) -> None:
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


def test_a_pod_that_cannot_pull_its_image_fails_the_wait(tmp_path: Path, api: FakeApiServer) -> None:
    api.pod_mode = "image_pull_backoff"
    job = _job(tmp_path, api)
    job.start()
    try:
        with pytest.raises(JobFailedError, match="ImagePullBackOff: pull access denied"):
            job.worker_addresses(timeout=60)
    finally:
        job.kill()


def test_unschedulable_pods_time_out_with_the_schedulers_message(tmp_path: Path, api: FakeApiServer) -> None:
    api.pod_mode = "unschedulable"
    job = _job(tmp_path, api)
    job.start()
    try:
        with pytest.raises(JobTimeoutError, match=r"0/3 worker pods Ready after 2 s .*Insufficient nvidia.com/gpu"
                                                  r".*kubectl -n ml describe pods"):
            job.worker_addresses(timeout=2)
    finally:
        job.kill()


def test_a_deleted_job_is_reported_not_waited_for(tmp_path: Path, api: FakeApiServer) -> None:
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


def test_a_forbidden_create_names_the_cause(tmp_path: Path, api: FakeApiServer) -> None:
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
