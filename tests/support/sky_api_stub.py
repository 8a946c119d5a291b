"""SkyApiStub: a STUB of SkyPilot's Python API (`import sky`), for tests. Not SkyPilot.

SkyPilot and cloud credentials are not available on the test machine. `SkyApiStub().module` is a module object
that tests install as `sys.modules["sky"]`; it has the calls SkyPilotJob makes, with the signatures of
SkyPilot's documented SDK, and records every call in `calls`:

- `Task.from_yaml_config(config)`, `launch(task, cluster_name=..., idle_minutes_to_autostop=..., down=...)`,
  `status(cluster_names=[...])`, `down(cluster_name)`, `api_cancel(request_id)`, `get(request_id)`,
  `tail_logs(cluster_name, job_id, follow, tail=0, output_stream=None)`, `ClusterStatus`, `exceptions`.
- `api="requests"` (SkyPilot >= 0.8): launch/status/down return request ids that `get` resolves;
  `api="direct"` (older): they return results, and launch takes `detach_run`.
- `records="dict"` or `"object"`: `status` records as dicts or as objects with attributes.

`launch` plays the cloud too: with `run_nodes=True` it "provisions" `num_nodes` nodes as local processes, each
with its own home directory (the task's file mounts are copied there, as SkyPilot uploads them) and its own
loopback IP, runs the task's setup then its run step under bash with the variables SkyPilot sets on a node
(SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES), and gathers their output as the job log that
`tail_logs` returns. `fail_launch` makes the launch raise `exceptions.ResourcesUnavailableError`;
`preempt(cluster)` kills a cluster's node processes and reports it STOPPED, as for a preempted spot cluster.
"""

from __future__ import annotations

import enum
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import types
import uuid
from pathlib import Path
from typing import Any


class ClusterStatus(enum.Enum):
    INIT = "INIT"
    UP = "UP"
    STOPPED = "STOPPED"


class ResourcesUnavailableError(Exception):
    pass


class ClusterDoesNotExist(ValueError):
    pass


class StubTask:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    @classmethod
    def from_yaml_config(cls, config: dict[str, Any]) -> StubTask:
        return cls(dict(config))


class StatusRecord:
    """A newer-style status record (attributes, not keys)."""

    def __init__(self, name: str, status: ClusterStatus) -> None:
        self.name, self.status = name, status


class SkyApiStub:
    """See the module docstring."""

    def __init__(self, root: Path, *, api: str = "requests", records: str = "dict", run_nodes: bool = True) -> None:
        assert api in ("requests", "direct") and records in ("dict", "object")
        self.root, self.api, self.records, self.run_nodes = root, api, records, run_nodes
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.clusters: dict[str, ClusterStatus] = {}
        self.tasks: dict[str, dict[str, Any]] = {}
        self.uploaded_secrets: dict[str, str] = {}  # cluster -> the secret file's text as the nodes got it
        self.nodes: dict[str, list[subprocess.Popen]] = {}
        self.fail_launch = False
        self.launch_delay = threading.Event()
        self.launch_delay.set()  # clear() to hold launches until set()
        self._results: dict[str, Any] = {}
        self._ips = itertools.count(40)
        self.lock = threading.Lock()
        self.module = self._build_module()

    # --- the fake `sky` module -----------------------------------------------------------------------
    def _build_module(self) -> types.ModuleType:
        sky = types.ModuleType("sky")
        sky.__doc__ = "SkyApiStub: a stub of SkyPilot's Python API for tests (tests/support/sky_api_stub.py)"
        sky.ClusterStatus = ClusterStatus
        sky.Task = StubTask
        sky.exceptions = types.SimpleNamespace(ResourcesUnavailableError=ResourcesUnavailableError,
                                               ClusterDoesNotExist=ClusterDoesNotExist)
        sky.get = self.get
        sky.status = self.status
        sky.down = self.down
        sky.api_cancel = self.api_cancel
        sky.tail_logs = self.tail_logs
        if self.api == "requests":
            def launch(task: Any, cluster_name: str | None = None, retry_until_up: bool = False,
                       idle_minutes_to_autostop: int | None = None, dryrun: bool = False,
                       down: bool = False) -> Any:
                return self._launch(task, cluster_name, idle_minutes_to_autostop=idle_minutes_to_autostop,
                                    down=down)
        else:
            def launch(task: Any, cluster_name: str | None = None, retry_until_up: bool = False,  # type: ignore[misc]
                       idle_minutes_to_autostop: int | None = None, dryrun: bool = False, down: bool = False,
                       stream_logs: bool = True, detach_run: bool = False) -> Any:
                return self._launch(task, cluster_name, idle_minutes_to_autostop=idle_minutes_to_autostop,
                                    down=down, detach_run=detach_run)
        sky.launch = launch
        return sky

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.calls.append((name, args, kwargs))

    def _answer(self, compute: Any) -> Any:
        """A request id whose result `get` computes (requests API), or the result now (direct API)."""
        if self.api == "direct":
            return compute()
        request_id = uuid.uuid4().hex
        self._results[request_id] = compute
        return request_id

    def get(self, request_id: str) -> Any:
        self._record("get", request_id)
        return self._results.pop(request_id)()

    def api_cancel(self, request_id: str) -> Any:
        self._record("api_cancel", request_id)
        return self._answer(lambda: [request_id])

    def _launch(self, task: StubTask, cluster_name: str | None, **kwargs: Any) -> Any:
        self._record("launch", task, cluster_name=cluster_name, **kwargs)
        assert isinstance(task, StubTask), "launch needs a sky.Task"
        assert cluster_name

        def provision() -> tuple[int, Any]:
            self.launch_delay.wait(timeout=120)
            if self.fail_launch:
                raise ResourcesUnavailableError("Failed to provision all possible launchable resources. "
                                                "Relax the task's resource requirements: 2x H100:8")
            config = task.config
            self.tasks[cluster_name] = config
            with self.lock:
                self.clusters[cluster_name] = ClusterStatus.UP
            if self.run_nodes:
                self._start_nodes(cluster_name, config)
            return 1, {"cluster": cluster_name}

        return self._answer(provision)

    def _start_nodes(self, cluster: str, config: dict[str, Any]) -> None:
        count = int(config["num_nodes"])
        ips = [f"127.0.0.{next(self._ips)}" for _ in range(count)]
        procs = []
        for rank in range(count):
            home = self.root / cluster / f"node{rank}"
            home.mkdir(parents=True)
            for remote, local in config.get("file_mounts", {}).items():  # what SkyPilot uploads
                target = home / remote.removeprefix("~/") if remote.startswith("~/") else Path(remote)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(local, target)
                self.uploaded_secrets.setdefault(cluster, target.read_text())
            env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "PYTHONPATH", "TMPDIR")}
            env.update({k: str(v) for k, v in config.get("envs", {}).items()})
            env.update(HOME=str(home), SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS="\n".join(ips),
                       SKYPILOT_NUM_NODES=str(count), OMP_NUM_THREADS="1")
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
            script = f"{config['setup']}\n{config['run']}"
            log = (self.root / cluster / f"node{rank}.log").open("w")
            procs.append(subprocess.Popen(["bash", "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            log.close()
        self.nodes[cluster] = procs

    def status(self, cluster_names: list[str] | None = None, refresh: Any = False, **kwargs: Any) -> Any:
        self._record("status", cluster_names=cluster_names, **kwargs)

        def records() -> list[Any]:
            with self.lock:
                listed = [(n, s) for n, s in self.clusters.items() if cluster_names is None or n in cluster_names]
            if self.records == "object":
                return [StatusRecord(n, s) for n, s in listed]
            return [{"name": n, "status": s, "launched_at": 0, "handle": None} for n, s in listed]

        return self._answer(records)

    def down(self, cluster_name: str, purge: bool = False) -> Any:
        self._record("down", cluster_name)

        def teardown() -> None:
            self._stop_nodes(cluster_name)
            with self.lock:
                if self.clusters.pop(cluster_name, None) is None:
                    raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")

        return self._answer(teardown)

    def tail_logs(self, cluster_name: str, job_id: int | None, follow: bool, tail: int = 0,
                  output_stream: Any = None) -> int:
        self._record("tail_logs", cluster_name, job_id, follow=follow)
        assert follow is False, "a follow=True tail never returns while the workers run"
        if cluster_name not in self.clusters:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        text = ""
        for rank in range(len(self.nodes.get(cluster_name, []))):
            path = self.root / cluster_name / f"node{rank}.log"
            prefix = "(head, rank=0, pid=1) " if rank == 0 else f"(worker{rank}, rank={rank}, pid=1) "
            text += "".join(prefix + line + "\n" for line in path.read_text().splitlines())
        (output_stream or sys.stdout).write(text)
        return 0

    # --- what the cloud does -------------------------------------------------------------------------
    def preempt(self, cluster: str) -> None:
        """Spot preemption: the nodes' processes die and the cluster reports STOPPED."""
        self._stop_nodes(cluster, signal.SIGKILL)
        with self.lock:
            self.clusters[cluster] = ClusterStatus.STOPPED

    def _stop_nodes(self, cluster: str, sig: int = signal.SIGTERM) -> None:
        for proc in self.nodes.pop(cluster, []):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    continue
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def close(self) -> None:
        for cluster in list(self.nodes):
            self._stop_nodes(cluster, signal.SIGKILL)

    def names(self, call: str) -> list[tuple[Any, ...]]:
        return [args for name, args, _ in self.calls if name == call]
