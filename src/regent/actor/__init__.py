"""regent.actor: a single-controller actor runtime with Monarch's API (`from regent.actor import ...`).

One program (the controller) starts processes, starts actors on them, and talks to them:

    procs = this_host().spawn_procs(per_host={"gpus": 2})       # returns at once
    acc = procs.spawn("acc", Accum, 10)                         # __init__ runs in the background
    acc.add.broadcast(1)                                        # fire-and-forget, FIFO per sender
    print(acc.add.call(5).get().values())                       # Future[ValueMesh]
    procs.stop().get()

Processes. Every process (controller, proc, `regent worker`) runs one asyncio loop (uvloop when installed)
and talks to its peers over direct connections: Unix sockets on one machine, TCP across machines.
Listeners bind to loopback unless `enable_transport("tcp")` (before the first call; the client and its procs
are then dialled by this host's name), REGENT_LISTEN_HOST or a worker's --address says otherwise. Every
connection first proves knowledge of the job secret (HMAC challenge, both directions) before anything is
unpickled. The controller makes the secret (or takes REGENT_JOB_SECRET / REGENT_JOB_SECRET_FILE) and
hands it to children through the environment; `regent worker --secret-file F` reads it from a file.
A second program may use meshes the first one pickled for it (`pickle.load` gives working references)
when both start with the same secret: the same REGENT_JOB_SECRET (hex), or REGENT_JOB_SECRET_FILE
naming one file. Otherwise unpickling raises ForeignJobError at once, naming that fix (references carry
a fingerprint of the secret, not the secret).
Frames larger than REGENT_MAX_FRAME_BYTES (10 GiB) are refused by the sender (ValueError) and the
receiver (connection closed, error logged, process carries on). Arguments are pickled once per call
(C pickler, cloudpickle for lambdas and `__main__` code); NumPy arrays and CPU torch tensors of 64 KiB or
more travel out of band (written from their memory, read into their own buffer). Do not modify a tensor
passed to `broadcast` until the receiver has used it.

Hosts. `this_host()` is this machine (no dimensions): procs become children of the calling process.
`attach_to_workers(["tcp://h:p", ...])` (or `regent.jobs.local.ProcessJob(hosts=N).host_mesh()`) gives
`{"hosts": N}`; procs then start under those `regent worker` / `run_worker_loop_forever(address=...)`
processes, which report their exit status and print their output (forwarded to the client once
`logging_option(stream_to_client=True)`, or from the start with `attach_to_workers(..., stream_logs=True)`);
a worker and a client given no job secret share this user's default one. Worker addresses may be Monarch's
alias form `tcp://NAME:P@tcp://0.0.0.0:P` (serve on the second, be dialled as the first) or a
`Future[str]` (awaited before dialling). `spawn_procs(per_host={"gpus": G}, bootstrap=fn, env={...})`:
- proc i of a host gets its accelerator pinned with `regent.platform.child_visibility_env(i)`;
- `env` (Regent extension) is set before anything is imported;
- `bootstrap` runs in every proc before any actor (`current_rank()` works there); if it raises,
  `proc_mesh.initialized` raises ActorError; otherwise it resolves to True (as does `host_mesh.initialized`
  once every host answers; it fails naming an unreachable host);
- `proc_bind=[{"cpus": "0-3"}, ...]` (one entry per proc of a host; keys `cpus`/`physcpubind` for CPU ids,
  `cpunodebind` for NUMA nodes) pins every thread of proc i to those CPUs before `bootstrap`; `membind`
  and unknown keys are refused at `spawn_procs`, CPUs the host lacks fail `initialized`;
- `bootstrap_command=` (a `BootstrapCommand`, an argv list, or a function of the proc's Point) is the command
  that starts each proc; `default_bootstrap_cmd()` is Regent's (`python -m regent.actor._proc_main`, with
  `.with_env({...})`), and a wrapper may run first and `exec "$@"`. `host.with_python_executable(path)`
  spawns procs under another interpreter (which must import regent). Such procs never claim warm spares.
Warm spares (Regent extension): `host_mesh.keep_warm(n, preload=["torch", ...])` keeps n idle procs per
host that already imported `preload`; `spawn_procs` claims them (env and accelerator pinning are applied
at claim, before any CUDA initialisation) and starts replacements in the background. `keep_warm(0)`
ends them. Proc stdout/stderr reach the controller prefixed with `[<proc mesh name> gpus=i]`
(`host.stream_logs` is True for `this_host()`); `await proc_mesh.logging_option(stream_to_client=..., aggregate_window_sec=...,
level=...)` turns that off, prints each distinct line once per window with its count, and sets the procs'
root logger level. Lines printed before the call keep the old options, lines printed after it the new.

Supervision (Monarch's rules). The owner of a mesh is the actor that created it (the client's root
for meshes made outside actors); references and slices own nothing.
- An `Exception` from an endpoint called with a reply port reaches the caller as `ActorError` (remote
  traceback in `str()`); the actor lives on.
- An exception with no reply port (`broadcast`, explicit-port endpoints), any `BaseException`, a failing
  `__init__`, or the death of the process (SIGKILL, `os._exit`, SIGSEGV; report says e.g.
  "Killed(sig=9)") kills the actor. Calls in flight and later calls raise `SupervisionError`, never hang.
  Slices containing a failed rank are poisoned; other slices keep working.
- The owner's `__supervise__(failure: MeshFailure)` runs once per failed rank, even for ranks lost together
  (sync or async; one at a time per actor; not called again for a mesh the owner has since stopped). Truthy:
  handled. Falsy/None or no `__supervise__`: the owner fails too and its owner is told. `failure.mesh` is
  the failed mesh object (Regent extension), `failure.report()` the text with the remote traceback.
- On the client, unhandled failures go to `regent.actor.unhandled_fault_hook(failure)`, looked up at
  fault time. The default prints the report and exits with code 1 (the main thread gets SystemExit(1),
  atexit handlers run, owned procs are stopped).
- `stop()` runs `__cleanup__(None)` (an error stop passes the exception), children's before the owner's.
  `ProcMesh.stop()` never hangs: procs that do not exit within REGENT_STOP_TIMEOUT are killed. A proc that
  stops gracefully then runs its `atexit` handlers and `weakref.finalize` callbacks, flushes its output and
  ends through the interpreter's teardown (module globals' `__del__` runs), except where that is unsafe (a
  proc that imported torch.distributed, or with a non-daemon thread still running), which leaves with
  `os._exit`: see `regent.actor._runtime.exit_gracefully` for why. Killed, crashed and orphaned procs run none
  of it.
- Orphans: a proc whose owner process has been unreachable for REGENT_ORPHAN_TIMEOUT seconds (default
  60, `config.configure(orphan_timeout=...)` before spawning) exits by itself.
- Adoption (Regent extension): `pm.reference()` / `mesh.reference()` give JSON-able dicts naming the
  procs, their addresses and OS pids, and the job's secret fingerprint. A new controller with the same
  secret takes them over after the old one died: `adopt_proc_mesh(ref)` makes it the procs' owner (refused
  with AdoptError while the old owner is still connected, unless `force=True`); `attach_actor_mesh(ref,
  pm)` gives a handle it owns, so rank failures reach it with `failure.mesh` that handle. Another job's
  reference raises ForeignJobError.

Futures: `get(timeout)` (TimeoutError leaves the future usable), `await fut` on any asyncio loop; results
are cached. `get()` on the runtime's own loop (inside an async endpoint) raises instead of deadlocking:
use `await` there. Sync actors run on a thread of their own, so `get()` inside them is fine. An async
actor's `__init__` also runs on a thread of its own (a blocking `__init__` cannot stall the process's
loop; calls to the actor wait in its mailbox until `__init__` returns), so inside it there is no running
event loop: start tasks from an endpoint. `config.configure(shared_asyncio_runtime=True)` (Monarch's knob; env
REGENT_SHARED_ASYNCIO_RUNTIME or HYPERACTOR_SHARED_ASYNCIO_RUNTIME), set before `spawn_procs`, runs all sync
actors of a proc on one shared thread instead: a call to many of them wakes one thread per proc, but they take
turns, so one that blocks holds up its siblings, and `get()` on a call to a sibling raises RuntimeError (it could
never return).

Not provided: the tensor engine (`rref`, `activate`), RDMA buffers, TLS, `attach`, `hosts_from_config`,
`ProcId`/`Uid`, the tracing helpers and `sync_workspace` (README: "Where regent.actor differs from Monarch").
This package does not import torch.
"""

from __future__ import annotations

import sys as _sys
from collections.abc import Callable as _Callable

from regent.actor._actor import Actor, concurrent_endpoint, endpoint
from regent.actor._config import config
from regent.actor._context import ROOT_LABEL as _ROOT_LABEL
from regent.actor._context import Context, context, current_actor_name, current_rank, current_size
from regent.actor._context import install_log_prefix as _install_log_prefix
from regent.actor._errors import ActorError, MeshFailure, SupervisionError
from regent.actor._future import Future
from regent.actor._handlers import handler_table as _handler_table
from regent.actor._host_mesh import HostMesh, attach_to_workers, this_host
from regent.actor._host_mesh import local_host_mesh as _local_host_mesh
from regent.actor._mesh import (
    Accumulator,
    ActorMesh,
    Channel,
    Endpoint,
    PortReceiver,
    ValueMesh,
    as_endpoint,
    send,
)
from regent.actor._port import Port
from regent.actor._proc_mesh import (
    AdoptError,
    ProcMesh,
    adopt_proc_mesh,
    attach_actor_mesh,
    get_or_spawn_controller,
    this_proc,
)
from regent.actor._proc_mesh import controller_local as _controller_local
from regent.actor._proc_mesh import self_proc_mesh as _self_proc_mesh
from regent.actor._process import ProcessParts as _ProcessParts
from regent.actor._process import enable_transport
from regent.actor._process import get_runtime as _get_runtime
from regent.actor._process import install_parts as _install_parts
from regent.actor._process import runtime_if_started as _runtime_if_started
from regent.actor._runtime import ChannelTransport, ForeignJobError
from regent.actor._shape import Extent, Point, Shape, Slice
from regent.actor._spawner import BootstrapCommand, default_bootstrap_cmd
from regent.actor.commands import run_worker_loop_forever


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """Called on the client for a failure no owner handled. Replace it to change the policy.

    The default prints the report and exits the client with code 1 (the runtime stops owned procs first).
    It is looked up at fault time, so `regent.actor.unhandled_fault_hook = my_hook` works at any moment.
    """
    _sys.stderr.write(f"Unhandled failure: {failure.report()}\n")
    _sys.stderr.flush()
    _sys.exit(1)


def _call_unhandled_fault_hook(failure: MeshFailure) -> None:
    """The client runtime's fault hook: this module's `unhandled_fault_hook` as it is at the time of the fault."""
    unhandled_fault_hook(failure)


# Records logged outside actors in this program (the client) say `[actor=<root>]`, as in Monarch; a proc or worker
# that imports this package sets its own label (none) when it starts.
_install_log_prefix(_ROOT_LABEL)

# The composition root: the process layer is given what it may not import from the layers above it.
_install_parts(_ProcessParts(handlers=_handler_table, self_proc=_self_proc_mesh, spawn_controller=_controller_local,
                             fault_hook=_call_unhandled_fault_hook, local_host=_local_host_mesh))


def on_owner_lost(fn: _Callable[[str], None]) -> None:
    """Regent extension: in a proc spawned with `detach_grace`, call `fn(reason)` when its owner is lost (the
    proc goes on for the grace; see `HostMesh.spawn_procs`). Called on the proc's loop; keep it short."""
    _get_runtime().on_detach.append(fn)


def shutdown_context() -> Future:
    """Stop every proc mesh this process owns and close the runtime's connections."""
    rt = _runtime_if_started()
    if rt is not None:
        rt.shutdown()
    return Future._resolved(None)


__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "ActorMesh",
    "AdoptError",
    "BootstrapCommand",
    "Channel",
    "ChannelTransport",
    "Context",
    "Endpoint",
    "Extent",
    "ForeignJobError",
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
    "adopt_proc_mesh",
    "as_endpoint",
    "attach_actor_mesh",
    "attach_to_workers",
    "concurrent_endpoint",
    "config",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "default_bootstrap_cmd",
    "enable_transport",
    "endpoint",
    "get_or_spawn_controller",
    "on_owner_lost",
    "run_worker_loop_forever",
    "send",
    "shutdown_context",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
]
