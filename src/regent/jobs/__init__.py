"""regent.jobs: where hosts come from (local processes, SLURM, Kubernetes, SkyPilot).

Every backend implements the `Job` contract in `regent.jobs.base` (start, worker_addresses, host_mesh,
kill, is_alive, renew). Pick one by name with `get_job_class("slurm")`. Backends are imported lazily, so
importing this package needs neither torch nor the `kubernetes` client.
"""

from __future__ import annotations

import importlib
from typing import Any

# registry name -> (module, class)
_BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("regent.jobs.local", "ProcessJob"),
    "slurm": ("regent.jobs.slurm", "SlurmJob"),
    "k8s": ("regent.jobs.kubernetes", "KubernetesJob"),
    "skypilot": ("regent.jobs.skypilot", "SkyPilotJob"),
}
_ALIASES = {"kubernetes": "k8s", "sky": "skypilot", "process": "local"}

JOB_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def get_job_class(name: str) -> type:
    """The job class registered as `name` ("local", "slurm", "k8s" or "skypilot")."""
    key = _ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else name
    if key not in _BACKENDS:
        raise ValueError(f"unknown job backend {name!r}; choose one of {', '.join(JOB_BACKENDS)}")
    module_name, class_name = _BACKENDS[key]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"job backend {key!r} is unavailable: cannot import {module_name} ({exc})") from exc
    return getattr(module, class_name)


def make_job(name: str, hosts: int, **options: Any) -> Any:
    """Construct (not start) a job of backend `name`: `make_job("slurm", 4, partition="gpu")`."""
    return get_job_class(name)(hosts, **options)


_LAZY = {
    "Job": "regent.jobs.base",
    "JobError": "regent.jobs.base",
    "JobFailedError": "regent.jobs.base",
    "JobTimeoutError": "regent.jobs.base",
    "SlurmJob": "regent.jobs.slurm",
    "KubernetesJob": "regent.jobs.kubernetes",
    "SkyPilotJob": "regent.jobs.skypilot",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'regent.jobs' has no attribute {name!r}")


__all__ = ["JOB_BACKENDS", "get_job_class", "make_job", *_LAZY]
