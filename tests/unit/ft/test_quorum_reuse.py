"""Training on through a Lighthouse outage (regent.ft.quorum_reuse): the rule, the members' agreement over a real
TCPStore, and three Managers (threads of this process, real Gloo) that commit steps while their Lighthouse is
down, and wait for it when one of them is missing."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch
import torch.distributed as dist

from regent.ft.compact import CompactQuorum, compact_share
from regent.ft.lighthouse import LighthouseServer
from regent.ft.manager import Manager
from regent.ft.quorum_reuse import agree_to_reuse, agree_to_reuse_counted, reissue
from regent.ft.recovery import ACCEPTED_LOSS_KEY, LINEAGE_KEY, QuorumPlan
from regent.ft.types import Quorum, QuorumMember


def _quorum(steps: list[int], lineages: list[int] | None = None, qid: int = 4) -> Quorum:
    lineages = lineages or [qid] * len(steps)
    return Quorum(qid, [QuorumMember(f"r{i}:x", f"a{i}", f"s{i}", step, 1, data={LINEAGE_KEY: lin})
                        for i, (step, lin) in enumerate(zip(steps, lineages))], datetime.now(timezone.utc))


# -- the rule ---------------------------------------------------------------------------------------------------

def test_reissue_moves_every_member_one_step_on_in_the_same_quorum():
    last = _quorum([7, 7, 7], [3, 3, 3])
    again = reissue(last, step=8, lineage=4)
    assert again is not None and again.quorum_id == 4
    assert [(m.replica_id, m.step, m.data[LINEAGE_KEY], m.address) for m in again.participants] == [
        ("r0:x", 8, 4, "a0"), ("r1:x", 8, 4, "a1"), ("r2:x", 8, 4, "a2")]
    # reused twice in a row: the reissued quorum is the next one's `last`
    assert reissue(again, step=9, lineage=4) is not None
    # members that healed in the last quorum committed its highest step too: the same state as the others now
    for healed in (_quorum([7, 6, 7], [3, 3, 3]), _quorum([7, 7, 7], [3, 2, 3])):
        again = reissue(healed, step=8, lineage=4)
        assert again is not None and {(m.step, m.data[LINEAGE_KEY]) for m in again.participants} == {(8, 4)}


@pytest.mark.parametrize("why, last, kwargs", [
    ("no last quorum", None, {}),
    ("behind the healers' step", _quorum([7, 6, 7]), {"step": 7}),
    ("the init sync at step 0", _quorum([0, 0, 0]), {"step": 1}),
    ("no commit since", _quorum([7, 7, 7]), {"step": 7}),
    ("two commits since", _quorum([7, 7, 7]), {"step": 9}),
    ("committed in another quorum", _quorum([7, 7, 7]), {"lineage": 3}),
    ("a failed commit", _quorum([7, 7, 7]), {"commit_failures": 1}),
    ("shrink only", _quorum([7, 7, 7]), {"shrink_only": True}),
])
def test_reissue_refuses_whatever_the_lighthouse_might_answer_otherwise(why, last, kwargs):
    args = {"step": 8, "lineage": 4, **kwargs}
    assert reissue(last, **args) is None, why


def test_reissue_drops_an_accepted_loss():
    last = _quorum([7, 7])
    last.participants[0].data[ACCEPTED_LOSS_KEY] = [9, 2]
    again = reissue(last, 8, 4)
    assert again is not None and ACCEPTED_LOSS_KEY not in again.participants[0].data


def _compact(steps: list[int], me: int = 1, qid: int = 4, ranks: int = 2) -> Quorum:
    """Member `me`'s compact share of the quorum `_quorum(steps)` (as the Lighthouse would answer it)."""
    full = _quorum(steps, qid=qid)
    plan = QuorumPlan(qid, full.participants)
    rid = full.participants[me].replica_id
    share = CompactQuorum(rid, qid, 0, False, compact_share(plan, rid, ranks, False))
    return Quorum(qid, [], full.created, compact=share)


def test_reissue_of_a_compact_answer_is_the_full_ones_share():
    again = reissue(_compact([7, 7, 7]), step=8, lineage=4)
    assert again is not None and again.quorum_id == 4 and again.participants == []
    # exactly the share the Lighthouse would give for the reissued full quorum
    expected = _compact([8, 8, 8]).compact.msg
    expected.max_lineage = 4
    assert again.compact.msg == expected
    result = again.compact.result("r1:x", 1, False)
    assert (result.replica_rank, result.replica_world_size, result.max_step, result.heal) == (1, 3, 8, False)
    assert (result.max_replica_rank, result.max_world_size, result.store_address) == (1, 3, "s1")
    assert reissue(again, step=9, lineage=4) is not None  # twice in a row
    # refused as the full answer is, and when someone healed in it (the share then names the store primaries of
    # the up-to-date members only)
    for why, last, args in (("behind", _compact([7, 7, 7]), (7, 4)), ("another quorum", _compact([7, 7, 7]), (8, 3)),
                            ("step 0", _compact([0, 0, 0]), (1, 4)), ("healed in it", _compact([7, 6, 7]), (8, 4)),
                            ("healed in it, as the healer", _compact([7, 6, 7], me=1), (8, 4))):
        assert reissue(last, *args) is None, why
    assert reissue(_compact([7, 7, 7]), 8, 4, commit_failures=1) is None


# -- the agreement, over a real TCPStore -------------------------------------------------------------------------

def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


def _client(master: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


def _vote_all(master, names, members, deadline_s=10.0, back=lambda: False) -> dict[str, bool]:
    out: dict[str, bool] = {}

    def vote(name: str) -> None:
        out[name] = agree_to_reuse(_client(master), 4, 8, name, members, time.monotonic() + deadline_s, back)

    threads = [threading.Thread(target=vote, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_member_votes_and_all_reuse():
    master = _store()
    assert _vote_all(master, ["a", "b", "c"], ["a", "b", "c"]) == {"a": True, "b": True, "c": True}


def test_a_member_that_never_votes_makes_it_ask_the_lighthouse_for_everyone():
    master = _store()
    start = time.monotonic()
    assert _vote_all(master, ["a", "b"], ["a", "b", "c"], deadline_s=1.0) == {"a": False, "b": False}
    assert time.monotonic() - start < 5
    # the late voter follows the decision already taken, although every vote is in now
    assert agree_to_reuse(_client(master), 4, 8, "c", ["a", "b", "c"], time.monotonic() + 5, lambda: False) is False


def test_a_compact_quorums_members_count_their_votes():
    master = _store()
    out: dict[int, bool] = {}

    def vote(i: int, members: int, deadline_s: float) -> None:
        out[i] = agree_to_reuse_counted(_client(master), 4, 8, members, time.monotonic() + deadline_s, lambda: False)

    threads = [threading.Thread(target=vote, args=(i, 3, 10.0)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: True, 1: True, 2: True}
    # another step: one of three never votes, so nobody reuses
    out.clear()
    start = time.monotonic()
    assert agree_to_reuse_counted(_client(master), 4, 9, 3, time.monotonic() + 1.0, lambda: False) is False
    assert agree_to_reuse_counted(_client(master), 4, 9, 3, time.monotonic() + 1.0, lambda: False) is False
    assert time.monotonic() - start < 5


def test_the_lighthouse_answering_again_ends_the_vote():
    master = _store()
    start = time.monotonic()
    assert _vote_all(master, ["a"], ["a", "b"], deadline_s=30.0, back=lambda: True) == {"a": False}
    assert time.monotonic() - start < 5


# -- three Managers through an outage ----------------------------------------------------------------------------

def _managers(address: str, names: list[str], events: list) -> list[Manager]:
    return [Manager(min_replica_size=1, use_async_quorum=False, lighthouse_addr=address, replica_id=name,
                    timeout=20, quorum_timeout=30, connect_timeout=60, init_sync=False, quorum_reuse=True,
                    on_event=lambda kind, d, name=name: events.append((name, kind, d)))
            for name in names]


def _step(managers: list[Manager], results: dict, quorum_timeout: float | None = None) -> None:
    def one(m: Manager) -> None:
        try:
            m.start_quorum(timeout=quorum_timeout)
            total = m.allreduce(torch.ones(3)).wait()
            results[m.replica_id.split(":")[0]] = (m.should_commit(), total.tolist(), m.quorum_id())
        except Exception as err:  # noqa: BLE001 - the test reads it
            results[m.replica_id.split(":")[0]] = err

    threads = [threading.Thread(target=one, args=(m,)) for m in managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("answer", ["full", "compact"])
def test_three_replicas_commit_while_their_lighthouse_is_down_and_wait_when_one_is_missing(answer, monkeypatch):
    # compact: the answer of quorums of more than 64 groups (regent.ft.compact), asked for at any size here
    monkeypatch.setenv("REGENT_COMPACT_QUORUM", "1" if answer == "compact" else "0")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=10_000)
    port = lighthouse.port
    events: list = []
    managers = _managers(lighthouse.address(), ["a", "b", "c"], events)
    try:
        for _ in range(2):  # two steps with the Lighthouse: the second's quorum is reusable (step > 0)
            results: dict = {}
            _step(managers, results)
            assert all(r[0] is True for r in results.values()), results
        qid = managers[0].quorum_id()
        lighthouse.shutdown()
        for step in (2, 3):  # the Lighthouse is down: the same quorum, twice, and the collectives still work
            results = {}
            start = time.monotonic()
            _step(managers, results)
            assert results == {n: (True, [1.0, 1.0, 1.0], qid) for n in "abc"}, results
            assert time.monotonic() - start < 5
            reused = [(n, d["step"]) for n, k, d in events if k == "quorum_reused" and d["step"] == step]
            assert sorted(reused) == [("a", step), ("b", step), ("c", step)]
        # one member missing: nobody reuses (the others would wait for it in the collective); both wait for the
        # Lighthouse and give up after their quorum timeout (3 s)
        results = {}
        _step(managers[:2], results, quorum_timeout=3.0)
        assert all(isinstance(results[n], Exception) and "Lighthouse" in str(results[n]) for n in "ab"), results
        assert not [e for e in events if e[1] == "quorum_reused" and e[2]["step"] == 4]
        # the Lighthouse back on its address: the next quorum is its again
        lighthouse = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=3, join_timeout_ms=10_000)
        deadline = time.monotonic() + 10  # each group's heartbeats find it (until then a group would vote again)
        while any(m._server.lighthouse_client.unavailable_since is not None for m in managers):
            assert time.monotonic() < deadline, "the heartbeats did not find the new Lighthouse"
            time.sleep(0.05)
        results = {}
        _step(managers, results)
        assert all(r[0] is True for r in results.values()), results
        assert len([e for e in events if e[1] == "quorum_reused"]) == 6
    finally:
        for m in managers:
            m.shutdown()
        lighthouse.shutdown()
