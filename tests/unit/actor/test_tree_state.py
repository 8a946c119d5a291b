"""`_tree.TreeState` without processes: sequence numbers out, per-sender order in (early messages held, then
released in order; a lost one skipped after the gap timeout), and reply batches answered for a process that
exits."""

from __future__ import annotations

from regent.actor._messages import ReplyBatch, ReplyMsg, decode
from regent.actor._pickle import loads
from regent.actor._runtime import DEAD, OK
from regent.actor._tree import GAP_TIMEOUT_S, Batch, TreeState
from tests.support.fakes import FakeLoop


class _FakeRuntime:
    """What `TreeState` and `Batch` use of a runtime: the loop's timers, reply ports and sends, recorded."""

    def __init__(self):
        self.loop = FakeLoop()
        self.proc_id = "agent"
        self.tree = TreeState(self)
        self.ports = {}
        self.sent = []  # (proc id, decoded message, body)
        self._next_port = 0

    def new_port(self, handler):
        self._next_port += 1
        self.ports[self._next_port] = handler
        return self._next_port

    def drop_port(self, port_id):
        self.ports.pop(port_id, None)

    def run_on_loop(self, fn, *args):
        fn(*args)

    def send_raw(self, proc_id, env, body, buffers):
        self.sent.append((proc_id, decode(env), bytes(body)))


def test_sequence_numbers_count_per_destination():
    tree = TreeState(_FakeRuntime())
    assert [tree.next_seq("p1") for _ in range(3)] == [0, 1, 2]
    assert tree.next_seq("p2") == 0  # each destination counts on its own
    assert tree.next_seq("p1") == 3


def test_early_messages_are_held_then_released_in_order():
    rt = _FakeRuntime()
    tree, got = rt.tree, []
    tree.deliver_in_order("a", 2, lambda: got.append(2))
    tree.deliver_in_order("a", 1, lambda: got.append(1))
    assert got == [] and tree.held_count("a") == 2 and tree.expected("a") == 0
    assert len(rt.loop.timers) == 1  # one gap timer for the first message held, not one per message
    tree.deliver_in_order("a", 0, lambda: got.append(0))
    assert got == [0, 1, 2] and tree.held_count() == 0 and tree.expected("a") == 3
    tree.deliver_in_order("a", 3, lambda: got.append(3))  # in order: at once
    assert got == [0, 1, 2, 3]


def test_messages_are_delivered_in_sender_order_and_a_lost_one_is_skipped():
    rt = _FakeRuntime()
    tree, got = rt.tree, []
    for seq in (1, 0, 3, 2):
        tree.deliver_in_order("a", seq, lambda s=seq: got.append(s))
    assert got == [0, 1, 2, 3] and tree.held_count() == 0
    tree.deliver_in_order("b", 0, lambda: got.append("b0"))  # other senders count on their own
    # message 4 from "a" is lost (its relaying agent died): 5 and 6 wait, then the gap is skipped
    tree.deliver_in_order("a", 6, lambda: got.append(6))
    tree.deliver_in_order("a", 5, lambda: got.append(5))
    assert got[-1] == "b0" and tree.expected("a") == 4 and tree.held_count("a") == 2
    delay, skip, args = rt.loop.timers[-1]
    assert delay == GAP_TIMEOUT_S
    skip(*args)
    assert got[-2:] == [5, 6] and tree.expected("a") == 7 and tree.held_count() == 0
    tree.deliver_in_order("a", 4, lambda: got.append(4))  # arrives after all: delivered, not dropped
    assert got[-1] == 4 and tree.expected("a") == 7


def test_a_gap_timer_that_fires_after_the_gap_was_filled_does_nothing():
    rt = _FakeRuntime()
    tree, got = rt.tree, []
    tree.deliver_in_order("a", 1, lambda: got.append(1))
    _, skip, args = rt.loop.timers[-1]
    tree.deliver_in_order("a", 0, lambda: got.append(0))
    tree.deliver_in_order("a", 3, lambda: got.append(3))  # a new gap (2 is missing)
    skip(*args)  # the first gap's timer: stale, must not skip message 2
    assert got == [0, 1] and tree.expected("a") == 2 and tree.held_count("a") == 1


def test_a_partly_filled_gap_waits_again_from_where_it_stopped():
    rt = _FakeRuntime()
    tree, got = rt.tree, []
    tree.deliver_in_order("a", 1, lambda: got.append(1))
    tree.deliver_in_order("a", 3, lambda: got.append(3))
    tree.deliver_in_order("a", 0, lambda: got.append(0))  # delivers 0 and 1; 3 still waits for 2
    assert got == [0, 1] and tree.held_count("a") == 1
    delay, skip, args = rt.loop.timers[-1]
    assert delay == GAP_TIMEOUT_S and args == ("a", 2)
    skip(*args)
    assert got == [0, 1, 3] and tree.expected("a") == 4


def test_messages_without_a_sequence_number_are_delivered_at_once():
    rt = _FakeRuntime()
    got = []
    rt.tree.deliver_in_order(None, None, lambda: got.append("old sender"))
    rt.tree.deliver_in_order("a", None, lambda: got.append("no seq"))
    assert got == ["old sender", "no seq"] and rt.tree.expected("a") == 0 and not rt.loop.timers


def test_an_exiting_process_answers_for_the_replies_it_owed_to_a_batch():
    rt = _FakeRuntime()
    # an agent relays a call to p1 (reply indices 0, 1) and p2 (index 2), gathering replies for the caller
    batch = Batch(rt, ("caller", 7), 3, {0: "p1", 1: "p1", 2: "p2"})
    batch.deliver(2, OK, b"from p2", [])
    assert rt.sent == []  # held until all three are in
    rt.tree.proc_exited("p1", "killed")
    # p1's two replies go on alone at once (DEAD), then the batch, complete, sends what it gathered
    assert [(to, msg) for to, msg, _ in rt.sent] == [
        ("caller", ReplyMsg(7, 0, DEAD)), ("caller", ReplyMsg(7, 1, DEAD)), ("caller", ReplyBatch(7, [2], [7]))]
    assert "killed" in loads(rt.sent[0][2], []) and rt.sent[2][2] == b"from p2"
    assert batch.port_id not in rt.ports  # complete: its port is gone
    rt.sent.clear()
    rt.tree.proc_exited("p1", "again")  # answered once only
    rt.tree.proc_exited("p2", "late")  # the complete batch is no longer waiting on p2
    assert rt.sent == []


def test_a_complete_batch_is_no_longer_answered_for():
    rt = _FakeRuntime()
    answered = []

    class _Watch(Batch):
        def proc_exited(self, pid, reason):
            answered.append((self, pid, reason))
            super().proc_exited(pid, reason)

    done = _Watch(rt, ("caller", 1), 1, {0: "p1"})
    waiting = _Watch(rt, ("caller", 2), 1, {0: "p1"})
    done.deliver(0, OK, b"x", [])
    rt.tree.proc_exited("p1", "gone")
    assert answered == [(waiting, "p1", "gone")]  # only the batch still waiting on p1
    assert [(to, m.port, m.status) for to, m, _ in rt.sent if type(m) is ReplyMsg] == [("caller", 2, DEAD)]
