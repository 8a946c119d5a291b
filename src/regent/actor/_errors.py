"""The three failure types a user sees, with Monarch's texts.

- `ActorError`: an endpoint raised an `Exception` and replied with it; the actor is alive.
- `SupervisionError`: the actor (or its process) is dead or stopped, so the call can never be answered.
- `MeshFailure`: what an owner's `__supervise__` (or the client's `unhandled_fault_hook`) receives.
"""

from __future__ import annotations

import os
import traceback


class ActorError(Exception):
    """An endpoint raised; `.exception` is the original exception, `str()` has the remote traceback."""

    def __init__(self, exception: BaseException, message: str = "An actor call failed.", remote_tb: str = ""):
        self.exception = exception
        self.message = message
        self.remote_traceback = remote_tb
        super().__init__(exception, message, remote_tb)

    def __str__(self) -> str:
        text = self.message
        if self.remote_traceback:
            tb = self.remote_traceback
            if tb.startswith("Traceback (most recent call last):\n"):
                tb = tb[len("Traceback (most recent call last):\n"):]
            text += "\nTraceback of where the remote call failed (most recent call last):\n" + tb
        else:
            text += f"\n{type(self.exception).__name__}: {self.exception}"
        return text

    def __reduce__(self):
        return (ActorError, (self.exception, self.message, self.remote_traceback))


class SupervisionError(RuntimeError):
    """A call that can never be answered because the target actor failed or was stopped."""

    def __init__(self, message: str, endpoint: str | None = None) -> None:
        self.message = message
        self.endpoint = endpoint
        super().__init__(message)

    def __str__(self) -> str:
        if self.endpoint:
            return f"Endpoint call {self.endpoint}() failed, {self.message}"
        return self.message

    def __reduce__(self):
        return (SupervisionError, (self.message, self.endpoint))


class MeshFailure:
    """A failure of one or more ranks of a mesh, delivered to the mesh's owner. Deliberately not picklable."""

    def __init__(self, mesh_name: str, crashed_ranks: list[int], event: str, mesh: object = None) -> None:
        self.mesh_name = mesh_name
        self.crashed_ranks = list(crashed_ranks)
        self.event = event
        self.mesh = mesh  # Regent: the failed mesh object when the owner holds it (Monarch leaves None)
        self._mesh_id: str | None = None

    def report(self) -> str:
        ranks = ", ".join(str(r) for r in self.crashed_ranks)
        return f'failure on mesh "{self.mesh_name}" at ranks [{ranks}] with event: {self.event}'

    def __str__(self) -> str:
        return f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={self.crashed_ranks}, event={self.event})"

    __repr__ = __str__

    def __reduce__(self):
        raise TypeError("MeshFailure is not picklable; send failure.report() instead")


_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_plumbing(filename: str) -> bool:
    path = os.path.abspath(filename)
    return os.path.dirname(path) == _RUNTIME_DIR or (
        os.sep + "concurrent" + os.sep + "futures" + os.sep in path
    ) or (os.sep + "asyncio" + os.sep in path)


def format_remote_traceback(exc: BaseException) -> str:
    """The traceback text of `exc` (with its `__cause__`/`__context__` chain) for shipping to the caller.

    Frames of the runtime itself (this package, thread pools, asyncio) are left out: the user wants to
    see their own code.
    """
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    kept = [frame for frame in te.stack if not _is_plumbing(frame.filename)]
    if kept:
        te.stack = traceback.StackSummary.from_list(kept)
    return "".join(te.format())
