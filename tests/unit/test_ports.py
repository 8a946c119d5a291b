"""Ports chosen for servers that other processes start later come from outside the OS's ephemeral range, where
no `bind(0)` or outgoing connection can take them in the meantime (regent.ports)."""

from __future__ import annotations

import random
import socket

from regent import ports


def test_a_chosen_port_is_free_and_outside_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert not lo <= port <= hi and port >= 10000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_a_taken_port_is_not_chosen(monkeypatch):
    held = []
    try:
        # take most of a tiny range, then ask: only the free ones come back
        rng = random.Random(7)
        for port in range(20000, 20010):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                held.append(s)
            except OSError:
                s.close()
        taken = {s.getsockname()[1] for s in held}
        monkeypatch.setattr(ports, "choice_ranges", lambda lo, hi: [(20000, 20011)])
        got = {ports.free_port(rng=rng) for _ in range(10)}
        assert not got & taken
    finally:
        for s in held:
            s.close()


def test_the_ranges_left_outside_the_ephemeral_one(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ports.ephemeral_range(str(f)) == (32768, 60999)
    assert ports.choice_ranges(32768, 60999) == [(10000, 32767), (61000, 65535)]
    assert ports.choice_ranges(1024, 65535) == []  # no room: the OS's own choice is used
    f.write_text("garbage")
    assert ports.ephemeral_range(str(f)) == (49152, 65535)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (49152, 65535)


def test_with_no_room_outside_the_range_the_os_chooses(monkeypatch):
    monkeypatch.setattr(ports, "choice_ranges", lambda lo, hi: [])
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_pair_is_free_twice_and_outside_the_ephemeral_range(monkeypatch):
    lo, hi = ports.ephemeral_range()
    for _ in range(10):
        port = ports.free_port_pair()
        assert not lo <= port <= hi and not lo <= port + 1 <= hi and port >= 10000
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 1))
    # in a range where every P+1 but one is taken, the one pair whose both ports are free comes back
    held = []
    try:
        for port in range(21001, 21011, 2):
            if port == 21007:
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                held.append(s)
            except OSError:
                s.close()
        monkeypatch.setattr(ports, "choice_ranges", lambda lo, hi: [(21000, 21009)])
        taken = {s.getsockname()[1] for s in held}
        for _ in range(5):
            got = ports.free_port_pair(rng=random.Random(3))
            assert got not in taken and got + 1 not in taken
    finally:
        for s in held:
            s.close()
