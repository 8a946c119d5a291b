"""Tree fan-out of casts and fan-in of their replies.

A cast to many actors is sent once per host, not once per actor. The caller groups the target ranks by the
process they live in and the processes by the host agent that started them (the `regent worker` that is
their parent, `ActorRuntime.remote_procs`). It then sends:

- one "cast" message to each agent with two or more target processes; the agent forwards one "mc" message
  to each of its processes;
- one "mc" message straight to every other process (local children, a lone process on a host, or processes
  whose agent is unknown to this caller, e.g. a mesh reference received from elsewhere).

A process that receives "mc" posts the message to each of its target actors (several ranks of a mesh may
share a process: `ProcMesh.colocated`).

Replies of a `call()` come back the same way, gathered: a `Batch` in the process collects the replies of its
actors and sends them on as one "rb" message when all are in; the agent's `Batch` gathers its processes'
batches and sends one "rb" to the caller. An error or a reply carrying out-of-band buffers is not held back:
it goes on alone at once, so a failing call fails as soon as it would have without the tree. `stream()` and
port sends ask for direct replies (each actor answers the caller), because their users want each reply as it
arrives.

Order: messages from one sender to one actor keep their order (Monarch's guarantee) even though some travel
through an agent and some go straight. Each "m" and "mc" message carries the sender's id and a sequence
number counted per (sender, destination process); the destination delivers them in that order
(`TreeState.deliver_in_order`), holding any that arrive early. A gap that is not filled within `GAP_TIMEOUT_S` (a
relaying agent died with the message) is skipped, with a warning, so a lost message cannot stall the process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from regent.actor._messages import Cast, CastItems, ReplyBatch, ReplyMsg, encode
from regent.actor._pickle import dumps
from regent.actor._runtime import DEAD, OK

if TYPE_CHECKING:  # type only: the process layer builds on this module
    from regent.actor._process import ActorRuntime

logger = logging.getLogger("regent.actor")

GAP_TIMEOUT_S = 10.0
SPAWN = "__spawn__"  # in the method slot of a cast: spawn the target actors instead of calling them
Item = tuple[int, int, int]  # (rank in the mesh, index of the rank's point in the view, reply index)


class TreeState:
    """The per-process state of tree casts (`ActorRuntime.tree`): sequence numbers of ordered messages sent, per
    destination process; per sender, the number expected next and the messages that arrived early; and, on a
    host agent, the reply batches waiting on each of its processes.

    It exists so that the ordering rule (deliver each sender's messages in the order it numbered them, even
    when some came through an agent and some straight) lives in one object with the state it needs, instead
    of module functions editing dicts of the runtime. Loop thread only; `rt` gives the loop for gap timers."""

    def __init__(self, rt: ActorRuntime) -> None:
        self.rt = rt
        self._out_seq: dict[str, int] = {}  # destination process -> next sequence number
        self._in_seq: dict[str, int] = {}  # sender -> sequence number expected next
        self._held: dict[str, dict[int, Callable[[], None]]] = {}  # sender -> early deliveries, by number
        self._batches: dict[str, set[Batch]] = {}  # (agents) process -> batches waiting on its replies

    # ---- order -------------------------------------------------------------------------------------------
    def next_seq(self, dest: str) -> int:
        """The next sequence number of an ordered message from this process to `dest`."""
        seq = self._out_seq.get(dest, 0)
        self._out_seq[dest] = seq + 1
        return seq

    def expected(self, origin: str) -> int:
        """The sequence number of the next message from `origin` to deliver."""
        return self._in_seq.get(origin, 0)

    def held_count(self, origin: str | None = None) -> int:
        """How many messages (from `origin`, or from anyone) wait for earlier ones."""
        if origin is not None:
            return len(self._held.get(origin, ()))
        return sum(len(h) for h in self._held.values())

    def deliver_in_order(self, origin: str | None, seq: int | None, fn: Callable[[], None]) -> None:
        """Run `fn` (the delivery of message `seq` from `origin`) once every earlier message from `origin` was
        delivered here. Messages without a sequence number (older senders) are delivered at once."""
        if origin is None or seq is None:
            fn()
            return
        expected = self._in_seq.get(origin, 0)
        if seq < expected:  # after a skipped gap: late, deliver rather than drop
            fn()
            return
        if seq > expected:
            held = self._held.setdefault(origin, {})
            held[seq] = fn
            if len(held) == 1:
                self.rt.loop.call_later(GAP_TIMEOUT_S, self._skip_gap, origin, expected)
            return
        fn()
        expected += 1
        held = self._held.get(origin)
        while held and expected in held:
            held.pop(expected)()
            expected += 1
        self._in_seq[origin] = expected
        if held is not None and not held:
            del self._held[origin]
        elif held:
            self.rt.loop.call_later(GAP_TIMEOUT_S, self._skip_gap, origin, expected)

    def _skip_gap(self, origin: str, expected: int) -> None:
        held = self._held.get(origin)
        if not held or self._in_seq.get(origin, 0) != expected:
            return
        nxt = min(held)
        logger.warning("messages %d..%d from %s never arrived (a relaying host agent was lost?); delivering the "
                       "later ones", expected, nxt - 1, origin)
        self._in_seq[origin] = nxt
        self.deliver_in_order(origin, nxt, held.pop(nxt))  # delivers it and whatever follows it in order

    # ---- reply batches on agents ---------------------------------------------------------------------------
    def add_batch(self, pid: str, batch: Batch) -> None:
        """`batch` waits on replies from process `pid`."""
        self._batches.setdefault(pid, set()).add(batch)

    def drop_batch(self, batch: Batch) -> None:
        """`batch` is complete: no process's exit needs to answer for it any more."""
        for s in self._batches.values():
            s.discard(batch)

    def proc_exited(self, pid: str, reason: str | None) -> None:
        """On an agent: one of its processes exited; batches waiting on it are answered for it."""
        for batch in list(self._batches.pop(pid, ())):
            batch.proc_exited(pid, reason)


class Batch:
    """Gathers replies addressed to one port and passes them on to `up` (a process and port) as one "rb"
    message when `expected` replies are in. Errors and replies with buffers are passed on alone at once.
    On an agent it also knows which process owes which reply, so a process that exits answers for its
    ranks (`proc_exited`) instead of leaving the batch waiting."""

    # Sync actors answer from their own threads straight into the batch (`Runtime.send_reply`): no loop
    # wake-up per actor, only one for the batch's message up (a call over 1,024 sync actors spent most of its
    # time waking the loop once per reply).
    deliver_any_thread = True

    def __init__(self, rt: ActorRuntime, up: tuple[str, int], expected: int,
                 owed_by: dict[int, str] | None = None) -> None:
        self.lock = threading.Lock()
        self.rt = rt
        self.up = up
        self.left = expected
        self.indices: list[int] = []
        self.bodies: list[bytes] = []
        self.owed_by = owed_by  # reply index -> process id (agents only)
        self.port_id = rt.new_port(self)
        if owed_by:
            for pid in set(owed_by.values()):
                rt.tree.add_batch(pid, self)

    def deliver(self, index: int, status: int, body: Any, buffers: list) -> None:
        """One reply; any thread (sends happen on the loop)."""
        with self.lock:
            if self.left <= 0:
                return
            if self.owed_by is not None and self.owed_by.pop(index, None) is None:
                return  # already answered (by the process's exit)
            alone = status != OK or bool(buffers)
            if not alone:
                self.indices.append(index)
                self.bodies.append(bytes(body))
            self.left -= 1
            done = self.left == 0
        if alone:
            env = encode(ReplyMsg(self.up[1], index, status))
            self.rt.run_on_loop(self.rt.send_raw, self.up[0], env, bytes(body), buffers)
        if done:
            self.rt.run_on_loop(self._flush)

    def _flush(self) -> None:
        rt = self.rt
        rt.drop_port(self.port_id)
        if self.owed_by is not None:
            rt.tree.drop_batch(self)
        if self.indices:
            env = encode(ReplyBatch(self.up[1], self.indices, [len(b) for b in self.bodies]))
            rt.send_raw(self.up[0], env, b"".join(self.bodies), [])
        self.indices, self.bodies = [], []

    def proc_exited(self, pid: str, reason: str | None) -> None:
        """Answer, with DEAD, every reply `pid` still owed."""
        owed = [i for i, p in (self.owed_by or {}).items() if p == pid]
        if not owed:
            return
        text = f"the process this actor was running on failed: {reason or 'it stopped'}"
        body, _ = dumps(text)
        for i in owed:
            self.deliver(i, DEAD, body, [])


def post_many(rt: ActorRuntime, post: Callable[[str, tuple], None], spawn: Callable[..., None], mesh_id: str,
              method: str | list, reply: tuple | None, labels: list, sizes: list, items: list, body: Any,
              buffers: list) -> None:
    """Deliver one "mc" message in this process: post it to each target actor, or, when `method` is
    `[SPAWN, name, owner, is_async]`, spawn the target actors. With a batched reply, the replies of these
    actors are gathered here first."""
    if isinstance(method, list) and method[0] == SPAWN:
        _, name, owner, is_async = method
        batch_reply = _reply_target(rt, reply, len(items))
        for rank, local, ridx in items:
            spawn(f"{mesh_id}/{rank}", mesh_id, rank, name, (labels, sizes, local), tuple(owner), is_async,
                  None if batch_reply is None else (*batch_reply, ridx), body, buffers)
        return
    target = _reply_target(rt, reply, len(items))
    first = True
    for rank, local, ridx in items:
        bufs = buffers
        if buffers and not first:  # each actor gets its own copy of out-of-band buffers (tensors)
            bufs = [memoryview(bytearray(b)) for b in buffers]
        first = False
        item_reply = None if target is None else (*target, ridx)
        post(f"{mesh_id}/{rank}", ("m", method, body, bufs, item_reply, (labels, sizes, local)))


def _reply_target(rt: ActorRuntime, reply: tuple | None, n: int) -> tuple[str, int] | None:
    """Where the actors of one "mc" message answer: a local `Batch` (gathered replies) or the given port."""
    if reply is None:
        return None
    if reply[2] == "b" and n > 1:
        return (rt.proc_id, Batch(rt, (reply[0], reply[1]), n).port_id)
    return (reply[0], reply[1])


def relay_cast(rt: ActorRuntime, msg: tuple, body: Any, buffers: list) -> None:
    """On an agent: forward a "cast" to each of its target processes, gathering their replies if asked."""
    origin, mesh_id, method, reply, labels, sizes, per_proc = msg
    fwd = reply
    batch = None
    if reply is not None and reply[2] == "b":
        owed = {ridx: pid for pid, _seq, items in per_proc for _r, _l, ridx in items}
        batch = Batch(rt, (reply[0], reply[1]), len(owed), owed)
        fwd = (rt.proc_id, batch.port_id, "b")
    body = bytes(body)
    for pid, seq, items in per_proc:
        if pid in rt.supervision.dead:
            if batch is not None:
                batch.proc_exited(pid, rt.supervision.dead[pid])
            continue
        env = encode(CastItems(origin, seq, mesh_id, method, fwd, labels, sizes, items))
        rt.send_raw(pid, env, body, buffers)
    rt.stats["cast_relayed"] += 1


def send_cast(rt: ActorRuntime, mesh_id: str, method: str, rank_procs: list[str], labels: list, sizes: list,
              items: list[Item], body: Any, buffers: list, reply: tuple | None, tree: bool) -> list[str]:
    """Send one message to many ranks of a mesh (loop thread). `reply` is None (no reply) or
    `(proc, port, mode)` with mode "b" (gather replies per process and host) or "d" (each actor answers).
    Returns the agents relaying it (a caller waiting for replies is failed if one of them dies)."""
    me = rt.proc_id
    by_proc: dict[str, list[Item]] = {}
    for item in items:
        by_proc.setdefault(rank_procs[item[0]], []).append(item)
    by_agent: dict[str, list[str]] = {}
    direct: list[str] = []
    for pid in by_proc:
        agent = rt.remote_procs.get(pid) if tree else None
        if agent is None or agent == me or agent in rt.supervision.dead:
            direct.append(pid)
        else:
            by_agent.setdefault(agent, []).append(pid)
    relays: list[str] = []
    for agent, pids in by_agent.items():
        if len(pids) == 1:
            direct.append(pids[0])
            continue
        per_proc = [(pid, rt.tree.next_seq(pid), by_proc[pid]) for pid in pids]
        env = encode(Cast(me, mesh_id, method, reply, labels, sizes, per_proc))
        rt.send_raw(agent, env, body, buffers)
        relays.append(agent)
    for pid in direct:
        env = encode(CastItems(me, rt.tree.next_seq(pid), mesh_id, method, reply, labels, sizes, by_proc[pid]))
        rt.send_raw(pid, env, body, buffers)
    rt.stats["cast_sent"] += len(relays) + len(direct)
    rt.stats["casts"] += 1
    return relays
