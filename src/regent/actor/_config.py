"""Runtime knobs. Each has a default, an environment variable (declared in `regent.settings`), and can be set
with `config.configure(...)`.

Environment variables are read when a knob is first used, so a parent can configure its children by env;
spawned processes inherit the parent's effective values through `child_env()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from regent import settings


@dataclass
class RuntimeConfig:
    """Knobs of the actor runtime (seconds unless noted). `None` disables a timeout."""

    # A proc whose owner process is unreachable for this long exits by itself (env REGENT_ORPHAN_TIMEOUT).
    orphan_timeout: float | None = 60.0
    # Largest accepted frame in bytes (env REGENT_MAX_FRAME_BYTES); larger ones are refused with an error.
    max_frame_bytes: int = 10 * 1024**3
    # How long `__cleanup__` may run when an actor stops (env REGENT_CLEANUP_TIMEOUT).
    cleanup_timeout: float = 3.0
    # How long a stopping proc may take before it is killed (env REGENT_STOP_TIMEOUT).
    stop_timeout: float = 10.0
    # How long a new proc may take to start and connect back (env REGENT_SPAWN_TIMEOUT).
    spawn_timeout: float = 60.0
    # How long to keep dialling a worker that refuses connections, as one started just before
    # `attach_to_workers` does while it comes up (env REGENT_ATTACH_TIMEOUT; Monarch's 10 s attach timeout).
    attach_timeout: float = 10.0
    # Prefix forwarded child output with the proc's rank (env REGENT_PREFIX_OUTPUT=0 disables).
    prefix_output: bool = True
    # Prefix log records emitted inside actors with `[actor=...]`.
    prefix_python_logs_with_actor: bool = True
    # Monarch's `shared_asyncio_runtime`: all sync actors of a process run on one shared thread instead of a
    # thread each (env REGENT_SHARED_ASYNCIO_RUNTIME, or Monarch's HYPERACTOR_SHARED_ASYNCIO_RUNTIME). A call to
    # many sync actors then wakes one thread per process, not one per actor; the price is Monarch's too: the
    # process's sync actors no longer run concurrently, so one that blocks holds up the others; one that calls a
    # sync actor of its own process gets a RuntimeError from `get()` instead of waiting forever (stopping a mesh
    # it owns there waits out the stop timeout). Async actors always share the event loop.
    shared_asyncio_runtime: bool = False

    @staticmethod
    def from_env() -> RuntimeConfig:
        cfg = RuntimeConfig()
        cfg.orphan_timeout = settings.REGENT_ORPHAN_TIMEOUT.get()
        cfg.max_frame_bytes = settings.REGENT_MAX_FRAME_BYTES.get()
        # 0 or none: the default (these cannot be turned off)
        cfg.cleanup_timeout = settings.REGENT_CLEANUP_TIMEOUT.get() or cfg.cleanup_timeout
        cfg.stop_timeout = settings.REGENT_STOP_TIMEOUT.get() or cfg.stop_timeout
        cfg.spawn_timeout = settings.REGENT_SPAWN_TIMEOUT.get() or cfg.spawn_timeout
        cfg.attach_timeout = settings.REGENT_ATTACH_TIMEOUT.get() or cfg.attach_timeout
        cfg.prefix_output = settings.REGENT_PREFIX_OUTPUT.get()
        # Regent's name wins over Monarch's HYPERACTOR_SHARED_ASYNCIO_RUNTIME (an alias of the setting)
        cfg.shared_asyncio_runtime = settings.REGENT_SHARED_ASYNCIO_RUNTIME.get()
        return cfg

    def configure(self, **kwargs: object) -> None:
        names = {f.name for f in fields(self)}
        for key, value in kwargs.items():
            if key not in names:
                raise KeyError(f"unknown runtime knob {key!r}; known knobs: {sorted(names)}")
            setattr(self, key, value)

    def child_env(self) -> dict[str, str]:
        """Environment that gives a child process this process's effective knobs."""
        return {
            settings.REGENT_ORPHAN_TIMEOUT.name: "none" if self.orphan_timeout is None else repr(self.orphan_timeout),
            settings.REGENT_MAX_FRAME_BYTES.name: str(self.max_frame_bytes),
            settings.REGENT_CLEANUP_TIMEOUT.name: repr(self.cleanup_timeout),
            settings.REGENT_STOP_TIMEOUT.name: repr(self.stop_timeout),
            settings.REGENT_SPAWN_TIMEOUT.name: repr(self.spawn_timeout),
            settings.REGENT_ATTACH_TIMEOUT.name: repr(self.attach_timeout),
            settings.REGENT_PREFIX_OUTPUT.name: "1" if self.prefix_output else "0",
            settings.REGENT_SHARED_ASYNCIO_RUNTIME.name: "1" if self.shared_asyncio_runtime else "0",
        }

config = RuntimeConfig.from_env()
