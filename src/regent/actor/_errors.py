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


def ranks_text(ranks: list[int]) -> str:
    """Monarch's wording: `rank 3` for one rank, `ranks [1, 3]` for several."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks [{', '.join(map(str, ranks))}]"


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

    def __init__(self, mesh_name: str, crashed_ranks: list[int], event: str, mesh: object = None,
                 actor_name: str | None = None) -> None:
        self.mesh_name = mesh_name
        self.crashed_ranks = list(crashed_ranks)
        self.event = event
        self.mesh = mesh  # Regent: the failed mesh object when the owner holds it (Monarch leaves None)
        # the failed actor (or proc) as Monarch names it: `pkg.mod.Class name{'gpus': 0/2}`
        self.actor_name = actor_name or f"{mesh_name}{{{', '.join(map(str, self.crashed_ranks))}}}"
        self._mesh_id: str | None = None

    def report(self) -> str:
        """Monarch's failure report: `The actor <name> and all its descendants have failed:` then the
        error, indented; a failure escalated from a child mesh carries the child's report in it."""
        detail = self.event
        own = f"Supervision event: actor {self.actor_name} failed: "
        if detail.startswith(own):
            detail = detail[len(own):]
        body = "\n".join("  " + line if line else line for line in detail.rstrip("\n").split("\n"))
        return f"The actor {self.actor_name} and all its descendants have failed:\n{body}"

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
