"""The wire messages: typed records that travel as plain marshal tuples, and refuse malformed envelopes."""

from __future__ import annotations

import marshal

import pytest

from regent.actor import _messages as m


def _sample(cls):
    return cls(*[f"v{i}" for i in range(len(cls._fields))])


@pytest.mark.parametrize("cls", sorted(m.KINDS.values(), key=lambda c: c.KIND), ids=lambda c: c.__name__)
def test_every_kind_round_trips_as_a_plain_tuple(cls):
    msg = _sample(cls)
    env = m.encode(msg)
    assert marshal.loads(env) == (cls.KIND, *msg)  # the wire format: (kind, *fields), nothing else
    back = m.decode(env)
    assert type(back) is cls and back == msg


def test_left_out_trailing_fields_take_their_defaults():
    msg = m.decode(marshal.dumps(("m", "mesh/0", "ping", None, ([], [], 0))))
    assert msg == m.Deliver("mesh/0", "ping", None, ([], [], 0)) and msg.origin is None and msg.seq is None
    assert m.decode(marshal.dumps(("host_keep_warm", 2, []))).refill_delay_s == 0.0


@pytest.mark.parametrize("raw", [
    (), ("m",), ("m", "k"), ("m", *range(7)), ("nope", 1), (3, 4), [1, 2], None, "m",
], ids=repr)
def test_malformed_envelopes_are_refused(raw):
    with pytest.raises((ValueError, TypeError)):
        m.decode(marshal.dumps(raw))


def test_only_messages_whose_sender_waits_are_answered_when_undeliverable():
    port = ("proc-1", 7, 0)
    assert m.reply_to_answer(m.Deliver("k", "f", port, ())) == port
    assert m.reply_to_answer(m.Spawn("k", "mesh", 0, "n", (), ("p", "o"), False, port)) == port
    assert m.reply_to_answer(m.Adopt({"id": "client-1"}, None, False, port)) == port
    assert m.reply_to_answer(m.StopProc("bye", None)) is None
    assert m.reply_to_answer(m.CastItems("o", 1, "mesh", "f", ("p", 3, "b"), [], [], [])) is None
    assert m.reply_to_answer(m.HostKill(["p"])) is None
