"""`_directory.ActorDirectory` without processes, and how the message handlers use it: a message for a running
actor is posted to it, one for a gone actor is answered with why it is gone, one for an actor not spawned yet is
held until it is (or answered DEAD when it never comes)."""

from __future__ import annotations

from regent.actor._directory import ActorDirectory
from regent.actor._handlers import ProcHandlers
from regent.actor._runtime import DEAD
from tests.support.fakes import FakeLoop


class _Cell:
    def __init__(self):
        self.posted = []

    def post(self, item):
        self.posted.append(item)


def _msg(name, reply=None):
    return ("m", name, b"", [], reply, ([], [], 0))


def test_a_running_actor_is_found_until_removed():
    d = ActorDirectory()
    cell = _Cell()
    assert d.get("m/0") is None and "m/0" not in d and len(d) == 0
    assert d.add("m/0", cell) == []
    assert d.get("m/0") is cell and "m/0" in d and len(d) == 1 and d.running() == [cell]
    d.remove("m/0")
    assert d.get("m/0") is None and d.running() == []
    d.remove("m/0")  # twice (a failure, then a stop): no error


def test_running_is_a_copy():
    d = ActorDirectory()
    d.add("m/0", _Cell())
    d.add("m/1", _Cell())
    for cell in d.running():  # stopping every actor removes them while iterating
        d.remove("m/0")
        d.remove("m/1")
        assert cell is not None
    assert len(d) == 0


def test_why_a_gone_actor_is_gone_outlives_it():
    d = ActorDirectory()
    assert d.why_dead("m/0") is None
    d.add("m/0", _Cell())
    d.mark_dead("m/0", "it raised")
    d.remove("m/0")
    assert d.why_dead("m/0") == "it raised" and d.get("m/0") is None
    assert d.why_dead("m/1") is None  # per key


def test_messages_for_an_actor_not_spawned_yet_wait_for_it_in_order():
    d = ActorDirectory()
    assert d.hold("m/0", "first") is True  # the first: the caller starts the wait's timer
    assert d.hold("m/0", "second") is False
    assert d.hold("m/1", "other") is True  # per key
    assert d.add("m/0", _Cell()) == ["first", "second"]
    assert d.take_held("m/0") == []  # handed over once
    assert d.take_held("m/1") == ["other"] and d.take_held("m/1") == []
    assert d.hold("m/1", "again") is True  # a new wait after the last one ended


class _FakeRuntime:
    def __init__(self):
        self.proc_id = "p"
        self.actors = ActorDirectory()
        self.loop = FakeLoop()
        self.replies = []

    def send_reply(self, reply, status, value):
        self.replies.append((reply, status, value))


def test_handlers_post_to_running_answer_for_gone_and_hold_for_unspawned_actors():
    rt = _FakeRuntime()
    handlers = ProcHandlers(rt)
    cell = _Cell()
    rt.actors.add("m/0", cell)
    handlers.post("m/0", _msg("ping", ("caller", 1, 0)))
    assert [item[1] for item in cell.posted] == ["ping"] and rt.replies == []

    rt.actors.mark_dead("m/1", "stopped")
    handlers.post("m/1", _msg("ping", ("caller", 1, 1)))
    handlers.post("m/1", _msg("tell"))  # no reply port: nothing to answer
    assert rt.replies == [(("caller", 1, 1), DEAD, "stopped")]

    handlers.post("m/2", _msg("a", ("caller", 2, 0)))
    handlers.post("m/2", _msg("b"))
    assert len(rt.loop.timers) == 1  # one timer for the wait, not one per message
    early = _Cell()
    for item in rt.actors.add("m/2", early):  # what `spawn_cell` does when the spawn message comes
        early.post(item)
    assert [item[1] for item in early.posted] == ["a", "b"]
    _delay, expire, args = rt.loop.timers[0]
    expire(*args)  # the timer of a wait that ended: nothing left to answer
    assert rt.replies == [(("caller", 1, 1), DEAD, "stopped")]


def test_messages_for_an_actor_that_never_comes_are_answered_dead():
    rt = _FakeRuntime()
    handlers = ProcHandlers(rt)
    handlers.post("m/9", _msg("a", ("caller", 3, 0)))
    handlers.post("m/9", _msg("b"))
    handlers.post("m/9", _msg("c", ("caller", 3, 2)))
    _delay, expire, args = rt.loop.timers[0]
    expire(*args)
    assert [(r, s) for r, s, _ in rt.replies] == [(("caller", 3, 0), DEAD), (("caller", 3, 2), DEAD)]
    assert "no actor m/9" in rt.replies[0][2]
    assert rt.actors.take_held("m/9") == []
