"""regent.jobs: where hosts come from (local processes, SLURM, Kubernetes, SkyPilot).

Every backend implements the `Job` contract in `regent.jobs.base` (start, worker_addresses, host_mesh,
kill, is_alive, renew). Pick one by name with `get_job_class("slurm")`. Backends are imported lazily, so
importing this package needs neither torch nor the `kubernetes` client.
"""

from __future__ import annotations

import importlib
import inspect
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


# Options of the Job contract that a backend may legitimately not need (the local backend has no
# scheduler job name and no GPUs to request); make_job drops them for such a backend instead of failing.
_GENERIC_OPTIONS = ("name", "gpus_per_host")


def make_job(backend: str, hosts: int, /, **options: Any) -> Any:
    """Construct (not start) a job: `make_job("slurm", 4, name="regent-replica-0", partition="gpu")`.

    Backend-specific options go straight to the class, so a misspelt one fails with TypeError here,
    before anything is launched."""
    cls = get_job_class(backend)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # pragma: no cover - classes with C signatures
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for generic in _GENERIC_OPTIONS:
        if generic in options and generic not in params and not takes_any:
            options.pop(generic)
    return cls(hosts=hosts, **options)


_LAZY = {
    "Job": "regent.jobs.base",
    "JobError": "regent.jobs.base",
    "JobFailedError": "regent.jobs.base",
    "JobTimeoutError": "regent.jobs.base",
    "JobState": "regent.jobs.base",
    "SlurmJob": "regent.jobs.slurm",
    "KubernetesJob": "regent.jobs.kubernetes",
    "SkyPilotJob": "regent.jobs.skypilot",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'regent.jobs' has no attribute {name!r}")


__all__ = ["JOB_BACKENDS", "get_job_class", "make_job", *_LAZY]
