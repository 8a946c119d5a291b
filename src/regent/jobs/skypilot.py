"""SkyPilot backend: a SkyPilot cluster of N nodes, each serving a host with `regent worker`.

Driven through the `sky` CLI (`pip install skypilot[<cloud>]`), so Regent does not depend on SkyPilot's
Python API, which changes between releases:
- `start()` writes a task YAML (see `build_task_yaml`) and starts `sky launch -y -d -c <cluster> task.yaml`
  in the background (provisioning takes minutes); `worker_addresses()` waits for it and reports its log
  if it fails. `-d` (detach) makes `sky launch` return once the run step is submitted.
- The secret travels as a file mount of a local 0600 file; setup `chmod 600`s the remote copy.
- Each node's run step calls `regent.jobs.base.launch_worker`, which serves on the node's IP and `port`
  and prints a `REGENT_WORKER_READY rank=<SKYPILOT_NODE_RANK> address=tcp://ip:port` line once listening.
  `worker_addresses()` reads those lines from `sky logs --no-follow <cluster>`.
- `is_alive()` parses `sky status <cluster>`; `kill()` runs `sky down -y <cluster>`.

The controller must reach the nodes' private IPs (same VPC or network), as with Monarch's SkyPilot example.

Testing: `build_task_yaml`, the status parser and the log parser are unit-tested, and the generated run
step is executed locally with the variables SkyPilot sets on a node (it serves a real worker). SkyPilot
and cloud credentials are not available here, so `sky launch/logs/status/down` themselves are untested.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import tempfile
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
    environ_without_secret,
    launcher_command,
    parse_address_markers,
    run_command,
    wait_until,
    write_secret_file,
)

logger = logging.getLogger(__name__)

REMOTE_SECRET = "~/.regent/job-secret"
DEFAULT_PORT = 26600
# `sky status` cluster states that still hold (or are getting) nodes.
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


def parse_cluster_status(text: str, cluster: str) -> str | None:
    """The STATUS column of `cluster` in `sky status` output, or None if the cluster is not listed."""
    header_cols: list[str] | None = None
    for line in text.splitlines():
        cols = line.split()
        if not cols:
            continue
        if cols[0] == "NAME" and "STATUS" in cols:
            header_cols = cols
            continue
        if cols[0] == cluster and header_cols is not None:
            for token in cols[1:]:
                if token in {"INIT", "UP", "STOPPED", "AUTOSTOPPING", "PENDING"}:
                    return token
    return None


class SkyPilotJob(Job):
    """A SkyPilot cluster of `hosts` nodes running workers (see the module docstring).

    Options: `accelerator` ("H100", "MI300X", ...), `cloud`, `region`, `instance_type`, `image_id`,
    `use_spot`, `cpus`, `memory`, `disk_size`, `python`, `setup` (shell lines that install regent; default
    `pip install regent-ml`), `workdir`, `file_mounts`, `env`, `port`, `idle_minutes_to_autostop`,
    `launch_timeout` (seconds for `sky launch`), `open_port` (expose the worker port publicly; off by
    default: the workers authenticate every connection, but there is no reason to invite the internet),
    `sky` (the CLI executable)."""

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
        sky: str = "sky",
    ) -> None:
        super().__init__(
            hosts, name=name, gpus_per_host=gpus_per_host, secret=secret, accelerator=accelerator, cloud=cloud,
            region=region, instance_type=instance_type, image_id=image_id, use_spot=use_spot, cpus=cpus,
            memory=memory, disk_size=disk_size, python=python, setup=tuple(setup), workdir=workdir,
            file_mounts=dict(file_mounts or {}), env=dict(env or {}), port=port,
            idle_minutes_to_autostop=idle_minutes_to_autostop, launch_timeout=launch_timeout, open_port=open_port,
            sky=sky,
        )
        self.cluster = self.unique_name
        self._sky = sky
        self._idle_minutes = idle_minutes_to_autostop
        self._launch_timeout = launch_timeout
        # Holds the task YAML and, only while `sky launch` uploads it, a copy of the secret.
        self._local_dir = Path(tempfile.gettempdir()) / f"regent-sky-{self.cluster}"
        self._launch: subprocess.Popen | None = None
        self._launch_log = self._local_dir / "launch.log"
        self._launch_started = 0.0
        self.spec = SkyPilotSpec(
            name=self.cluster, hosts=hosts, port=port, gpus_per_host=gpus_per_host, accelerator=accelerator,
            cloud=cloud, region=region, instance_type=instance_type, image_id=image_id, use_spot=use_spot,
            cpus=cpus, memory=memory, disk_size=disk_size, python=python, setup=tuple(setup), workdir=workdir,
            file_mounts=dict(file_mounts or {}), env=dict(env or {}),
            secret_path=str(self._local_dir / "secret"), open_port=open_port,
        )

    def describe(self) -> str:
        return f"SkyPilot cluster {self.cluster}"

    def _require_sky(self) -> str:
        path = shutil.which(self._sky)
        if path is None:
            raise JobError(
                f"the SkyPilot CLI `{self._sky}` is not installed; pip install 'skypilot[<cloud>]' and run "
                f"`sky check`, or choose another job backend (--job local|slurm|k8s)"
            )
        return path

    def start(self) -> None:
        """Run `sky launch` in the background (provisioning takes minutes); worker_addresses() waits for it."""
        if self._started:
            return
        if self._killed:
            raise JobError(f"{self.describe()} was killed; call renew() for a fresh allocation")
        sky = self._require_sky()
        self._local_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_secret_file(self.spec.secret_path, self.secret)
        task_path = self._local_dir / "task.yaml"
        task_path.write_text(build_task_yaml(self.spec))
        cmd = [sky, "launch", "-y", "-d", "-c", self.cluster]
        if self._idle_minutes is not None:
            cmd += ["-i", str(self._idle_minutes), "--down"]
        cmd.append(str(task_path))
        self._launch_log = self._local_dir / "launch.log"
        with open(self._launch_log, "w") as log:
            self._launch = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=environ_without_secret())
        self._launch_started = time.monotonic()
        self._mark_started()  # a partly provisioned cluster must still be torn down by kill()
        logger.info("launching %s (%d nodes) in the background; log: %s", self.describe(), self.hosts,
                    self._launch_log)

    def _launch_finished(self) -> bool:
        """True once `sky launch` succeeded; raises if it failed or overran `launch_timeout`."""
        launch = self._launch
        if launch is None:
            return True
        code = launch.poll()
        if code is None:
            if time.monotonic() - self._launch_started > self._launch_timeout:
                launch.terminate()
                raise JobFailedError(f"`sky launch` for {self.describe()} ran over {self._launch_timeout:.0f} s; "
                                     f"see {self._launch_log}")
            return False
        self._launch = None
        Path(self.spec.secret_path).unlink(missing_ok=True)  # uploaded (or never will be): no local copy
        if code != 0:
            raise JobFailedError(f"`sky launch` for {self.describe()} failed with exit code {code}; run "
                                 f"`sky check`. Last lines of {self._launch_log}:\n{self._launch_tail()}")
        return True

    def _launch_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self._launch_log.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return ""

    def status(self) -> str | None:
        proc = run_command([self._require_sky(), "status", self.cluster], timeout=300, check=False)
        return parse_cluster_status(proc.stdout, self.cluster)

    def is_alive(self) -> bool:
        if not self._started or self._killed:
            return False
        return self.status() in ALIVE_CLUSTER_STATES

    def worker_addresses(self, timeout: float) -> list[str]:
        if not self._started:
            raise JobError(f"{self.describe()} was not started; call start() first")
        sky = self._require_sky()
        last_log = [""]

        def poll() -> list[str] | None:
            if self._killed:
                raise JobFailedError(f"{self.describe()} was killed")
            if not self._launch_finished():
                last_log[0] = self._launch_tail()
                return None
            proc = run_command([sky, "logs", "--no-follow", self.cluster], timeout=300, check=False)
            last_log[0] = proc.stdout + proc.stderr
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
            raise JobTimeoutError(
                f"{self.describe()}: {len(found)}/{self.hosts} workers reported after {timeout:.0f} s; "
                f"see `sky logs {self.cluster}`\n--- last log lines ---\n{tail}"
            )
        return addresses

    def kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        if self._launch is not None and self._launch.poll() is None:
            self._launch.terminate()  # stop provisioning more; `sky down` below removes what exists
            try:
                self._launch.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._launch.kill()
                self._launch.wait()
        if self._started:
            proc = run_command([self._require_sky(), "down", "-y", self.cluster], timeout=1800, check=False)
            if proc.returncode != 0:
                logger.warning("`sky down %s` failed: %s", self.cluster, (proc.stderr or proc.stdout).strip())
            else:
                logger.info("tore down %s", self.describe())
        shutil.rmtree(self._local_dir, ignore_errors=True)
