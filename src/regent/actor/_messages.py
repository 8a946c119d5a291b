"""The messages processes send each other: one typed record per kind.

On the wire a message is a plain tuple `(kind, *fields)` encoded with marshal (`encode`/`decode`): marshal is
several times cheaper than pickle for these types and its format is stable across Python 3 versions. In code a
message is a NamedTuple, built and read by field name. The payload (pickled arguments and results) travels
beside the envelope as the frame's body and buffers, never inside it.

A reply port is `(proc_id, port_id, index)`: where the answer goes. Ordered messages carry `(origin, seq)`, the
sender's per-destination sequence number (see `_tree.TreeState.deliver_in_order`).
"""

from __future__ import annotations

import marshal
from typing import Any, NamedTuple, TypeVar

Reply = tuple  # (proc_id, port_id, index)
T = TypeVar("T")


def kind(tag: str) -> Any:
    """Class decorator: the message's tag on the wire (a NamedTuple cannot have a class attribute in its body)."""

    def mark(cls: type[T]) -> type[T]:
        cls.KIND = tag  # type: ignore[attr-defined]
        return cls

    return mark


# ---- connections and addresses ------------------------------------------------------------------------------
@kind("hello")
class Hello(NamedTuple):
    """First message on a new connection: who is speaking, and how to reach it."""

    info: dict


@kind("bye")
class Bye(NamedTuple):
    """The sender is stopping on purpose: its end of the connection is no failure."""


@kind("whereis")
class WhereIs(NamedTuple):
    """Ask for the address of `proc_id` (answered with its info, or None when it is gone or unknown)."""

    proc_id: str
    reply: Reply


# ---- replies -----------------------------------------------------------------------------------------------
@kind("r")
class ReplyMsg(NamedTuple):
    """One answer to port `port` of the receiving process; the body is the pickled value."""

    port: int
    index: Any
    status: int


@kind("rb")
class ReplyBatch(NamedTuple):
    """Many OK answers to one port at once; the body is their bodies joined, `lengths` long each."""

    port: int
    indices: list
    lengths: list


# ---- actors ------------------------------------------------------------------------------------------------
@kind("m")
class Deliver(NamedTuple):
    """Call `method` of actor `key` (a rank of a mesh); `point` is its (labels, sizes, rank) in the view."""

    key: str
    method: str
    reply: Reply | None
    point: tuple
    origin: str | None = None
    seq: int | None = None


@kind("mc")
class CastItems(NamedTuple):
    """Call `method` on several actors of mesh `mesh_id` in the receiving process (`items`: rank, local rank,
    reply index). `reply` is None, or `(proc, port, mode)`: "b" gathers the answers, "d" sends each alone."""

    origin: str
    seq: int
    mesh_id: str
    method: str
    reply: tuple | None
    labels: list
    sizes: list
    items: list


@kind("cast")
class Cast(NamedTuple):
    """To a host agent: forward a cast to each of its processes (`per_proc`: (proc, seq, items))."""

    origin: str
    mesh_id: str
    method: str
    reply: tuple | None
    labels: list
    sizes: list
    per_proc: list


@kind("s")
class Spawn(NamedTuple):
    """Create actor `key`, rank `rank` of mesh `mesh_id`; the body is the pickled (class, args, kwargs)."""

    key: str
    mesh_id: str
    rank: int
    name: str
    point: tuple
    owner: tuple  # (owner proc, owner actor key)
    is_async: bool
    reply: Reply


@kind("f")
class RankFailed(NamedTuple):
    """To a mesh's owner process: rank `rank` of mesh `mesh_id` failed with `text`."""

    mesh_id: str
    rank: int
    text: str


@kind("stop_actor")
class StopActor(NamedTuple):
    key: str
    reason: str
    reply: Reply | None
    origin: str | None = None
    seq: int | None = None


@kind("goc")
class GetOrSpawnController(NamedTuple):
    """To the root process: the controller singleton `name` (spawned on first request; body: class, args)."""

    name: str
    reply: Reply


# ---- procs -------------------------------------------------------------------------------------------------
@kind("configure")
class Configure(NamedTuple):
    """To a new proc: its identity, env and rank; the body is the pickled bootstrap function (or empty)."""

    cfg: dict
    reply: Reply


@kind("stop_proc")
class StopProc(NamedTuple):
    reason: str
    reply: Reply | None
    origin: str | None = None
    seq: int | None = None


@kind("adopt")
class Adopt(NamedTuple):
    """To a proc whose controller died: the sender (`owner`, its address info) becomes its owner and
    controller. Refused while the current owner is still connected, unless `force`. `detach_grace` (None:
    keep the proc's own) is how long the proc may then train on without a controller."""

    owner: dict
    detach_grace: float | None
    force: bool
    reply: Reply


@kind("log_level")
class LogLevel(NamedTuple):
    """Set the proc's root log level, then mark the point in its output streams with `token`."""

    level: int
    token: str
    reply: Reply


# ---- host agents (`regent worker`) -------------------------------------------------------------------------
@kind("host_spawn")
class HostSpawn(NamedTuple):
    """Start procs `specs` for the sender; their exits and output go to `events`; the body is the bootstrap."""

    specs: list
    events: Reply
    reply: Reply


@kind("host_kill")
class HostKill(NamedTuple):
    pids: list


@kind("host_keep_warm")
class HostKeepWarm(NamedTuple):
    n: int
    preload: list
    refill_delay_s: float = 0.0


@kind("host_shutdown")
class HostShutdown(NamedTuple):
    pass


KINDS: dict[str, Any] = {cls.KIND: cls for cls in (
    Hello, Bye, WhereIs, ReplyMsg, ReplyBatch, Deliver, CastItems, Cast, Spawn, RankFailed, StopActor,
    GetOrSpawnController, Configure, StopProc, Adopt, LogLevel, HostSpawn, HostKill, HostKeepWarm, HostShutdown)}

# Messages whose sender waits on `reply` for an answer: a message to a dead process gets one (DEAD) instead.
ANSWERED_WHEN_UNDELIVERABLE = (Deliver, StopActor, StopProc, Spawn, Configure, Adopt, LogLevel)


def encode(msg: Any) -> bytes:
    return marshal.dumps((msg.KIND, *msg))


def decode(env: bytes | memoryview) -> Any:
    """The typed message of an envelope; ValueError/TypeError/EOFError for a malformed one."""
    raw = marshal.loads(env)
    if not isinstance(raw, tuple) or not raw:
        raise ValueError(f"an envelope must be a non-empty tuple, not {type(raw).__name__}")
    shape = _SHAPES.get(raw[0]) if isinstance(raw[0], str) else None
    if shape is None:
        raise ValueError(f"unknown message kind {raw[0]!r}")
    cls, n, defaults = shape
    fields = raw[1:]
    if len(fields) != n:  # trailing fields left out take their defaults; too many or too few is malformed
        missing = n - len(fields)
        if missing < 0 or missing > len(defaults):
            raise TypeError(f"{cls.__name__} has {n} fields, the envelope {len(fields)}")
        fields += defaults[len(defaults) - missing:]
    return _new(cls, fields)  # tuple.__new__: 2 us less than calling the class, on every message received


_new = tuple.__new__
_SHAPES = {tag: (cls, len(cls._fields), tuple(cls._field_defaults[f] for f in cls._fields
                                               if f in cls._field_defaults))
           for tag, cls in KINDS.items()}


def reply_to_answer(msg: Any) -> Reply | None:
    """The reply port of a message that must be answered even when it cannot be delivered."""
    return msg.reply if isinstance(msg, ANSWERED_WHEN_UNDELIVERABLE) else None
