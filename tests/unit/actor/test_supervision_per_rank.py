"""Issue 35: procs lost together are aggregated on the wire (one report per mesh), but the API delivers what
Monarch delivers: one `MeshFailure` per failed rank, to `__supervise__` and `unhandled_fault_hook`, at once
(a failure held back for a quiet spell reached `__supervise__` after the caller had moved on)."""

from __future__ import annotations

import collections
import threading
import time

import regent.actor
from regent.actor._directory import ActorDirectory
from regent.actor._supervision import ROOT_KEY, MeshState, Supervision
from tests.support.fakes import FakeLoop

# ---- without processes: Supervision on a fake runtime ----


class _Loop(FakeLoop):
    def call_soon(self, fn, *args):
        fn(*args)

    def time(self):
        return time.monotonic()


class _Cell:
    """An owner actor: records what it is asked to supervise."""

    alive = True
    owner = ("client", ROOT_KEY)  # spawned by a client (not stopped when a proc is lost)

    def __init__(self):
        self.seen = []

    def supervise(self, failure):
        self.seen.append(failure)


class _FakeRuntime:
    """What `Supervision` uses of a runtime, recorded."""

    def __init__(self):
        self.loop = _Loop()
        self.stats = collections.Counter()
        self.actors = ActorDirectory()
        self.ports = {}
        self.owned_proc_meshes = {}
        self.controllers = {}
        self.is_controller = True
        self.exit_code = None
        self.exits = []
        self.supervision = Supervision(self, regent.actor._call_unhandled_fault_hook)  # as the client is built

    def forget_proc(self, proc_id):
        pass

    def drop_port(self, port_id):
        self.ports.pop(port_id, None)

    def exit_main_thread(self, code):
        self.exit_code = code
        self.exits.append(code)


def _mesh(rt, owner, procs=("p0", "p0", "p1", "p1")):
    return rt.supervision.register_mesh(MeshState("m1", "kids", "actor", list(procs), owner))


def test_procs_lost_together_are_one_report_but_one_failure_per_rank():
    rt = _FakeRuntime()
    owner = _Cell()
    rt.actors.add("owner", owner)
    _mesh(rt, "owner")
    rt.supervision.procs_gone([("p0", "Killed(sig=9)"), ("p1", "Killed(sig=9)")])
    assert [f.crashed_ranks for f in owner.seen] == [[0], [1], [2], [3]]
    assert all(f.mesh_name == "kids" and "Killed(sig=9)" in f.report() for f in owner.seen)
    assert rt.stats["supervision_reports"] == 1  # aggregated as a report, not at the API


def test_a_rank_failure_reaches_its_owner_at_once():
    rt = _FakeRuntime()
    owner = _Cell()
    rt.actors.add("owner", owner)
    _mesh(rt, "owner")
    rt.supervision.rank_failed("m1", 2, "Supervision event: actor kids[2] failed: boom")
    assert [f.crashed_ranks for f in owner.seen] == [[2]]  # no quiet spell to wait out
    assert rt.loop.timers == []
    rt.supervision.rank_failed("m1", 2, "again")  # a rank is reported once
    assert len(owner.seen) == 1


def _hook_calls(monkeypatch, hook_raises: bool) -> list:
    calls = []

    def hook(failure):
        calls.append((threading.current_thread().name, failure.crashed_ranks))
        if hook_raises:
            raise SystemExit(1)

    monkeypatch.setattr(regent.actor, "unhandled_fault_hook", hook)
    return calls


def _wait(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_client_hook_runs_once_per_rank_on_one_thread(monkeypatch):
    rt = _FakeRuntime()
    calls = _hook_calls(monkeypatch, hook_raises=False)
    _mesh(rt, ROOT_KEY)
    rt.supervision.procs_gone([("p0", "Killed(sig=9)"), ("p1", "Killed(sig=9)")])
    assert _wait(lambda: len(calls) == 4)
    assert [r for _, r in calls] == [[0], [1], [2], [3]]
    assert len({name for name, _ in calls}) == 1  # one thread for the loss, not one per rank


def test_a_raising_hook_makes_the_client_exit_once(monkeypatch):
    rt = _FakeRuntime()
    calls = _hook_calls(monkeypatch, hook_raises=True)
    _mesh(rt, ROOT_KEY)
    rt.supervision.rank_failed("m1", 0, "boom 0")
    assert _wait(lambda: rt.exits)
    rt.supervision.rank_failed("m1", 1, "boom 1")  # the default hook raises for every rank
    assert _wait(lambda: len(calls) == 2)
    time.sleep(0.2)
    assert rt.exits == [1]  # a second interrupt would cut the first exit's cleanup short


# ---- with processes: what a Monarch program observes ----


def test_supervision_items_jump_the_queue_in_their_own_order():
    """A sync owner's failures (one per rank) come before its queued messages, rank by rank (putting each at
    the front reversed them: the ranks of a lost host reached `__supervise__` last rank first)."""
    from regent.actor._cell import Mailbox

    box = Mailbox(is_async=False)
    box.put(("m", "queued"))
    for rank in range(3):
        box.put(("sup", rank), front=True)
    assert [box.get_sync() for _ in range(4)] == [("sup", 0), ("sup", 1), ("sup", 2), ("m", "queued")]
