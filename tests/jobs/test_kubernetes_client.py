"""KubernetesJob's client path, driven through the official `kubernetes` client against a real HTTP server
that speaks the part of the Kubernetes REST API the backend uses (create/read/delete of Secrets, Services
and Jobs, and listing Pods by label). The server plays the Job controller too: creating a Job makes one pod
per completion index, which turns Ready after a few polls (or gets stuck, as the test asks).

This checks request shapes, polling, error handling and cleanup. In "run" mode the server also acts as a
tiny kubelet: it runs each pod's container command as a local process (pod IPs are distinct loopback
addresses, the Secret volume is written to a temp dir) so the generated worker command is exercised for
real. It is not a cluster: scheduling, images and networking are not exercised."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

pytest.importorskip("kubernetes")

from regent.jobs.base import (
    SECRET_ENV,
    JobError,
    JobFailedError,
    JobTimeoutError,
    is_listening,
    pick_free_port,
)
from regent.jobs.kubernetes import INDEX_ANNOTATION, JOB_LABEL, KubernetesJob

KINDS = {("api/v1", "secrets"), ("api/v1", "services"), ("apis/batch/v1", "jobs"), ("api/v1", "pods")}


class FakeApiServer:
    """In-memory objects keyed by (resource, namespace, name), served over HTTP."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.pod_mode = "ready"  # "ready" | "image_pull_backoff" | "unschedulable" | "run"
        self.kubelet_dir: Path | None = None  # "run" mode: where pod volumes are materialised
        self.processes: dict[str, subprocess.Popen] = {}
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
        for name in list(self.processes):
            self.stop_pod(name)

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
                    self.stop_pod(pod_key[2])
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
            if self.pod_mode == "run":
                self.run_pod(ns, pod, f"127.0.0.{index + 10}")

    # --- "run" mode: a minimal kubelet that runs each pod's container as a local process --------------
    def run_pod(self, ns: str, pod: dict[str, Any], pod_ip: str) -> None:
        """Materialise secret volumes, expand $(VAR) from the env (downward API included), start it."""
        assert self.kubelet_dir is not None
        name = pod["metadata"]["name"]
        spec = pod["spec"]
        (container,) = spec["containers"]
        env: dict[str, str] = {}
        fields = {"status.podIP": pod_ip, "metadata.name": name}
        for item in container.get("env", []):
            env[item["name"]] = item["value"] if "value" in item else fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        mounts: dict[str, str] = {}
        for volume in spec["volumes"]:
            if "secret" not in volume:
                continue  # emptyDir /dev/shm: the host's is fine
            secret = self.objects[("secrets", ns, volume["secret"]["secretName"])]
            vol_dir = self.kubelet_dir / name / volume["name"]
            vol_dir.mkdir(parents=True)
            for key, value in secret["data"].items():
                path = vol_dir / key
                path.write_bytes(base64.b64decode(value))
                path.chmod(volume["secret"]["defaultMode"])
            for mount in container["volumeMounts"]:
                if mount["name"] == volume["name"]:
                    mounts[mount["mountPath"]] = str(vol_dir)

        def expand(arg: str) -> str:
            arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
            for mount_path, local in mounts.items():
                arg = arg.replace(mount_path, local)
            return arg

        argv = [expand(a) for a in container["command"] + container["args"]]
        argv[0] = shutil.which(argv[0], path=str(Path(sys.executable).parent)) or argv[0]
        full_env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        full_env.update(env, OMP_NUM_THREADS="1")
        pod["_ip"], pod["_port"] = pod_ip, container["readinessProbe"]["tcpSocket"]["port"]
        self.processes[name] = subprocess.Popen(argv, env=full_env, stdout=subprocess.DEVNULL)

    def stop_pod(self, name: str) -> None:
        proc = self.processes.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

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
        elif self.pod_mode == "run":
            proc = self.processes[pod["metadata"]["name"]]
            if proc.poll() is not None:
                out["status"] = {"phase": "Failed", "podIP": pod["_ip"], "containerStatuses": [
                    {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                     "state": {"terminated": {"exitCode": proc.returncode, "reason": "Error"}}}]}
            else:
                ready = is_listening(pod["_ip"], pod["_port"])  # what a tcpSocket readiness probe sees
                out["status"] = {"phase": "Running", "podIP": pod["_ip"], "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False"}]}
            out = {k: v for k, v in out.items() if not k.startswith("_")}
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



def test_pods_run_the_generated_worker_command_and_serve_actors(tmp_path: Path, api: FakeApiServer) -> None:
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
