"""SLURM backend: one `sbatch` allocation whose tasks each serve a host with `regent worker`.

How it works:
- The controller makes a job directory on a filesystem the compute nodes share (default
  `~/.regent/jobs/<name>-<uid>`; home directories are shared on almost every SLURM cluster; set
  `shared_dir=` otherwise). It holds the secret (mode 0600), the batch script, the logs, and the workers'
  published addresses.
- `start()` submits the script with `sbatch --parsable` and returns at once; the job may stay PENDING.
- The script `srun`s one task per host. Each task runs `regent.jobs.base.launch_worker`, which serves on the
  node's first `hostname -I` address and a free port (or `port + SLURM_LOCALID` when `port=` is given, for
  sites that firewall everything but a range), and writes `worker-<SLURM_PROCID>.addr` once it listens.
- `worker_addresses()` reads those files, polling `squeue` so a job that fails or is cancelled is reported at
  once with its state and log path, and a job still PENDING at the deadline is reported with the reason.
- `kill()` runs `scancel`. `srun --kill-on-bad-exit=1` makes one dead worker end the whole step, so a broken
  allocation shows up as not alive and the orchestration layer can `renew()` it.

GPUs are asked for only when `gpus_per_host` is set (the orchestrator sets it from `--job.gpus-per-node`, or
from the cluster's GPU GRES as `sinfo` reports it: a cluster without GRES is never asked for GPUs). A request
for GPUs on a partition whose nodes advertise none is refused before `sbatch`, naming the fix.

Every way an allocation can end or stall is explained with its cause and fix (`explain_state`,
`explain_pending`): FAILED, TIMEOUT, PREEMPTED, NODE_FAIL, CANCELLED, OUT_OF_MEMORY; PENDING past the
timeout with its reason; and a node of a running job that SLURM marks DOWN or NOT_RESPONDING (`problem()`).

A "host" is one SLURM task: `ntasks_per_node > 1` packs several hosts on one node (each gets its own port),
which is how the test suite runs a 2-host job on a one-node cluster.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
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
    read_published_addresses,
    run_command,
    wait_until,
    write_secret_file,
)

logger = logging.getLogger(__name__)

# squeue states (long form) in which the allocation may still produce or hold workers.
ALIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"})
# States after which the job will never run workers again.
COMPLETING_WAIT_S = 10.0  # how long a lost allocation's report waits for the state that says why it ended
TERMINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "REVOKED", "TIMEOUT", "SPECIAL_EXIT", "STOPPED",
})


@dataclass
class SlurmScriptSpec:
    """Everything the batch script depends on; `build_sbatch_script` turns it into text."""

    job_name: str
    nodes: int
    ntasks_per_node: int
    job_dir: str
    python: str = "python3"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    gpus_per_host: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    exclusive: bool = False
    sbatch_args: Sequence[str] = ()
    srun_args: Sequence[str] = ()
    venv: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    interface: str | None = None
    setup: Sequence[str] = ()


def build_sbatch_script(spec: SlurmScriptSpec) -> str:
    """The batch script: #SBATCH directives, environment, and one `srun` that launches every worker.

    Pure: no I/O, so it is unit-tested directly. Values are shell-quoted; the secret never appears."""
    if spec.nodes < 1 or spec.ntasks_per_node < 1:
        raise ValueError("nodes and ntasks_per_node must be >= 1")
    log = f"{spec.job_dir}/slurm-%j.out"
    directives = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.ntasks_per_node}",
        f"--output={log}",
        f"--error={log}",
    ]
    if spec.partition:
        directives.append(f"--partition={spec.partition}")
    if spec.time:
        directives.append(f"--time={spec.time}")
    if spec.account:
        directives.append(f"--account={spec.account}")
    if spec.qos:
        directives.append(f"--qos={spec.qos}")
    if spec.gpus_per_host:
        # One task per node: the node's GPUs. Several: bind GPUs per task so hosts do not share devices.
        if spec.ntasks_per_node == 1:
            directives.append(f"--gpus-per-node={spec.gpus_per_host}")
        else:
            directives.append(f"--gpus-per-task={spec.gpus_per_host}")
    if spec.cpus_per_task:
        directives.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.mem:
        directives.append(f"--mem={spec.mem}")
    if spec.exclusive:
        directives.append("--exclusive")
    for arg in spec.sbatch_args:
        if not arg.startswith("-"):
            raise ValueError(f"sbatch_args entries must be options starting with '-', got {arg!r}")
        directives.append(arg)

    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), ""]
    lines += [
        "# Generated by regent.jobs.slurm: one `regent worker` per task, addresses published in the job dir.",
        "set -eo pipefail",  # no -u: site profiles and venv/conda activate scripts read unset variables
        "export PYTHONUNBUFFERED=1",
    ]
    if spec.venv:
        lines.append(f"source {shlex.quote(str(Path(spec.venv) / 'bin' / 'activate'))}")
    for key, value in spec.env.items():
        if not key.isidentifier():
            raise ValueError(f"environment variable name {key!r} is not valid")
        lines.append(f"export {key}={shlex.quote(str(value))}")
    lines += list(spec.setup)
    launcher_args = [
        "--address-dir", spec.job_dir,
        "--rank-env", "SLURM_PROCID",
        "--local-rank-env", "SLURM_LOCALID",
        "--secret-file", f"{spec.job_dir}/secret",
    ]
    if spec.port:
        launcher_args += ["--port", str(spec.port)]
    if spec.interface:
        launcher_args += ["--interface", spec.interface]
    srun = ["srun", "--kill-on-bad-exit=1", *spec.srun_args]
    if spec.cpus_per_task:
        srun.append(f"--cpus-per-task={spec.cpus_per_task}")
    srun += launcher_command(spec.python, launcher_args)
    lines += [
        'echo "regent: SLURM job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        " ".join(shlex.quote(part) for part in srun),
        "",
    ]
    return "\n".join(lines)


def parse_sbatch_output(text: str) -> str:
    """The job id from `sbatch --parsable` ("42" or "42;cluster") or plain "Submitted batch job 42"."""
    for line in text.strip().splitlines():
        line = line.strip()
        if line.startswith("Submitted batch job"):
            return line.split()[-1]
        head = line.split(";", 1)[0]
        if head.isdigit():
            return head
    raise JobError(f"could not find a job id in sbatch's output: {text.strip()!r}")


def parse_squeue_state(text: str) -> tuple[str, str] | None:
    """(state, reason) from `squeue -h -t all -o %T|%r`; None when squeue no longer knows the job."""
    for line in text.strip().splitlines():
        if "|" in line:
            state, reason = line.split("|", 1)
            return state.strip().upper(), reason.strip()
    return None


# state -> (cause, fix). The cause completes "SLURM job 42 ended in state X: <cause>"; the fix says what to do.
_STATE_HELP: dict[str, tuple[str, str]] = {
    "FAILED": ("the batch script or a worker exited with an error",
               "read the job log for the error (a wrong `python=`/`venv=`, regent missing on the nodes, a bad "
               "`setup` line)"),
    "TIMEOUT": ("it ran past its time limit and SLURM ended it",
                "raise the limit (`--job.time 24:00:00` or `[job_options] time`), within the partition's MaxTime"),
    "PREEMPTED": ("a higher-priority job preempted it",
                  "the replica moves to a fresh allocation; to avoid preemption use a QOS or partition that is not "
                  "preemptible (`--job.qos`, `--job.partition`)"),
    "NODE_FAIL": ("a node of the allocation failed or stopped answering slurmctld",
                  "the replica moves to a fresh allocation; if it keeps happening, exclude the node "
                  "(`--job.sbatch-args=--exclude=NODE`) and tell the cluster's admins"),
    "CANCELLED": ("it was cancelled (scancel by a user or an admin, or the controller released it)",
                  "nothing to fix if that was meant; the replica moves to a fresh allocation"),
    "OUT_OF_MEMORY": ("a process went over the allocation's memory limit",
                      "ask for more memory (`--job.mem 0` takes a whole node's) or train a smaller shard per host"),
    "BOOT_FAIL": ("a node failed to boot for it", "retry; tell the admins if the node keeps failing"),
    "DEADLINE": ("it reached its --deadline before it could run", "drop or move the --deadline sbatch argument"),
    "COMPLETING": ("it is ending (SLURM is stopping its processes) and had not recorded why within "
                   f"{COMPLETING_WAIT_S:.0f} s", "read the job log; `sacct -j JOBID` shows its final state"),
    "COMPLETED": ("its workers exited (every `regent worker` ended)",
                  "read the job log: a worker that exits without an error usually lost its controller"),
}

# PENDING reason -> what to do about it.
_PENDING_HELP: dict[str, str] = {
    "Resources": "the cluster has no free nodes matching the request now; wait longer (raise the timeout), ask "
                 "for fewer resources (GPUs, memory, time), or use another partition (`--job.partition`)",
    "Priority": "jobs with a higher priority are queued first; wait longer, or use a higher-priority QOS "
                "(`--job.qos`)",
    "ReqNodeNotAvail": "a node the job needs is down, drained or reserved; check `sinfo -R`, or drop a "
                       "--nodelist/--exclude that pins it",
    "PartitionTimeLimit": "the requested time exceeds the partition's limit; lower `--job.time`",
    "PartitionNodeLimit": "the request needs more nodes than the partition allows; ask for fewer",
    "PartitionDown": "the partition is down; use another (`--job.partition`) or ask the admins",
    "BeginTime": "the job was told not to start yet (--begin); drop that sbatch argument",
    "Dependency": "the job waits for another job (--dependency); drop that sbatch argument",
    "InvalidAccount": "the account is not valid here; set `--job.account` to one of `sacctmgr show assoc user=$USER`",
    "InvalidQOS": "the QOS is not valid for this account; set `--job.qos` to one the account may use",
}


def explain_state(state: str, reason: str = "") -> str:
    """Cause and fix for a job that ended in `state` (squeue's long form), as one sentence for an error."""
    cause, fix = _STATE_HELP.get(state, ("it will not run workers again", "read the job log"))
    extra = f" (reason: {reason})" if reason and reason not in ("None", "(null)") else ""
    return f"ended in state {state}{extra}: {cause}; {fix}"


def explain_pending(reason: str) -> str:
    """What to do about a job that is still PENDING for `reason` (squeue's %r)."""
    for key, hint in _PENDING_HELP.items():
        if reason == key or reason.startswith(key):
            return hint
    if reason.startswith(("QOS", "Assoc")):
        return ("a limit of the QOS or account holds it (too many jobs, GPUs or minutes in use); wait, or use "
                "another QOS/account (`--job.qos`, `--job.account`)")
    return "see `scontrol show job` for why; wait longer (raise the timeout) or change the request"


def parse_gres_gpus(text: str) -> int:
    """The most GPUs any node advertises, from `sinfo -h -o %G` lines ("(null)", "gpu:8",
    "gpu:a100:4(S:0-1)", "gpu:2,shard:4"); 0 when no node has GPU GRES."""
    best = 0
    for line in text.splitlines():
        for item in line.strip().split(","):
            parts = item.strip().split("(", 1)[0].split(":")
            if len(parts) >= 2 and parts[0] == "gpu":
                count = parts[-1]
                if count.isdigit():
                    best = max(best, int(count))
                elif count:  # "gpu:a100" without a count means one
                    best = max(best, 1)
            elif parts == ["gpu"]:
                best = max(best, 1)
    return best


def cluster_gpus_per_node(partition: str | None = None) -> int | None:
    """How many GPUs the nodes of `partition` (default: every partition) advertise as GRES; 0 on a cluster
    without GPU GRES; None when `sinfo` cannot say (not installed, controller unreachable)."""
    cmd = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    try:
        proc = run_command(cmd, timeout=30, check=False)
    except JobError:
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return parse_gres_gpus(proc.stdout)


def parse_node_states(text: str) -> dict[str, str]:
    """{node: state} from `sinfo -h -N -n NODES -o %N|%T` (states like "idle", "down*", "mixed")."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if "|" in line:
            node, state = line.split("|", 1)
            out[node.strip()] = state.strip().lower()
    return out


def bad_nodes(states: Mapping[str, str]) -> list[str]:
    """Nodes SLURM considers gone: DOWN, NOT_RESPONDING (a trailing `*`), FAIL, or POWERED_DOWN."""
    return sorted(n for n, s in states.items()
                  if s.endswith("*") or s.startswith(("down", "fail", "powered_down", "power_down")))


def unavailable_reason() -> str | None:
    """None when this machine can submit SLURM jobs now (sbatch on PATH, a node idle/mixed/allocated), else why
    not, with the fix; the real-SLURM tests skip with this text."""
    import shutil
    import subprocess

    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "SLURM is not installed (sudo sh .ci/install_slurm.sh installs and starts a single-node cluster)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo does not answer ({exc}); start SLURM with: sudo sh .ci/install_slurm.sh"
    states = proc.stdout.split()
    if proc.returncode != 0 or not any(s.startswith(("idle", "mix", "alloc")) for s in states):
        said = proc.stdout.strip() or proc.stderr.strip()
        return f"no usable SLURM node (sinfo: {said}); start SLURM with: sudo sh .ci/install_slurm.sh"
    return None


class SlurmJob(Job):
    """An sbatch allocation of `hosts` workers (see the module docstring).

    Options: `partition`, `time` ("HH:MM:SS"), `account`, `qos`, `ntasks_per_node` (hosts per node,
    default 1; `hosts` must be a multiple), `cpus_per_task`, `mem`, `exclusive`, `sbatch_args` (extra
    `--opt=value` directives), `srun_args`, `python` (interpreter on the nodes with regent installed;
    default: this one), `venv` (activated first), `env` (exported to workers), `setup` (shell lines run
    before srun), `port` (0 = free port), `interface` (serve on this NIC's address instead of the first of
    `hostname -I`), `shared_dir` (parent of the job directory)."""

    backend = "slurm"

    def __init__(
        self,
        hosts: int,
        *,
        name: str = "regent",
        gpus_per_host: int | None = None,
        secret: str | bytes | None = None,
        partition: str | None = None,
        time: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        ntasks_per_node: int = 1,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        exclusive: bool = False,
        sbatch_args: Sequence[str] = (),
        srun_args: Sequence[str] = (),
        python: str | None = None,
        venv: str | None = None,
        env: Mapping[str, str] | None = None,
        setup: Sequence[str] = (),
        port: int = 0,
        interface: str | None = None,
        shared_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(
            hosts, name=name, gpus_per_host=gpus_per_host, secret=secret, partition=partition, time=time,
            account=account, qos=qos, ntasks_per_node=ntasks_per_node, cpus_per_task=cpus_per_task, mem=mem,
            exclusive=exclusive, sbatch_args=tuple(sbatch_args), srun_args=tuple(srun_args), python=python,
            venv=venv, env=dict(env or {}), setup=tuple(setup), port=port, interface=interface,
            shared_dir=shared_dir,
        )
        if ntasks_per_node < 1 or hosts % ntasks_per_node:
            raise ValueError(
                f"hosts={hosts} is not a multiple of ntasks_per_node={ntasks_per_node}; each SLURM task is one "
                f"host, so choose hosts = nodes * ntasks_per_node"
            )
        root = Path(shared_dir) if shared_dir is not None else Path.home() / ".regent" / "jobs"
        self.job_dir = (root / self.unique_name).absolute()
        self.spec = SlurmScriptSpec(
            job_name=self.unique_name,
            nodes=hosts // ntasks_per_node,
            ntasks_per_node=ntasks_per_node,
            job_dir=str(self.job_dir),
            python=python or sys.executable,
            partition=partition,
            time=time,
            account=account,
            qos=qos,
            gpus_per_host=gpus_per_host,
            cpus_per_task=cpus_per_task,
            mem=mem,
            exclusive=exclusive,
            sbatch_args=tuple(sbatch_args),
            srun_args=tuple(srun_args),
            venv=venv,
            env=dict(env or {}),
            port=port,
            interface=interface,
            setup=tuple(setup),
        )
        self.job_id: str | None = None

    def describe(self) -> str:
        ident = f"SLURM job {self.job_id}" if self.job_id else "SLURM job (not submitted)"
        return f"{ident} ({self.unique_name})"

    @property
    def log_path(self) -> Path | None:
        return self.job_dir / f"slurm-{self.job_id}.out" if self.job_id else None

    def start(self) -> None:
        if self._started:
            return
        if self._killed:
            raise JobError(f"{self.describe()} was killed; call renew() for a fresh allocation")
        self.job_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.job_dir, 0o700)
        write_secret_file(self.job_dir / "secret", self.secret)
        script = build_sbatch_script(self.spec)
        script_path = self.job_dir / "job.sbatch"
        script_path.write_text(script)
        self._check_gpus_exist()
        proc = run_command(["sbatch", "--parsable", str(script_path)], timeout=120, check=False,
                           env=environ_without_secret())
        if proc.returncode != 0:
            error = (proc.stderr or proc.stdout).strip()[-2000:]
            hint = ""
            if "generic resource" in error.lower() or "gres" in error.lower():
                hint = (f"; the job asked for {self.spec.gpus_per_host} GPU(s) per host but the cluster cannot "
                        f"grant GPU GRES there: on a CPU cluster drop the GPU request (`--job.gpus-per-node 0`), "
                        f"else pick a GPU partition (`--job.partition`)")
            raise JobError(f"`sbatch --parsable {script_path}` failed with exit code {proc.returncode}: "
                           f"{error}{hint}")
        self.job_id = parse_sbatch_output(proc.stdout)
        self._mark_started()
        logger.info("submitted %s for %d hosts; logs in %s", self.describe(), self.hosts, self.log_path)

    def _check_gpus_exist(self) -> None:
        """Refuse, before sbatch, a GPU request on a partition whose nodes advertise no GPU GRES."""
        if not self.spec.gpus_per_host:
            return
        have = cluster_gpus_per_node(self.spec.partition)
        if have == 0:
            where = f"partition {self.spec.partition}" if self.spec.partition else "this cluster"
            raise JobError(
                f"{self.describe()} asks for {self.spec.gpus_per_host} GPU(s) per host, but no node of {where} "
                f"advertises GPU GRES (`sinfo -o %G` says none): on a CPU cluster drop the GPU request "
                f"(`--job.gpus-per-node 0`, or gpus_per_node = 0 in [job_options]); on a GPU cluster pick its GPU "
                f"partition (`--job.partition`)"
            )

    def problem(self) -> str | None:
        """Why this allocation can no longer serve its hosts, with the fix; None while it looks healthy.

        Ended (any state but PENDING/RUNNING/...): `explain_state`. Running, but a node of it is DOWN or not
        responding (a node that disappeared; slurmctld ends the job with NODE_FAIL a little later): named."""
        if not self._started:
            return None
        if self._killed:
            return f"{self.describe()} was released by this controller"
        current = self.scheduler_state()
        if current is None:
            return (f"{self.describe()} is no longer known to squeue (it ended more than MinJobAge ago); "
                    f"see {self.log_path}")
        state, reason = current
        if state == "COMPLETING":
            # ending: its processes are being stopped, and why it ended (CANCELLED, NODE_FAIL, TIMEOUT...) is
            # recorded once they are; the reason is what tells the user what to fix, so wait a little for it
            current = self._final_state(COMPLETING_WAIT_S) or current
            state, reason = current
        if state not in ALIVE_STATES:
            return f"{self.describe()} {explain_state(state, reason)}; see {self.log_path}"
        if state == "RUNNING":
            gone = self._bad_nodes()
            if gone:
                return (f"{self.describe()} is RUNNING but its node(s) {', '.join(gone)} are down or not "
                        f"responding (a node disappeared); the replica moves to a fresh allocation; if it keeps "
                        f"happening exclude the node (`--job.sbatch-args=--exclude={gone[0]}`) and check "
                        f"`sinfo -R`")
        return None

    def _final_state(self, wait_s: float) -> tuple[str, str] | None:
        """The job's state once it is past COMPLETING, waiting at most `wait_s`; None if it is still completing
        (or forgotten) by then."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            current = self.scheduler_state()
            if current is None:
                return None
            if current[0] != "COMPLETING":
                return current
        return None

    def _bad_nodes(self) -> list[str]:
        if self.job_id is None:
            return []
        proc = run_command(["squeue", "-h", "-j", self.job_id, "-o", "%N"], timeout=60, check=False)
        nodes = proc.stdout.strip() if proc.returncode == 0 else ""
        if not nodes or nodes == "(null)":
            return []
        proc = run_command(["sinfo", "-h", "-N", "-n", nodes, "-o", "%N|%T"], timeout=60, check=False)
        return bad_nodes(parse_node_states(proc.stdout)) if proc.returncode == 0 else []

    def scheduler_state(self) -> tuple[str, str] | None:
        """(state, reason) as squeue reports it, or None once SLURM has forgotten the job."""
        if self.job_id is None:
            return None
        proc = run_command(["squeue", "-h", "-j", self.job_id, "-t", "all", "-o", "%T|%r"], timeout=60, check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise JobError(f"`squeue -j {self.job_id}` failed: {proc.stderr.strip()}; is slurmctld reachable?")
        return parse_squeue_state(proc.stdout)

    def is_alive(self) -> bool:
        if not self._started or self._killed:
            return False
        current = self.scheduler_state()
        if current is None or current[0] not in ALIVE_STATES:
            return False
        return current[0] != "RUNNING" or not self._bad_nodes()

    def worker_addresses(self, timeout: float) -> list[str]:
        if not self._started:
            raise JobError(f"{self.describe()} was not started; call start() first")
        last_state: list[tuple[str, str] | None] = [None]
        squeue_error: list[str] = []

        def poll() -> list[str] | None:
            found = read_published_addresses(self.job_dir, self.hosts)
            if len(found) == self.hosts:
                return [found[rank] for rank in range(self.hosts)]
            try:
                current = self.scheduler_state()
            except JobError as exc:  # a busy slurmctld times out now and then; keep waiting
                logger.warning("%s", exc)
                squeue_error[:] = [str(exc)]
                return None
            squeue_error.clear()
            last_state[0] = current
            if self._killed or current is None or current[0] in TERMINAL_STATES:
                what = "was killed" if self._killed else (
                    "is no longer known to squeue" if current is None else explain_state(*current)
                )
                raise JobFailedError(
                    f"{self.describe()} {what} after {len(found)}/{self.hosts} workers reported; "
                    f"see {self.log_path}{self._log_tail()}"
                )
            return None

        addresses = wait_until(poll, timeout)
        if addresses is None:
            found = read_published_addresses(self.job_dir, self.hosts)
            current = last_state[0]
            waited = f"after {timeout:.0f} s"
            if current is not None and current[0] == "PENDING":
                detail = (f"still PENDING (reason: {current[1]}) {waited}: the cluster has not granted the "
                          f"allocation; {explain_pending(current[1])}")
            elif current is not None:
                detail = f"{current[0]}, but only {len(found)}/{self.hosts} workers reported {waited}"
            else:
                detail = f"in an unknown state with {len(found)}/{self.hosts} workers reported {waited}"
            if squeue_error:
                detail += f" (squeue last failed: {squeue_error[0]})"
            raise JobTimeoutError(
                f"{self.describe()} is {detail}; see {self.log_path}, or raise the timeout (under `regent train`: "
                f"--job.allocation-timeout){self._log_tail()}"
            )
        return addresses

    def _log_tail(self, lines: int = 20) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        return "\n--- last lines of the job log ---\n" + "\n".join(tail) if tail else ""

    def kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        (self.job_dir / "secret").unlink(missing_ok=True)  # workers read it at start; logs stay for debugging
        if self.job_id is None:
            return
        _scancel(self.job_id, self.describe())

    def reference(self) -> dict[str, Any] | None:
        if self.job_id is None:
            return None
        return {"backend": "slurm", "job_id": self.job_id, "secret_file": str(self.job_dir / "secret"),
                "describe": self.describe()}

    @classmethod
    def release_reference(cls, ref: dict[str, Any]) -> str:
        if ref.get("secret_file"):
            Path(ref["secret_file"]).unlink(missing_ok=True)
        return _scancel(str(ref["job_id"]), str(ref.get("describe") or f"SLURM job {ref['job_id']}"))


def _scancel(job_id: str, describe: str) -> str:
    proc = run_command(["scancel", job_id], timeout=60, check=False)
    if proc.returncode != 0:
        # Usually the job already ended ("Invalid job id", "already completing"): nothing left to free.
        logger.info("scancel %s: %s", job_id, proc.stderr.strip())
        return f"scancel {job_id}: {proc.stderr.strip() or 'already ended'}"
    logger.info("cancelled %s", describe)
    return f"cancelled {describe}"

