"""regent.actor: a single-controller actor runtime with Monarch's API (`from regent.actor import ...`).

One program (the controller) spawns processes (`this_host().spawn_procs(...)`), starts actors on them
(`procs.spawn(name, Cls, ...)`) and talks to them through endpoint adverbs (`call`, `call_one`, `choose`,
`stream`, `broadcast`). Failures are supervised: the creator of a mesh (its owner) gets `__supervise__`
calls; on the client, unhandled ones go to `regent.actor.unhandled_fault_hook`.

Regent extensions: `spawn_procs(env=...)`, `HostMesh.keep_warm(n, preload)`, `SupervisionError` exported.
This package does not import torch.
"""

from __future__ import annotations

import sys as _sys

from regent.actor._actor import Actor, concurrent_endpoint, endpoint
from regent.actor._config import config
from regent.actor._context import Context, context, current_actor_name, current_rank, current_size
from regent.actor._errors import ActorError, MeshFailure, SupervisionError
from regent.actor._future import Future
from regent.actor._mesh import (
    Accumulator,
    ActorMesh,
    Channel,
    Endpoint,
    Port,
    PortReceiver,
    ValueMesh,
    as_endpoint,
    send,
)
from regent.actor._proc import (
    HostMesh,
    ProcMesh,
    attach_to_workers,
    get_or_spawn_controller,
    this_host,
    this_proc,
)
from regent.actor._shape import Extent, Point, Shape, Slice


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """Called on the client for a failure no owner handled. Replace it to change the policy.

    The default prints the report and exits the client with code 1 (the runtime stops owned procs first).
    It is looked up at fault time, so `regent.actor.unhandled_fault_hook = my_hook` works at any moment.
    """
    _sys.stderr.write(f"Unhandled failure: {failure.report()}\n")
    _sys.stderr.flush()
    _sys.exit(1)


def shutdown_context() -> Future:
    """Stop every proc mesh this process owns and close the runtime's connections."""
    from regent.actor._runtime import runtime_if_started

    rt = runtime_if_started()
    if rt is not None:
        rt.shutdown()
    return Future._resolved(None)


__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "ActorMesh",
    "Channel",
    "Context",
    "Endpoint",
    "Extent",
    "Future",
    "HostMesh",
    "MeshFailure",
    "Point",
    "Port",
    "PortReceiver",
    "ProcMesh",
    "Shape",
    "Slice",
    "SupervisionError",
    "ValueMesh",
    "as_endpoint",
    "attach_to_workers",
    "concurrent_endpoint",
    "config",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "endpoint",
    "get_or_spawn_controller",
    "send",
    "shutdown_context",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
]
