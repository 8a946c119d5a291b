"""What one replica asks the job layer for: the job options, how many GPUs, how long to wait for the grant.

Pure apart from two questions it may ask, both injectable for tests: does the cluster have GPUs
(`sinfo -o %G` on SLURM), and which platform was forced (`GPU_PLATFORM`).

The options come from the run config's `job_options` (TOML `[job_options]`, or `--job.KEY VALUE` on the command
line) and go to the backend's constructor, except these, which the orchestrator reads itself:

- `gpus_per_node` (alias `gpus_per_host`): GPUs per replica host. 0 asks for none. Unset: SLURM asks the
  cluster (`procs_per_replica` GPUs when its nodes advertise GPU GRES, none when they do not, so a CPU
  cluster is never asked for GRES); other backends ask for `procs_per_replica` GPUs unless `GPU_PLATFORM=cpu`.
  `GPU_PLATFORM=cpu` always means none, `cuda`/`rocm` always `procs_per_replica`.
- `allocation_timeout`: how long a replica waits for its allocation to be granted and its worker to report
  (seconds, or a duration like "10m"; default 600 s). Past it the replica's start fails with the scheduler's
  reason (for example "SLURM job 42 is still PENDING (reason: Resources) ...").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from regent import settings

ORCHESTRATOR_OPTIONS = ("gpus_per_node", "gpus_per_host", "allocation_timeout")
DEFAULT_ALLOCATION_TIMEOUT_S = 600.0


@dataclass
class AllocationPlan:
    options: dict[str, Any] = field(default_factory=dict)  # for make_job, gpus_per_host included
    gpus_per_host: int | None = None
    gpus_reason: str = ""  # why that many GPUs (for the log and the allocation event)
    timeout_s: float = DEFAULT_ALLOCATION_TIMEOUT_S


def _slurm_cluster_gpus(partition: str | None) -> int | None:
    from regent.jobs.slurm import cluster_gpus_per_node

    return cluster_gpus_per_node(partition)


def plan_allocation(
    backend: str,
    procs_per_replica: int,
    job_options: Mapping[str, Any],
    *,
    platform_override: str | None = None,
    cluster_gpus: Callable[[str | None], int | None] | None = None,
) -> AllocationPlan:
    """Decide the GPUs and the options of one replica's allocation (see the module docstring).

    `platform_override` defaults to `$GPU_PLATFORM`; `cluster_gpus(partition)` to asking `sinfo`."""
    opts = dict(job_options)
    explicit: Any = None
    for key in ("gpus_per_node", "gpus_per_host"):
        if key in opts:
            value = opts.pop(key)
            if explicit is None:
                explicit = value
    timeout = opts.pop("allocation_timeout", None)
    plan = AllocationPlan(timeout_s=_seconds(timeout) if timeout is not None else DEFAULT_ALLOCATION_TIMEOUT_S)
    forced = (settings.GPU_PLATFORM.get() or "") if platform_override is None else platform_override.strip().lower()
    if explicit is not None and str(explicit).strip().lower() not in ("", "auto"):
        try:
            gpus = int(explicit)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"job option gpus_per_node={explicit!r}: expected a number of GPUs (0: none) or "
                             f"auto") from exc
        if gpus < 0:
            raise ValueError(f"job option gpus_per_node={gpus}: must be 0 (no GPUs) or more")
        plan.gpus_per_host = gpus or None
        plan.gpus_reason = "gpus_per_node set in the job options"
    elif forced == "cpu":
        plan.gpus_reason = "GPU_PLATFORM=cpu"
    elif forced in ("cuda", "rocm"):
        plan.gpus_per_host, plan.gpus_reason = procs_per_replica, f"GPU_PLATFORM={forced}"
    elif backend == "slurm":
        ask = cluster_gpus or _slurm_cluster_gpus
        have = ask(opts.get("partition"))
        if have is None:
            plan.gpus_reason = "sinfo could not say whether the cluster has GPUs: none asked for (set gpus_per_node)"
        elif have == 0:
            plan.gpus_reason = "the cluster's nodes advertise no GPU GRES"
        else:
            plan.gpus_per_host = procs_per_replica
            plan.gpus_reason = f"the cluster's nodes advertise {have} GPU(s) as GRES"
    else:
        plan.gpus_per_host, plan.gpus_reason = procs_per_replica, "one GPU per trainer process"
    plan.options = {**opts, "gpus_per_host": plan.gpus_per_host}
    return plan


def check_job_options(backend: str, procs_per_replica: int, job_options: Mapping[str, Any]) -> None:
    """Refuse misspelt or badly typed job options before anything is launched (ValueError naming the fix).

    Asks no scheduler: the GPU count is checked for its type only."""
    from regent.jobs import coerce_job_options

    plan = plan_allocation(backend, procs_per_replica, job_options, platform_override="cpu",
                           cluster_gpus=lambda _partition: 0)
    options = {k: v for k, v in plan.options.items() if k != "gpus_per_host"}
    try:
        coerce_job_options(backend, options)
    except TypeError as exc:
        raise ValueError(f"{exc}; set them as --job.KEY VALUE or in the [job_options] table") from exc


def _seconds(value: Any) -> float:
    from regent.orchestrate.config import parse_duration

    try:
        seconds = parse_duration(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"job option allocation_timeout={value!r}: give seconds or a duration like 10m") from exc
    if seconds <= 0:
        raise ValueError(f"job option allocation_timeout={value!r} must be positive")
    return seconds
