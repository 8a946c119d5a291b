"""regent.jobs: where hosts come from (local processes, SLURM, Kubernetes, SkyPilot, your own `regent worker`s).

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
    "workers": ("regent.jobs.workers", "WorkersJob"),
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
    before anything is launched. Text values (from the command line: `--job.gpus-per-node 2`) are
    converted to the option's type first (`coerce_job_options`)."""
    cls = get_job_class(backend)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # pragma: no cover - classes with C signatures
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for generic in _GENERIC_OPTIONS:
        if generic in options and generic not in params and not takes_any:
            options.pop(generic)
    return cls(hosts=hosts, **coerce_job_options(backend, options))


def coerce_job_options(backend: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check option names against the backend's constructor and turn text values into the option's type.

    Text comes from the command line (`--job.gpus-per-node 2`, `--job.sbatch-args "--exclude=n1 --constraint=x"`):
    numbers become int/float, "true"/"false" bools, "none" None, and a list option is split like a shell
    would. TOML values that already have a type pass through. An unknown name raises TypeError naming the
    known ones; a bad value ValueError naming the option."""
    import shlex
    import typing

    cls = get_job_class(backend)
    try:
        params = inspect.signature(cls).parameters
        hints = typing.get_type_hints(cls.__init__)
    except (TypeError, ValueError, NameError):  # pragma: no cover - exotic signatures: pass options through
        return dict(options)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(options)
    known = sorted(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY)
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name not in params:
            raise TypeError(f"unknown option {name!r} for the {backend} job backend; known options: "
                            f"{', '.join(known)}")
        if not isinstance(value, str):
            out[name] = value
            continue
        text = value.strip()
        kinds = _annotation_kinds(hints.get(name))
        try:
            if text.lower() in ("none", "null") and type(None) in kinds:
                out[name] = None
            elif bool in kinds:
                if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(text)
                out[name] = text.lower() in ("1", "true", "yes", "on")
            elif int in kinds and str not in kinds:
                out[name] = int(text)
            elif float in kinds and str not in kinds:
                out[name] = float(text)
            elif list in kinds:
                out[name] = shlex.split(text)
            else:
                out[name] = value
        except ValueError as exc:
            expected = "/".join(sorted(k.__name__ for k in kinds if k is not type(None))) or "a value"
            raise ValueError(f"job option {name}={value!r}: expected {expected}") from exc
    return out


def _annotation_kinds(annotation: Any) -> set[type]:
    """The plain types an annotation admits: `int | None` -> {int, NoneType}; `Sequence[str]` -> {list}."""
    import collections.abc
    import typing

    if annotation is None:
        return set()
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        kinds: set[type] = set()
        for arg in args:
            kinds |= _annotation_kinds(arg)
        return kinds
    if origin in (list, tuple, collections.abc.Sequence):
        return {list}
    if origin is not None:
        return {origin} if isinstance(origin, type) else set()
    return {annotation} if isinstance(annotation, type) else set()


_LAZY = {
    "Job": "regent.jobs.base",
    "JobError": "regent.jobs.base",
    "JobFailedError": "regent.jobs.base",
    "JobTimeoutError": "regent.jobs.base",
    "JobState": "regent.jobs.base",
    "SlurmJob": "regent.jobs.slurm",
    "KubernetesJob": "regent.jobs.kubernetes",
    "SkyPilotJob": "regent.jobs.skypilot",
    "WorkersJob": "regent.jobs.workers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'regent.jobs' has no attribute {name!r}")


__all__ = ["JOB_BACKENDS", "coerce_job_options", "get_job_class", "make_job", *_LAZY]
