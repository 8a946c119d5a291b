"""RecordedKubeApiStub: a recorded-response STUB of the Kubernetes REST API, for tests. Not a cluster.

No Kubernetes API server can run on the test machine, so KubernetesJob's controller logic is driven through the
official `kubernetes` client against this HTTP server. It answers the few endpoints the backend uses (create,
read and delete of Secrets, Services and Jobs; list Pods by label) with responses in the shapes of the
Kubernetes 1.30 API reference. The pod statuses it reports for trouble (image pull back-off, unschedulable,
preemption, eviction, a lost node, an OOM kill) are canned JSON in `RECORDED_POD_STATUSES`, written from the
API reference and the documented pod disruption conditions, not captured from a live server.

What it plays besides the API:
- the Job controller: creating an Indexed Job makes one pod per completion index (with the index annotation);
  a pod that fails marks its Job Failed (backoffLimit 0);
- admission: a created object that does not validate against the official 1.30 schemas
  (`kubernetes-validate`, strict) is refused with 422 Invalid, as a real API server would refuse it;
- in "run" mode, a tiny kubelet: each pod's container command runs as a local process on its own loopback
  address (127.0.0.N, unique across Jobs), with the Secret volume written to a 0400 file and $(VAR)
  references expanded from the env and the downward API. Readiness is what a tcpSocket probe would see.

Not exercised: scheduling, images, container isolation, cluster networking, RBAC, watch semantics.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from regent.jobs.base import SECRET_ENV, is_listening
from regent.jobs.kubernetes import INDEX_ANNOTATION

KINDS = {("api/v1", "secrets"), ("api/v1", "services"), ("apis/batch/v1", "jobs"), ("api/v1", "pods")}
VALIDATE_VERSION = "1.30"

# Pod `status` blocks for trouble, in the shape the API returns them (container statuses trimmed to the
# fields the backend reads). `{ip}` is replaced by the pod's IP.
RECORDED_POD_STATUSES: dict[str, dict[str, Any]] = {
    "preempted": {
        "phase": "Failed", "podIP": "{ip}",
        "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
             "message": "ml/high-prio-7d9f: preempting to accommodate a higher priority pod"},
            {"type": "Ready", "status": "False", "reason": "PodFailed"},
        ],
        "containerStatuses": [{"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                               "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}],
    },
    "evicted": {
        "phase": "Failed", "reason": "Evicted",
        "message": "The node was low on resource: memory. Threshold quantity: 100Mi, available: 91236Ki.",
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                        "message": "The node was low on resource: memory."}],
    },
    "node_lost": {
        "phase": "Running", "podIP": "{ip}",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "NodeNotReady"},
            {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
             "message": "Taint manager: deleting due to NoExecute taint"},
        ],
    },
    "oom_killed": {
        "phase": "Failed", "podIP": "{ip}",
        "containerStatuses": [{"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                               "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
    },
}


def _schema_check(obj: dict[str, Any]) -> str | None:
    """Why the API server would refuse `obj` (strict 1.30 schema), or None. Skipped without kubernetes-validate."""
    try:
        import kubernetes_validate
    except ImportError:
        return None
    try:
        kubernetes_validate.validate(obj, VALIDATE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{obj.get('kind')} is invalid: {exc.message}"
    return None


class RecordedKubeApiStub:
    """In-memory objects keyed by (resource, namespace, name), served over HTTP (see the module docstring)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict[str, Any]] = []  # every accepted create body, in order
        self.pod_mode = "ready"  # "ready" | "image_pull_backoff" | "unschedulable" | "run"
        self.kubelet_dir: Path | None = None  # "run" mode: where pod volumes and logs are materialised
        self.processes: dict[str, subprocess.Popen] = {}
        self.ready_after_lists = 1
        self.forbid_creates = False
        self.validate = True
        self.lists = 0
        self.lock = threading.RLock()
        self._loopback = itertools.count(10)
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

    def __enter__(self) -> RecordedKubeApiStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        for name in list(self.processes):
            self.stop_pod(name)

    def write_kubeconfig(self, path: Path) -> str:
        """A kubeconfig pointing at this stub (plain HTTP, a bearer token nobody checks)."""
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "stub",
                  "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
                  "users": [{"name": "u", "user": {"token": "stub-token"}}],
                  "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "u"}}]}
        path.write_text(json.dumps(config))
        return str(path)

    def names(self, resource: str) -> list[str]:
        with self.lock:
            return sorted(name for (res, _ns, name) in self.objects if res == resource)

    def pods_of(self, job_name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [o for (res, _ns, _n), o in sorted(self.objects.items())
                    if res == "pods" and o["metadata"]["labels"].get("job-name") == job_name]

    # --- operator actions (what a cluster does to pods) --------------------------------------------
    def disrupt(self, pod_name: str, scenario: str) -> None:
        """Make a pod report one of RECORDED_POD_STATUSES; in "run" mode its worker process is SIGKILLed first
        (preemption, eviction and a lost node all take the pod's processes away)."""
        with self.lock:
            pod = next(o for (res, _ns, n), o in self.objects.items() if res == "pods" and n == pod_name)
            self.stop_pod(pod_name, sig=signal.SIGKILL)
            status = json.loads(json.dumps(RECORDED_POD_STATUSES[scenario]).replace("{ip}", pod.get("_ip", "")))
            pod["_status"] = status

    def delete_pod(self, pod_name: str) -> None:
        """The pod object disappears (pod GC after its node was deleted); its process dies with it."""
        with self.lock:
            self.stop_pod(pod_name, sig=signal.SIGKILL)
            for key in [k for k in self.objects if k[0] == "pods" and k[2] == pod_name]:
                del self.objects[key]

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
        return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": reason,
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
            problem = _schema_check(body) if self.validate else None
            if problem:
                return self.status(422, "Invalid", problem)
            key = (resource, ns, body["metadata"]["name"])
            if key in self.objects:
                return self.status(409, "AlreadyExists", f"{key[2]} already exists")
            obj = copy.deepcopy(body)
            obj["metadata"]["uid"] = f"uid-{len(self.created)}"
            self.created.append(copy.deepcopy(body))
            self.objects[key] = obj
            if resource == "jobs":
                self.make_pods(ns, obj)
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
            obj = self.objects[key]
            return 200, self.job_status(obj) if resource == "jobs" else obj
        if method == "DELETE" and name is not None:
            if key not in self.objects:
                return self.status(404, "NotFound", f'{resource} "{name}" not found')
            obj = self.objects.pop(key)
            if resource == "jobs":
                for pod_key in [k for k, o in self.objects.items()
                                if k[0] == "pods" and o["metadata"]["labels"].get("job-name") == name]:
                    del self.objects[pod_key]
                    self.stop_pod(pod_key[2])
            return 200, obj  # the API returns the deleted object (a Status only for some kinds)
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
                self.run_pod(ns, pod, f"127.0.0.{next(self._loopback)}")

    def job_status(self, job: dict[str, Any]) -> dict[str, Any]:
        """The Job with the status its controller would report: Failed once a pod failed (backoffLimit 0)."""
        out = copy.deepcopy(job)
        if "status" in job:  # set by a test
            return out
        pods = [self.pod_status(p) for p in self.pods_of(job["metadata"]["name"])]
        failed = sum(p["status"]["phase"] == "Failed" for p in pods)
        out["status"] = {"active": len(pods) - failed, "failed": failed} if failed else {"active": len(pods)}
        if failed:
            out["status"]["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                            "message": "Job has reached the specified backoff limit"}]
        return out

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
        # A pod's environment is its container env only: nothing of the controller's (its secret least of all).
        full_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "TMPDIR")}
        full_env.update(env, OMP_NUM_THREADS="1")
        assert SECRET_ENV not in full_env and "REGENT_JOB_SECRET_FILE" not in full_env
        pod["_ip"], pod["_port"], pod["_argv"] = pod_ip, container["readinessProbe"]["tcpSocket"]["port"], argv
        log = (self.kubelet_dir / name / "container.log").open("w")
        self.processes[name] = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)
        log.close()

    def stop_pod(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.processes.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        # The container's whole process tree goes (a worker's trainer processes included), as with a cgroup.
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def pod_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in pod.items() if not k.startswith("_")}
        index = pod["_index"]
        if "_status" in pod:
            out["status"] = copy.deepcopy(pod["_status"])
        elif self.pod_mode == "unschedulable":
            out["status"] = {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
        elif self.pod_mode == "image_pull_backoff":
            out["status"] = {"phase": "Pending", "podIP": f"10.8.0.{index + 10}", "containerStatuses": [
                {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                 "state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]}
        elif self.pod_mode == "run":
            proc = self.processes.get(pod["metadata"]["name"])
            if proc is None or proc.poll() is not None:
                code = proc.returncode if proc is not None else 137
                out["status"] = {"phase": "Failed", "podIP": pod["_ip"], "containerStatuses": [
                    {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                     "state": {"terminated": {"exitCode": code, "reason": "Error"}}}]}
            else:
                ready = is_listening(pod["_ip"], pod["_port"])  # what a tcpSocket readiness probe sees
                out["status"] = {"phase": "Running", "podIP": pod["_ip"], "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False"}]}
        else:
            ready = self.lists > self.ready_after_lists
            out["status"] = {"phase": "Running", "podIP": f"10.8.0.{index + 10}", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}
        return out
