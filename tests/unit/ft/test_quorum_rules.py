"""The quorum decision as pure functions: every scenario of TorchFT's lighthouse.rs unit tests, plus each rule
on its own."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from regent.ft.quorum import (
    LighthouseState,
    Participant,
    QuorumOptions,
    forget_replicas,
    group_name,
    holders_on_their_way,
    issue_quorum,
    next_quorum_id,
    note_committed,
    note_incarnation,
    quorum_changed,
    quorum_compute,
    quorum_possible,
    restore_last_quorum,
)
from regent.ft.types import Quorum, QuorumMember

NOW = 1_000_000.0  # an arbitrary monotonic time, seconds
HOUR_MS = 60 * 60 * 1000


def member(rid: str, step: int = 1, shrink_only: bool = False, commit_failures: int = 0, address: str = ""):
    return QuorumMember(
        replica_id=rid,
        address=address,
        step=step,
        world_size=1,
        shrink_only=shrink_only,
        commit_failures=commit_failures,
    )


def join(state: LighthouseState, m: QuorumMember, at: float = NOW) -> None:
    """What a Quorum request does to the state: an implicit heartbeat plus a participant entry."""
    state.participants[m.replica_id] = Participant(joined=at, member=m)
    state.heartbeats[m.replica_id] = at


def prev(*members: QuorumMember, quorum_id: int = 1) -> Quorum:
    return Quorum(quorum_id=quorum_id, participants=list(members), created=datetime.now(timezone.utc))


def decide(state: LighthouseState, opts: QuorumOptions, now: float = NOW) -> Quorum | None:
    """One server tick: compute and, if met, issue."""
    members, _ = quorum_compute(now, state, opts)
    if members is None:
        return None
    return issue_quorum(state, members, datetime.now(timezone.utc))


def test_join_timeout_waits_only_for_heartbeating_stragglers():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000)
    state = LighthouseState()
    members, reason = quorum_compute(NOW, state, opts)
    assert members is None
    assert "New quorum not ready, only have 0 participants, need min_replicas 1 [0/0 participants healthy]" in reason

    join(state, member("a"))
    join(state, member("b"))
    members, reason = quorum_compute(NOW, state, opts)
    assert members is not None, reason

    # "c" heartbeats but has not asked to join: wait for it, up to the join timeout.
    state.heartbeats["c"] = NOW
    members, reason = quorum_compute(NOW, state, opts)
    assert members is None
    assert "join timeout" in reason
    assert "waiting for 1 healthy but not participating stragglers" in reason

    # Once the first participant has waited longer than join_timeout_ms, go without "c".
    state.participants["a"].joined = NOW - 10 * 60 * 60
    members, reason = quorum_compute(NOW, state, opts)
    assert [m.replica_id for m in members] == ["a", "b"], reason


def test_join_timeout_is_measured_from_the_first_joiner():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=1000)
    state = LighthouseState()
    join(state, member("a"), at=NOW)
    join(state, member("b"), at=NOW + 0.9)
    state.heartbeats["c"] = NOW + 0.9
    assert quorum_compute(NOW + 0.95, state, opts)[0] is None
    members, _ = quorum_compute(NOW + 1.0, state, opts)
    assert [m.replica_id for m in members] == ["a", "b"]


def test_stale_heartbeat_excludes_member():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0, heartbeat_timeout_ms=5000)
    state = LighthouseState()
    join(state, member("a"))
    members, reason = quorum_compute(NOW, state, opts)
    assert members is not None
    assert "[1/1 participants healthy][1 heartbeating]" in reason

    state.heartbeats["a"] = NOW - 10
    members, reason = quorum_compute(NOW, state, opts)
    assert members is None
    assert "[0/1 participants healthy][0 heartbeating]" in reason

    join(state, member("b"))
    members, reason = quorum_compute(NOW, state, opts)
    assert [m.replica_id for m in members] == ["b"], reason


def test_heartbeat_freshness_boundary_is_strict():
    opts = QuorumOptions(heartbeat_timeout_ms=5000, join_timeout_ms=0)
    state = LighthouseState()
    join(state, member("a"), at=NOW)
    assert quorum_compute(NOW + 4.999, state, opts)[0] is not None
    assert quorum_compute(NOW + 5.0, state, opts)[0] is None


def test_fast_quorum_when_previous_members_rejoin():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS)
    state = LighthouseState()
    assert quorum_compute(NOW, state, opts)[0] is None

    join(state, member("a"))
    state.heartbeats["b"] = NOW  # alive but not participating
    members, reason = quorum_compute(NOW, state, opts)
    assert members is None
    assert "need at least half" in reason

    # With "a" as the whole previous quorum, its return is a fast quorum: no split-brain or join wait.
    state.prev_quorum = prev(member("a"))
    members, reason = quorum_compute(NOW, state, opts)
    assert [m.replica_id for m in members] == ["a"]
    assert reason.startswith("Fast quorum found!")

    # A joiner already waiting rides along with the fast quorum.
    join(state, member("b"))
    members, reason = quorum_compute(NOW, state, opts)
    assert [m.replica_id for m in members] == ["a", "b"], reason


def test_fast_quorum_skips_min_replicas():
    opts = QuorumOptions(min_replicas=3, join_timeout_ms=HOUR_MS)
    state = LighthouseState(prev_quorum=prev(member("a"), member("b")))
    join(state, member("a"))
    assert quorum_compute(NOW, state, opts)[0] is None  # "b" missing: not fast, and 1 < 3
    join(state, member("b"))
    members, reason = quorum_compute(NOW, state, opts)
    assert [m.replica_id for m in members] == ["a", "b"]
    assert "Fast quorum" in reason


def test_fast_quorum_needs_prev_members_healthy():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000)
    state = LighthouseState(prev_quorum=prev(member("a"), member("b")))
    join(state, member("a"))
    join(state, member("b"), at=NOW - 6)  # joined, but its heartbeat went stale since
    members, reason = quorum_compute(NOW, state, opts)
    assert "Fast quorum" not in reason
    assert [m.replica_id for m in members] == ["a"]  # "b" no longer heartbeating: not waited for


def test_shrink_only_drops_new_joiners():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS)
    state = LighthouseState(prev_quorum=prev(member("a"), member("b")))
    join(state, member("a", shrink_only=True))
    join(state, member("c", shrink_only=True))
    members, reason = quorum_compute(NOW, state, opts)
    assert "[shrink_only=true]" in reason
    assert [m.replica_id for m in members] == ["a"]


def test_shrink_only_from_any_participant_applies_to_all():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS)
    state = LighthouseState(prev_quorum=prev(member("a"), member("b")))
    join(state, member("a"))
    join(state, member("b", shrink_only=True))
    join(state, member("c"))
    members, reason = quorum_compute(NOW, state, opts)
    assert "Fast quorum" in reason
    assert [m.replica_id for m in members] == ["a", "b"]


def test_shrink_only_without_prev_quorum_is_ignored():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0)
    state = LighthouseState()
    join(state, member("b", shrink_only=True))
    join(state, member("a"))
    members, _ = quorum_compute(NOW, state, opts)
    assert [m.replica_id for m in members] == ["a", "b"]


def test_split_brain_guard():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS)
    state = LighthouseState()
    join(state, member("a"))
    state.heartbeats["b"] = NOW
    state.heartbeats["c"] = NOW
    members, reason = quorum_compute(NOW, state, opts)
    assert members is None
    assert "need at least half of 3 healthy workers" in reason

    # Exactly half is still not enough: 2 of 4.
    join(state, member("b"))
    state.heartbeats["d"] = NOW
    assert "need at least half of 4" in quorum_compute(NOW, state, opts)[1]

    # More than half: passes the guard, then waits for stragglers.
    join(state, member("c"))
    members, reason = quorum_compute(NOW, state, opts)
    assert members is None and "join timeout" in reason


def test_min_replicas():
    opts = QuorumOptions(min_replicas=2, join_timeout_ms=0)
    state = LighthouseState()
    join(state, member("a"))
    members, reason = quorum_compute(NOW, state, opts)
    assert members is None
    assert "need min_replicas 2" in reason
    join(state, member("b"))
    assert quorum_compute(NOW, state, opts)[0] is not None


def test_participants_sorted_by_replica_id():
    opts = QuorumOptions(join_timeout_ms=0)
    state = LighthouseState()
    for rid in ["replica_3:x", "replica_1:y", "replica_10:z", "replica_2:w"]:
        join(state, member(rid))
    members, _ = quorum_compute(NOW, state, opts)
    assert [m.replica_id for m in members] == sorted(["replica_3:x", "replica_1:y", "replica_10:z", "replica_2:w"])


def test_quorum_changed_looks_only_at_replica_ids():
    a = [member("a", step=1, address="x"), member("b")]
    assert not quorum_changed(a, [member("a", step=7, address="y"), member("b", step=3)])
    assert quorum_changed(a, [member("a")])
    assert quorum_changed(a, [member("b"), member("a")])
    assert quorum_changed(a, [member("a"), member("c")])


def test_quorum_id_bumps_only_on_membership_change():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0)
    state = LighthouseState()
    join(state, member("a"))
    join(state, member("b"))
    q1 = decide(state, opts)
    assert q1.quorum_id == 1
    assert state.participants == {}  # cleared after each quorum

    join(state, member("a", step=5, address="new"))
    join(state, member("b", step=5))
    q2 = decide(state, opts)
    assert q2.quorum_id == 1  # steps and addresses changed; membership did not
    assert q2.participants[0].address == "new"

    join(state, member("a"))
    join(state, member("b"))
    join(state, member("c"))
    assert decide(state, opts).quorum_id == 2


def test_commit_failures_bump_quorum_id():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0)
    state = LighthouseState()
    join(state, member("a"))
    join(state, member("b"))
    assert decide(state, opts).quorum_id == 1
    join(state, member("a"))
    join(state, member("b"))
    assert decide(state, opts).quorum_id == 1
    join(state, member("a"))
    join(state, member("b", commit_failures=2))
    assert decide(state, opts).quorum_id == 2
    join(state, member("a"))
    join(state, member("b"))
    assert decide(state, opts).quorum_id == 2


def test_next_quorum_id_first_quorum():
    state = LighthouseState()
    assert next_quorum_id(state, [member("a")]) == 1
    assert next_quorum_id(state, []) == 1


def test_join_during_shrink():
    """A joiner excluded by a shrink-only quorum re-inserts itself and is included in the next one."""
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS)
    state = LighthouseState()
    join(state, member("a"))
    join(state, member("b"))
    q1 = decide(state, opts)
    assert q1.replica_ids() == ["a", "b"]

    # "a" and "b" rejoin in shrink-only mode while "c" asks to join.
    join(state, member("a", shrink_only=True))
    join(state, member("c"))
    join(state, member("b", shrink_only=True))
    q2 = decide(state, opts)
    assert q2.replica_ids() == ["a", "b"]
    assert q2.quorum_id == 1
    # The server re-inserts the excluded requester, as its Quorum call keeps waiting.
    join(state, member("c"))
    join(state, member("a"))
    join(state, member("b"))
    q3 = decide(state, opts)
    assert q3.replica_ids() == ["a", "b", "c"]
    assert q3.quorum_id == 2


def test_options_validation():
    with pytest.raises(ValueError, match="min_replicas"):
        QuorumOptions(min_replicas=0)
    with pytest.raises(ValueError, match="quorum_tick_ms"):
        QuorumOptions(quorum_tick_ms=0)
    with pytest.raises(ValueError, match="heartbeat_timeout_ms"):
        QuorumOptions(heartbeat_timeout_ms=-1)


def test_quorum_possible_never_hides_a_quorum():
    """`quorum_possible` is a pre-filter: wherever quorum_compute issues members, it must say True."""
    import random

    rng = random.Random(1234)
    ids = [f"r{i}" for i in range(6)]
    checked = 0
    for _ in range(3000):
        opts = QuorumOptions(
            min_replicas=rng.randint(1, 5), join_timeout_ms=rng.choice([0, 500, HOUR_MS]), heartbeat_timeout_ms=5000
        )
        state = LighthouseState()
        if rng.random() < 0.7:
            state.prev_quorum = prev(*(member(r) for r in rng.sample(ids, rng.randint(1, 5))))
        for rid in rng.sample(ids, rng.randint(0, 6)):
            join(state, member(rid, shrink_only=rng.random() < 0.2), at=NOW - rng.choice([0, 1, 6, 3600]))
        for rid in rng.sample(ids, rng.randint(0, 6)):
            state.heartbeats[rid] = NOW - rng.choice([0, 1, 6])
        members, reason = quorum_compute(NOW, state, opts)
        if members is not None:
            checked += 1
            assert quorum_possible(state, opts), reason
    assert checked > 100


# ---- a dead incarnation is not waited for (Regent's addition) ---------------------------------------------


def test_group_names_of_torchft_style_ids():
    assert group_name("replica_1:0083e5fd-4332") == "replica_1"
    assert group_name("host:port:uuid") == "host:port"
    assert group_name("plain") is None and group_name(":x") is None


def two_replicas_then_one_dies() -> tuple[LighthouseState, QuorumOptions]:
    """a:1 and b:1 trained together; a:1's process died just now, so its last heartbeat is still fresh."""
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000)
    state = LighthouseState()
    for rid in ("a:1", "b:1"):
        note_incarnation(state, rid)
        join(state, member(rid))
    assert decide(state, opts) is not None
    join(state, member("b:1"), at=NOW + 0.1)  # the survivor asks for the next quorum
    return state, opts


def test_a_survivor_waits_for_a_dead_peer_until_its_heartbeat_times_out():
    state, opts = two_replicas_then_one_dies()
    members, reason = quorum_compute(NOW + 0.2, state, opts)
    assert members is None and "at least half" in reason  # the ghost a:1 still counts as healthy
    members, _ = quorum_compute(NOW + 5.05, state, opts)  # ... until 5 s after its last heartbeat
    assert [m.replica_id for m in members] == ["b:1"]


def test_a_replica_reported_failed_is_not_waited_for():
    state, opts = two_replicas_then_one_dies()
    assert forget_replicas(state, ["a:1", "never-seen:1"]) == ["a:1"]
    members, _ = quorum_compute(NOW + 0.2, state, opts)
    assert [m.replica_id for m in members] == ["b:1"]
    join(state, member("a:1"), at=NOW + 0.3)  # alive after all: it counts again from its next heartbeat
    members, _ = quorum_compute(NOW + 0.3, state, opts)
    assert [m.replica_id for m in members] == ["a:1", "b:1"]


def test_a_new_incarnation_retires_its_groups_older_ids():
    state, opts = two_replicas_then_one_dies()
    assert note_incarnation(state, "a:2") == ["a:1"]
    assert note_incarnation(state, "a:2") == []  # no change, no scan
    join(state, member("a:2", step=0), at=NOW + 0.3)
    members, reason = quorum_compute(NOW + 0.3, state, opts)
    assert [m.replica_id for m in members] == ["a:2", "b:1"], reason
    assert "b:1" in state.heartbeats and note_incarnation(state, "c") == []  # other groups, plain ids: untouched


def test_a_restarted_lighthouse_gives_the_last_quorums_members_the_same_id():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=HOUR_MS)
    created = datetime.now(timezone.utc)
    state = LighthouseState(quorum_id=7)
    restore_last_quorum(state, ["b:1", "a:1"], created)
    for rid in ("a:1", "b:1"):
        join(state, member(rid))
    members, reason = quorum_compute(NOW, state, opts)
    assert reason.startswith("Fast quorum") and [m.replica_id for m in members] == ["a:1", "b:1"]
    assert issue_quorum(state, members, created).quorum_id == 7  # nobody rebuilds its process group
    # a member that restarted meanwhile (a new id), or one that failed a commit: a new id, as always
    state2 = LighthouseState(quorum_id=7)
    restore_last_quorum(state2, ["a:1", "b:1"], created)
    assert next_quorum_id(state2, [member("a:1"), member("b:2")]) == 8
    assert next_quorum_id(state2, [member("a:1"), member("b:1", commit_failures=1)]) == 8
    # nothing saved (a first start, or a state file of an older Regent): no previous quorum
    state3 = LighthouseState(quorum_id=7)
    restore_last_quorum(state3, [], created)
    assert state3.prev_quorum is None


def survivor_and_healed_replica(grace_ms: int = 2000) -> tuple[LighthouseState, QuorumOptions]:
    """"s" trained on alone (the last quorum was it alone) and committed step 5; "h" restarted and copied step 5
    from it (an early heal): it heartbeats and reports step 5, and is training its way to the next sync."""
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000,
                         holder_grace_ms=grace_ms)
    state = LighthouseState(prev_quorum=prev(member("s:1", step=5)))
    for rid in ("s:1", "h:2"):
        note_committed(state, rid, 5, 1)
        state.heartbeats[rid] = NOW - 1
    return state, opts


def test_a_fast_quorum_waits_a_moment_for_a_replica_that_just_healed():
    state, opts = survivor_and_healed_replica()
    assert holders_on_their_way(state, {"s:1", "h:2"}, {"s:1"}) == ["h:2"]
    join(state, member("s:1", step=5))
    members, reason = quorum_compute(NOW + 0.5, state, opts)
    assert members is None and "have not joined yet" in reason and "h:2" in reason
    join(state, member("h:2", step=5), at=NOW + 1.0)  # it arrives a second after the survivor
    members, reason = quorum_compute(NOW + 1.0, state, opts)
    assert [m.replica_id for m in members] == ["h:2", "s:1"] and reason.startswith("Fast quorum found")


def test_the_wait_for_a_healed_replica_is_bounded_by_the_grace():
    state, opts = survivor_and_healed_replica(grace_ms=2000)
    join(state, member("s:1", step=5))
    assert quorum_compute(NOW + 1.9, state, opts)[0] is None
    members, reason = quorum_compute(NOW + 2.0, state, opts)  # measured from the first join
    assert [m.replica_id for m in members] == ["s:1"] and reason.startswith("Fast quorum found")


def test_no_wait_for_a_replica_behind_the_watermark_or_with_the_grace_off():
    # behind: the survivor committed step 6 meanwhile; the healed replica's step 5 is healed at its quorum anyway
    state, opts = survivor_and_healed_replica()
    note_committed(state, "s:1", 6, 1)
    join(state, member("s:1", step=6))
    assert holders_on_their_way(state, {"s:1", "h:2"}, {"s:1"}) == []
    assert [m.replica_id for m in quorum_compute(NOW, state, opts)[0]] == ["s:1"]
    # off: TorchFT's rule exactly
    state, opts = survivor_and_healed_replica(grace_ms=0)
    join(state, member("s:1", step=5))
    assert [m.replica_id for m in quorum_compute(NOW, state, opts)[0]] == ["s:1"]
    # silent (its heartbeat timed out): not waited for
    state, opts = survivor_and_healed_replica()
    state.heartbeats["h:2"] = NOW - 6
    join(state, member("s:1", step=5))
    assert [m.replica_id for m in quorum_compute(NOW, state, opts)[0]] == ["s:1"]
    # shrink_only: a replica not in the last quorum could not be admitted anyway
    state, opts = survivor_and_healed_replica()
    join(state, member("s:1", step=5, shrink_only=True))
    assert [m.replica_id for m in quorum_compute(NOW, state, opts)[0]] == ["s:1"]
    # nothing committed yet: nobody holds anything worth waiting for
    state = LighthouseState(prev_quorum=prev(member("s:1")))
    state.heartbeats.update({"s:1": NOW, "h:2": NOW})
    state.committed["h:2"] = (0, 0)
    join(state, member("s:1", step=0))
    assert [m.replica_id for m in quorum_compute(NOW, state, opts)[0]] == ["s:1"]


def test_holder_grace_is_validated():
    with pytest.raises(ValueError, match="holder_grace_ms"):
        QuorumOptions(holder_grace_ms=-1)


def three_in_sync(late_ms: int = 1000) -> tuple[LighthouseState, QuorumOptions]:
    """The last quorum was a, b and c; all three heartbeat. The join timeout is an hour: without rule 4b a late
    member that still heartbeats is waited for that long."""
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000, late_member_ms=late_ms)
    state = LighthouseState(prev_quorum=prev(member("a:1"), member("b:1"), member("c:1")))
    for rid in ("a:1", "b:1", "c:1"):
        state.heartbeats[rid] = NOW
    return state, opts


def test_a_late_member_of_the_last_quorum_is_left_out_once_a_majority_waited_long_enough():
    state, opts = three_in_sync(late_ms=1000)
    join(state, member("a:1"), at=NOW)
    assert quorum_compute(NOW + 5.0, state, opts)[0] is None  # one of three is no majority: it waits
    join(state, member("b:1"), at=NOW + 0.4)  # the majority, from here
    assert quorum_compute(NOW + 1.3, state, opts)[0] is None  # c gets 1 s from the majority's join
    members, reason = quorum_compute(NOW + 1.4, state, opts)
    assert [m.replica_id for m in members] == ["a:1", "b:1"] and "late members" in reason and "c:1" in reason
    assert state.late_left_out == ["c:1"]  # what the server counts when it issues this quorum
    join(state, member("c:1"), at=NOW + 1.5)  # c came after all: the next decision leaves nobody out
    assert len(quorum_compute(NOW + 1.5, state, opts)[0]) == 3 and state.late_left_out == []
    # c arrives in time: the fast quorum, everyone in it
    state, opts = three_in_sync(late_ms=1000)
    for rid, at in (("a:1", NOW), ("b:1", NOW + 0.4), ("c:1", NOW + 1.2)):
        join(state, member(rid), at=at)
    members, reason = quorum_compute(NOW + 1.2, state, opts)
    assert len(members) == 3 and reason.startswith("Fast quorum")


def test_late_members_are_never_left_out_when_the_rule_is_off_or_the_rest_is_no_majority():
    # off (the default): TorchFT's rules, the late member is waited for until the join timeout
    state, opts = three_in_sync(late_ms=0)
    join(state, member("a:1"))
    join(state, member("b:1"))
    assert quorum_compute(NOW + 60.0, state, opts)[0] is None
    # a majority of the last quorum is needed: two of four joined is not one
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=HOUR_MS, heartbeat_timeout_ms=5000, late_member_ms=500)
    state = LighthouseState(prev_quorum=prev(*(member(f"{x}:1") for x in "abcd")))
    for x in "abcd":
        state.heartbeats[f"{x}:1"] = NOW
    join(state, member("a:1"))
    join(state, member("b:1"))
    assert quorum_compute(NOW + 60.0, state, opts)[0] is None
    join(state, member("c:1"), at=NOW + 1.0)
    assert quorum_compute(NOW + 1.4, state, opts)[0] is None
    assert [m.replica_id for m in quorum_compute(NOW + 1.5, state, opts)[0]] == ["a:1", "b:1", "c:1"]
    # a newcomer waiting beside the majority rides along; min_replicas still applies
    state, opts = three_in_sync(late_ms=500)
    join(state, member("a:1"))
    join(state, member("b:1"))
    join(state, member("n:1"))
    state.heartbeats["n:1"] = NOW
    assert [m.replica_id for m in quorum_compute(NOW + 0.5, state, opts)[0]] == ["a:1", "b:1", "n:1"]
    state, _ = three_in_sync()
    join(state, member("a:1"))
    join(state, member("b:1"))
    assert quorum_compute(NOW + 0.6, state, QuorumOptions(min_replicas=3, join_timeout_ms=HOUR_MS,
                                                          late_member_ms=500))[0] is None
    with pytest.raises(ValueError, match="late_member_ms"):
        QuorumOptions(late_member_ms=-1)
