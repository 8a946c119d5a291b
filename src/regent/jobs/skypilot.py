"""SkyPilot backend: a SkyPilot cluster of N nodes, each serving a host with `regent worker`.

Driven through SkyPilot's Python API (`import sky`; `pip install 'skypilot[<cloud>]'`), never by parsing the
CLI's tables. Since SkyPilot 0.8 most calls return a request id that `sky.get(...)` resolves (the request runs
on the SkyPilot API server); older releases returned the result directly. Both are accepted (`_resolve`).
- `start()` builds the task (`build_task`, also written to `task.yaml` beside the local secret copy for a
  `sky launch` by hand), turns it into `sky.Task.from_yaml_config(...)` and calls
  `sky.launch(task, cluster_name=..., ...)` on a background thread (provisioning takes minutes);
  `worker_addresses()` waits for it and reports its error if it fails.
- The secret travels as a file mount of a local 0600 file, removed once the launch returns; setup
  `chmod 600`s the remote copy. It is never in the task, an env var or a command line.
- Each node's run step calls `regent.jobs.base.launch_worker`, which serves on the node's IP and `port`
  and prints a `REGENT_WORKER_READY rank=<SKYPILOT_NODE_RANK> address=tcp://ip:port` line once listening.
  `worker_addresses()` reads those lines with `sky.tail_logs(cluster, job_id, follow=False,
  output_stream=...)`.
- `status()`/`is_alive()`/`problem()` read `sky.status(cluster_names=[cluster])` records (their `status` is a
  `sky.ClusterStatus`); `kill()` calls `sky.down(cluster)`.

The controller must reach the nodes' private IPs (same VPC or network), as with Monarch's SkyPilot example.

Testing: `build_task` is unit-tested, its run step is executed locally with the variables SkyPilot sets on a
node, and the launch flow runs against tests/support/sky_api_stub.py, a stub of the `sky` API (named as such)
whose "nodes" are local processes. SkyPilot itself and a cloud were not available, so the real API server,
provisioning and `sky.tail_logs` output format on a live cluster are untested.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import shlex
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regent.jobs.base import (
    Job,
    JobError,
    JobFailedError,
    JobTimeoutError,
    launcher_command,
    parse_address_markers,
    wait_until,
    write_secret_file,
)

logger = logging.getLogger(__name__)

REMOTE_SECRET = "~/.regent/job-secret"
DEFAULT_PORT = 26600
# `sky.ClusterStatus` states that still hold (or are getting) nodes.
ALIVE_CLUSTER_STATES = frozenset({"INIT", "UP"})


@dataclass
class SkyPilotSpec:
    """Everything the task YAML depends on."""

    name: str
    hosts: int
    port: int = DEFAULT_PORT
    gpus_per_host: int | None = None
    accelerator: str | None = None  # e.g. "H100"; with gpus_per_host gives "H100:8"
    cloud: str | None = None
    region: str | None = None
    instance_type: str | None = None
    image_id: str | None = None
    use_spot: bool = False
    cpus: str | None = None
    memory: str | None = None
    disk_size: int | None = None
    python: str = "python3"
    setup: Sequence[str] = ("pip install regent-ml",)
    workdir: str | None = None
    file_mounts: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    secret_path: str = ""
    # SkyPilot's `ports` opens the port to the internet; nodes of one cluster reach each other without it,
    # and the controller must be on the cluster's network anyway (it dials private IPs).
    open_port: bool = False


def build_task(spec: SkyPilotSpec) -> dict[str, Any]:
    """The SkyPilot task as a dict (the YAML's structure). Pure; the secret itself is never in it."""
    if spec.hosts < 1:
        raise ValueError("hosts must be >= 1")
    resources: dict[str, Any] = {}
    if spec.open_port:
        resources["ports"] = [spec.port]
    if spec.gpus_per_host:
        accelerator = spec.accelerator or "H100"
        resources["accelerators"] = f"{accelerator}:{spec.gpus_per_host}"
    elif spec.accelerator:
        resources["accelerators"] = spec.accelerator
    for key in ("cloud", "region", "instance_type", "image_id", "cpus", "memory", "disk_size"):
        value = getattr(spec, key)
        if value is not None:
            resources[key] = value
    if spec.use_spot:
        resources["use_spot"] = True
    launcher = launcher_command(
        spec.python,
        ["--rank-env", "SKYPILOT_NODE_RANK", "--port", str(spec.port), "--secret-file", REMOTE_SECRET],
    )
    run = "\n".join([
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
        # The node's address as the other nodes see it: its line in SKYPILOT_NODE_IPS.
        'NODE_IP=$(echo "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p")',
        'exec ' + " ".join(shlex.quote(p) for p in launcher) + ' --host "$NODE_IP"',
    ])
    setup = "\n".join(["set -euo pipefail", f"chmod 600 {REMOTE_SECRET}", *spec.setup])
    task: dict[str, Any] = {
        "name": spec.name,
        "num_nodes": spec.hosts,
        "resources": resources,
        "envs": {"PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in spec.env.items()}},
        "file_mounts": {REMOTE_SECRET: spec.secret_path, **dict(spec.file_mounts)},
        "setup": setup,
        "run": run,
    }
    if spec.workdir:
        task["workdir"] = spec.workdir
    return task


def build_task_yaml(spec: SkyPilotSpec) -> str:
    """The task YAML text. JSON is valid YAML, so no YAML library is needed to write it."""
    return json.dumps(build_task(spec), indent=2) + "\n"


def record_field(record: Any, name: str) -> Any:
    """A field of a `sky.status` record: a dict in older SkyPilot, an object with attributes in newer."""
    if isinstance(record, Mapping):
        return record.get(name)
    return getattr(record, name, None)


def status_name(value: Any) -> str | None:
    """The state name ("UP", "INIT", "STOPPED", ...) of a `sky.ClusterStatus` member or its plain string."""
    if value is None:
        return None
    return str(getattr(value, "value", value)).rsplit(".", 1)[-1].upper()


class SkyPilotJob(Job):
    """A SkyPilot cluster of `hosts` nodes running workers (see the module docstring).

    Options: `accelerator` ("H100", "MI300X", ...), `cloud`, `region`, `instance_type`, `image_id`,
    `use_spot`, `cpus`, `memory`, `disk_size`, `python`, `setup` (shell lines that install regent; default
    `pip install regent-ml`), `workdir`, `file_mounts`, `env`, `port`, `idle_minutes_to_autostop` (then the
    cluster is torn down, not stopped, when idle), `launch_timeout` (seconds for the launch), `open_port`
    (expose the worker port publicly; off by default: the workers authenticate every connection, but there is
    no reason to invite the internet)."""

    backend = "skypilot"

    def __init__(
        self,
        hosts: int,
        *,
        name: str = "regent",
        gpus_per_host: int | None = None,
        secret: str | bytes | None = None,
        accelerator: str | None = None,
        cloud: str | None = None,
        region: str | None = None,
        instance_type: str | None = None,
        image_id: str | None = None,
        use_spot: bool = False,
        cpus: str | None = None,
        memory: str | None = None,
        disk_size: int | None = None,
        python: str = "python3",
        setup: Sequence[str] = ("pip install regent-ml",),
        workdir: str | None = None,
        file_mounts: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        port: int = DEFAULT_PORT,
        idle_minutes_to_autostop: int | None = None,
        launch_timeout: float = 3600.0,
        open_port: bool = False,
    ) -> None:
        super().__init__(
            hosts, name=name, gpus_per_host=gpus_per_host, secret=secret, accelerator=accelerator, cloud=cloud,
            region=region, instance_type=instance_type, image_id=image_id, use_spot=use_spot, cpus=cpus,
            memory=memory, disk_size=disk_size, python=python, setup=tuple(setup), workdir=workdir,
            file_mounts=dict(file_mounts or {}), env=dict(env or {}), port=port,
            idle_minutes_to_autostop=idle_minutes_to_autostop, launch_timeout=launch_timeout, open_port=open_port,
        )
        self.cluster = self.unique_name
        self._idle_minutes = idle_minutes_to_autostop
        self._launch_timeout = launch_timeout
        # Holds the task YAML and, only while the launch uploads it, a copy of the secret.
        self._local_dir = Path(tempfile.gettempdir()) / f"regent-sky-{self.cluster}"
        self._launch_thread: threading.Thread | None = None
        self._launch_request: Any = None  # the request id of sky.launch (SkyPilot >= 0.8), for cancelling
        self._launch_error: BaseException | None = None
        self._launch_started = 0.0
        self.sky_job_id: int | None = None  # the run step's job id on the cluster, once launched
        self.spec = SkyPilotSpec(
            name=self.cluster, hosts=hosts, port=port, gpus_per_host=gpus_per_host, accelerator=accelerator,
            cloud=cloud, region=region, instance_type=instance_type, image_id=image_id, use_spot=use_spot,
            cpus=cpus, memory=memory, disk_size=disk_size, python=python, setup=tuple(setup), workdir=workdir,
            file_mounts=dict(file_mounts or {}), env=dict(env or {}),
            secret_path=str(self._local_dir / "secret"), open_port=open_port,
        )

    def describe(self) -> str:
        return f"SkyPilot cluster {self.cluster}"

    # --- the sky API ---------------------------------------------------------------------------------
    @staticmethod
    def _sky() -> Any:
        """The `sky` module; a JobError naming the fix when SkyPilot is not installed."""
        try:
            import sky
        except ImportError as exc:
            raise JobError(
                "SkyPilot is not installed (cannot import sky): pip install 'skypilot[<cloud>]' and run "
                "`sky check`, or choose another job backend (--job local|slurm|k8s)"
            ) from exc
        return sky

    def _resolve(self, result: Any) -> Any:
        """A request id (SkyPilot >= 0.8: a str) resolved with `sky.get`; an older direct result as is."""
        if isinstance(result, str):
            return self._sky().get(result)
        return result

    def start(self) -> None:
        """Launch the cluster on a background thread (provisioning takes minutes); worker_addresses() waits."""
        if self._started:
            return
        if self._killed:
            raise JobError(f"{self.describe()} was killed; call renew() for a fresh allocation")
        sky = self._sky()
        config = build_task(self.spec)
        self._local_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_secret_file(self.spec.secret_path, self.secret)
        (self._local_dir / "task.yaml").write_text(build_task_yaml(self.spec))
        task = sky.Task.from_yaml_config(config)
        kwargs: dict[str, Any] = {"cluster_name": self.cluster}
        if self._idle_minutes is not None:
            kwargs.update(idle_minutes_to_autostop=self._idle_minutes, down=True)
        if "detach_run" in _parameters(sky.launch):  # SkyPilot < 0.8 streamed the run step unless told not to
            kwargs["detach_run"] = True
        self._launch_error = None
        self._launch_started = time.monotonic()
        self._mark_started()  # a partly provisioned cluster must still be torn down by kill()

        def launch() -> None:
            try:
                result = sky.launch(task, **kwargs)
                if isinstance(result, str):
                    self._launch_request = result
                    result = sky.get(result)
                if isinstance(result, (tuple, list)) and result:
                    self.sky_job_id = result[0]
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits (worker_addresses)
                self._launch_error = exc
            finally:
                Path(self.spec.secret_path).unlink(missing_ok=True)  # uploaded (or never will be): no local copy

        self._launch_thread = threading.Thread(target=launch, name=f"sky-launch-{self.cluster}", daemon=True)
        self._launch_thread.start()
        logger.info("launching %s (%d nodes) in the background", self.describe(), self.hosts)

    def _launch_finished(self) -> bool:
        """True once the launch succeeded; raises if it failed or overran `launch_timeout`."""
        thread = self._launch_thread
        if thread is None:
            return True
        if thread.is_alive():
            if time.monotonic() - self._launch_started > self._launch_timeout:
                raise JobFailedError(f"launching {self.describe()} ran over {self._launch_timeout:.0f} s; see "
                                     f"`sky api logs` / `sky status {self.cluster}`")
            return False
        self._launch_thread = None
        error = self._launch_error
        if error is not None:
            raise JobFailedError(f"launching {self.describe()} failed: {type(error).__name__}: {error}; run "
                                 f"`sky check`, or try another region/cloud") from error
        return True

    def status(self) -> str | None:
        """The cluster's status ("INIT", "UP", "STOPPED", ...) from `sky.status`, or None if it is not listed."""
        sky = self._sky()
        records = self._resolve(sky.status(cluster_names=[self.cluster])) or []
        for record in records:
            if record_field(record, "name") == self.cluster:
                return status_name(record_field(record, "status"))
        return None

    def is_alive(self) -> bool:
        if not self._started or self._killed:
            return False
        return self.status() in ALIVE_CLUSTER_STATES

    def problem(self) -> str | None:
        """Why this cluster can no longer serve its hosts (None while it looks healthy): it is stopped (spot
        preemption, autostop) or gone, so its replica needs a fresh cluster rather than a restart on it."""
        if not self._started:
            return None
        if self._killed:
            return f"{self.describe()} was released by this controller"
        if self._launch_thread is not None:
            return None  # still launching: nothing lost yet
        state = self.status()
        if state in ALIVE_CLUSTER_STATES:
            return None
        what = "is no longer listed by sky.status" if state is None else f"is {state}"
        return (f"{self.describe()} {what} (spot preemption, autostop or someone ran `sky down`); the replica "
                f"moves to a fresh cluster")

    def logs(self) -> str:
        """The run step's output so far (all nodes), through `sky.tail_logs` without following."""
        sky = self._sky()
        buffer = io.StringIO()
        if "output_stream" in _parameters(sky.tail_logs):
            sky.tail_logs(self.cluster, self.sky_job_id, follow=False, output_stream=buffer)
        else:  # SkyPilot < 0.8 printed the logs
            with contextlib.redirect_stdout(buffer):
                sky.tail_logs(self.cluster, self.sky_job_id, follow=False)
        return buffer.getvalue()

    def worker_addresses(self, timeout: float) -> list[str]:
        if not self._started:
            raise JobError(f"{self.describe()} was not started; call start() first")
        last_log = [""]

        def poll() -> list[str] | None:
            if self._killed:
                raise JobFailedError(f"{self.describe()} was killed")
            if not self._launch_finished():
                return None
            last_log[0] = self.logs()
            found = parse_address_markers(last_log[0])
            if all(rank in found for rank in range(self.hosts)):
                return [found[rank] for rank in range(self.hosts)]
            state = self.status()
            if state not in ALIVE_CLUSTER_STATES:
                raise JobFailedError(f"{self.describe()} is {state or 'gone'} with {len(found)}/{self.hosts} "
                                     f"workers reported; see `sky logs {self.cluster}`")
            return None

        addresses = wait_until(poll, timeout, interval=3.0, max_interval=10.0)
        if addresses is None:
            found = parse_address_markers(last_log[0])
            tail = "\n".join(last_log[0].splitlines()[-20:])
            waiting = "the launch is still running" if self._launch_thread is not None else \
                f"{len(found)}/{self.hosts} workers reported"
            raise JobTimeoutError(
                f"{self.describe()}: {waiting} after {timeout:.0f} s; see `sky logs {self.cluster}`"
                f"\n--- last log lines ---\n{tail}"
            )
        return addresses

    def reference(self) -> dict[str, Any] | None:
        if not self._started:
            return None
        return {"backend": "skypilot", "cluster": self.cluster, "describe": self.describe()}

    @classmethod
    def release_reference(cls, ref: dict[str, Any]) -> str:
        sky = cls._sky()
        result = sky.down(str(ref["cluster"]))
        if isinstance(result, str):  # a request id (SkyPilot >= 0.8)
            sky.get(result)
        return f"tore down {ref.get('describe') or ref['cluster']}"

    def kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        if self._started:
            sky = self._sky()
            if self._launch_thread is not None and self._launch_request is not None and hasattr(sky, "api_cancel"):
                try:  # stop provisioning more; the down below removes what exists
                    self._resolve(sky.api_cancel(self._launch_request))
                except Exception as exc:  # noqa: BLE001 - best effort; the down still runs
                    logger.warning("cancelling the launch of %s failed: %r", self.describe(), exc)
            try:
                self._resolve(sky.down(self.cluster))
            except Exception as exc:  # noqa: BLE001 - reported: the cluster may be left running
                logger.warning("sky.down(%r) failed, the cluster may still be running (check `sky status`): %s",
                               self.cluster, exc)
            else:
                logger.info("tore down %s", self.describe())
        shutil.rmtree(self._local_dir, ignore_errors=True)


def _parameters(func: Any) -> Mapping[str, Any]:
    try:
        return inspect.signature(func).parameters
    except (TypeError, ValueError):  # builtins and odd callables: assume the newer API
        return {"output_stream": None}
