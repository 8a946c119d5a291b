"""`context()`: which actor is running, on which proc, and at which rank the current message was sent."""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from regent.actor._config import config
from regent.actor._process import get_runtime
from regent.actor._shape import Extent, Point
from regent.actor._supervision import ROOT_KEY

# (Instance, message rank as (labels, sizes, index) or a Point)
_current: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar("regent_actor", default=None)

_EMPTY = Extent([], [])


def _as_point(rank: Any) -> Point:
    if isinstance(rank, Point):
        return rank
    labels, sizes, index = rank
    return Point(index, Extent(labels, sizes))


class Instance:
    """The running actor (or, outside any actor, this process's client instance)."""

    def __init__(self, key: str, name: str, class_name: str, rank: Any, proc: Any, cell: Any = None,
                 creator: Instance | None = None) -> None:
        self.key = key
        self.name = name
        self.class_name = class_name
        self._rank = rank
        self._proc = proc
        self._cell = cell
        self.creator = creator

    @property
    def rank(self) -> Point:
        return _as_point(self._rank)

    @property
    def proc(self) -> Any:
        if callable(self._proc):
            self._proc = self._proc()
        return self._proc

    @property
    def proc_mesh(self) -> Any:
        return self.proc

    @property
    def actor_id(self) -> str:
        return self.key

    @property
    def proc_id(self) -> str:
        return get_runtime().proc_id

    def stop(self, reason: str = "stopped by actor") -> None:
        if self._cell is not None:
            self._cell.request_stop(reason)

    def abort(self, reason: str | None = None) -> None:
        if self._cell is not None:
            self._cell.fail(None, text=f"Supervision event: actor {self} failed: {reason or 'no reason provided'}")

    kill = abort

    def __str__(self) -> str:
        if self.key == "<root>":
            return "<root>"
        return f"<root>.<{self.class_name} {self.name}{self.rank}>"

    __repr__ = __str__


class Context:
    def __init__(self, instance: Instance, message_rank: Any) -> None:
        self.actor_instance = instance
        self._message_rank = message_rank

    @property
    def message_rank(self) -> Point:
        return _as_point(self._message_rank)


def context() -> Context:
    """The current actor and message; on the client (outside actors) the root instance."""
    current = _current.get()
    if current is not None:
        return Context(current[0], current[1])
    inst = get_runtime().proc_context
    if inst is None:
        inst = ensure_proc_context()
    return Context(inst, inst._rank)


def ensure_proc_context() -> Instance:
    """The instance used outside actors in this process (the client's root), made on first use with this
    process as its proc (`ProcessParts.self_proc`)."""
    rt = get_runtime()
    if rt.proc_context is None:
        proc = rt.parts.self_proc(rt)
        rt.proc_context = Instance(ROOT_KEY, ROOT_LABEL, "RootClientActor", Point(0, Extent([], [])), proc)
        rt.self_proc = proc
    return rt.proc_context


def current_rank() -> Point:
    return context().message_rank


def current_size() -> dict[str, int]:
    return dict(context().message_rank.extent)


def current_actor_name() -> str:
    return str(context().actor_instance.actor_id)


def set_current(instance: Instance, rank: Any) -> contextvars.Token:
    return _current.set((instance, rank))


ROOT_LABEL = "<root>"  # how the client's root instance prints (`Instance.__str__`)
_log_prefix: dict[str, str | None] = {}  # "outside": the label of records emitted outside any actor


def install_log_prefix(outside_actors: str | None) -> None:
    """Log records get `[actor=<instance>] ` in front while `config.prefix_python_logs_with_actor` is on, as in
    Monarch: inside an actor its instance, outside any actor `outside_actors` (the client's `<root>`; None in a
    proc or worker, whose own records stay as written). Installed once per process; a later call only changes
    the label outside actors."""
    installed = "outside" in _log_prefix
    _log_prefix["outside"] = outside_actors
    if installed:
        return
    make_record = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        # an empty message stays empty (torch.compile's structured trace logs empty records)
        if not config.prefix_python_logs_with_actor or record.msg == "":
            return record
        current = _current.get()
        label = str(current[0]) if current is not None else _log_prefix["outside"]
        if label is not None:
            record.msg = f"[actor={label}] {record.msg}"
        return record

    logging.setLogRecordFactory(factory)
