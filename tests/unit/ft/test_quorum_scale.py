"""The Lighthouse's per-replica bookkeeping stays O(1) and consistent: the group index (`incarnations`) that
lets a new incarnation retire its group's older id without scanning the heartbeat table, through restarts,
forgetting and expiry. Pure logic: no server, no clock."""

from __future__ import annotations

import random

from regent.ft.quorum import (
    LighthouseState,
    Participant,
    QuorumOptions,
    expire_heartbeats,
    forget_replicas,
    group_name,
    note_committed,
    note_heartbeat,
    quorum_possible,
)
from regent.ft.types import QuorumMember


class NoScanDict(dict):
    """A heartbeat table that fails the test if anything iterates over it (a per-heartbeat O(table) scan)."""

    def __iter__(self):
        raise AssertionError("heartbeat table scanned")

    def items(self):
        raise AssertionError("heartbeat table scanned")

    def keys(self):
        raise AssertionError("heartbeat table scanned")

    def values(self):
        raise AssertionError("heartbeat table scanned")


def assert_index_consistent(state: LighthouseState) -> None:
    """The index names exactly the grouped ids in the table: one per group, no entry for a group with none."""
    grouped = {rid: group_name(rid) for rid in dict.keys(state.heartbeats) if group_name(rid) is not None}
    assert sorted(grouped.values()) == sorted(state.incarnations)  # one id per group in the table
    assert all(state.incarnations[name] == rid for rid, name in grouped.items())


def test_many_incarnations_of_one_group_never_scan_the_table():
    state = LighthouseState(heartbeats=NoScanDict())
    for g in range(2000):  # a big table of other groups
        assert note_heartbeat(state, f"other{g}:1", 1.0) == []
    for i in range(1, 1001):
        note_committed(state, f"a:{i}", i, 1)
        retired = note_heartbeat(state, f"a:{i}", float(i))
        assert retired == ([f"a:{i - 1}"] if i > 1 else [])
        assert note_heartbeat(state, f"a:{i}", float(i) + 0.5) == []  # the same incarnation again: nothing
    assert state.incarnations["a"] == "a:1000"
    assert "a:999" not in state.committed and state.committed["a:1000"] == (1000, 1)
    assert len(state.heartbeats) == 2001
    assert_index_consistent(state)


def test_a_zombie_incarnation_retires_the_newer_one_like_before():
    """A retired id that heartbeats again is taken as the group's incarnation (TorchFT-style ids carry no
    order), and the id it displaced is retired in turn: the table never holds two ids of one group."""
    state = LighthouseState()
    note_heartbeat(state, "a:1", 1.0)
    assert note_heartbeat(state, "a:2", 2.0) == ["a:1"]
    assert note_heartbeat(state, "a:1", 3.0) == ["a:2"]
    assert list(state.heartbeats) == ["a:1"] and state.incarnations["a"] == "a:1"
    assert_index_consistent(state)


def test_forgetting_and_expiry_keep_the_index_in_step():
    state = LighthouseState()
    for rid, at in (("a:1", 1.0), ("b:1", 1.0), ("c:1", 50.0), ("plain", 1.0)):
        note_heartbeat(state, rid, at)
    assert forget_replicas(state, ["a:1", "never:1"]) == ["a:1"]
    assert "a" not in state.incarnations  # a forgotten group leaves nothing
    assert note_heartbeat(state, "a:2", 2.0) == []  # nothing left to retire
    # b:1 is old but waiting in a Quorum call: kept; plain and a:2 are old and idle: expired
    waiting = {"b:1": Participant(joined=1.0, member=QuorumMember(replica_id="b:1"))}
    assert sorted(expire_heartbeats(state, 10.0, keep=waiting)) == ["a:2", "plain"]
    assert sorted(state.heartbeats) == ["b:1", "c:1"] and sorted(state.incarnations) == ["b", "c"]
    assert note_heartbeat(state, "a:3", 60.0) == []
    assert_index_consistent(state)


def reference_retire(heartbeats: dict[str, float], incarnations: dict[str, str], rid: str) -> list[str]:
    """The rule as first written: scan the whole table for the group's other ids."""
    name = group_name(rid)
    if name is None or incarnations.get(name) == rid:
        return []
    incarnations[name] = rid
    stale = sorted(r for r in heartbeats if r != rid and group_name(r) == name)
    for r in stale:
        del heartbeats[r]
    return stale


def test_the_index_agrees_with_a_full_scan_under_random_churn():
    rng = random.Random(7)
    state = LighthouseState()
    heartbeats: dict[str, float] = {}
    incarnations: dict[str, str] = {}
    ids = [f"g{g}:{u}" for g in range(6) for u in range(4)] + ["solo", "other"]
    now = 0.0
    for _ in range(5000):
        now += rng.random()
        op = rng.random()
        if op < 0.7:
            rid = rng.choice(ids)
            heartbeats[rid] = now
            assert note_heartbeat(state, rid, now) == reference_retire(heartbeats, incarnations, rid)
        elif op < 0.85:
            picked = rng.sample(ids, rng.randint(1, 3))
            expected = [r for r in picked if heartbeats.pop(r, None) is not None]
            assert forget_replicas(state, picked) == expected
            # the reference keeps `incarnations` for a group with no id left; that changes no answer, since a
            # group's next id finds nothing of it to retire either way
        else:
            cutoff = now - rng.uniform(0, 20)
            expected = sorted(r for r, t in heartbeats.items() if t < cutoff)
            for r in expected:
                del heartbeats[r]
            assert sorted(expire_heartbeats(state, cutoff)) == expected
        assert state.heartbeats == heartbeats
        assert_index_consistent(state)


def test_quorum_possible_is_o1_without_enough_participants():
    """With fewer participants than the previous quorum has members, no fast quorum is possible: answered
    without walking the previous quorum."""
    from datetime import datetime, timezone

    from regent.ft.types import Quorum

    class NoIter(list):
        def __iter__(self):
            raise AssertionError("previous quorum walked")

    opts = QuorumOptions(min_replicas=5000)
    state = LighthouseState()
    members = [QuorumMember(replica_id=f"r{i}") for i in range(4096)]
    state.prev_quorum = Quorum(quorum_id=1, participants=NoIter(members), created=datetime.now(timezone.utc))
    state.participants["r0"] = Participant(joined=0.0, member=members[0])
    assert not quorum_possible(state, opts)
