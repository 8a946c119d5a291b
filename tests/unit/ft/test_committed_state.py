"""Never lose committed progress: the Lighthouse's committed watermark, the early heal of a restarted replica,
the durable backstop when every holder is gone, and the sync retried with the survivors. Real processes,
real sockets, Gloo."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from regent.ft.backstop import Backstop, complete_steps
from regent.ft.lighthouse import LighthouseServer
from regent.ft.lighthouse_client import LighthouseClient
from regent.ft.manager import recovery_plan
from regent.ft.quorum import (
    LighthouseState,
    QuorumOptions,
    Watermark,
    expect_first_groups,
    holders,
    note_committed,
    note_heartbeat,
    quorum_compute,
    restart_grace,
    seed_watermark,
)
from regent.ft.types import QuorumMember

# ---- pure rules ------------------------------------------------------------------------------------------


def test_watermark_rises_and_falls_only_on_an_accepted_loss():
    s = LighthouseState()
    assert note_committed(s, "a:1", 5, 3)
    assert not note_committed(s, "b:1", 4, 3)  # less than the watermark: nothing changes
    assert (s.watermark.step, s.watermark.lineage, s.watermark.resets) == (5, 3, 0)
    # a restarted replica at step 0 does not pull the watermark down...
    assert not note_committed(s, "a:2", 0, 0)
    # ...unless it restored older state and says it accepts losing exactly the watermark it was told of
    assert not note_committed(s, "a:2", 2, 1, accepted=(4, 3))  # accepts less than was committed: no
    assert not note_committed(s, "a:2", 2, 1, accepted=(5, 2))  # another lineage's step 5: no
    assert note_committed(s, "a:2", 2, 1, accepted=(5, 3))
    assert (s.watermark.step, s.watermark.resets) == (2, 1)
    assert not note_committed(s, "a:2", 2, 1, accepted=(5, 3))  # counted once
    assert note_committed(s, "a:2", 3, 7)
    # the other replica restored the same backstop; its message comes late, after the run committed on: the
    # loss it names was counted already, so nothing falls and nothing is counted twice
    assert not note_committed(s, "b:2", 2, 1, accepted=(5, 3))
    assert (s.watermark.step, s.watermark.lineage, s.watermark.resets) == (3, 7, 1)
    # a second loss, of a later lineage, still counts
    assert note_committed(s, "c:2", 2, 1, accepted=(3, 7))
    assert (s.watermark.step, s.watermark.resets) == (2, 2)


def test_a_restarted_lighthouse_takes_commits_it_missed_but_never_a_loss_already_counted():
    s = LighthouseState()
    assert note_committed(s, "a:1", 5, 3)
    # steps 6 and 7 were committed in the reused quorum 3 while the Lighthouse was down; every holder then died
    assert seed_watermark(s, 7, 3)
    assert s.watermark == Watermark(7, 3, 0, 0)
    assert not seed_watermark(s, 6, 3) and not seed_watermark(s, 0, 0)  # never lowers; nothing committed
    # the restored replicas accept losing step 7: counted, and the lost lineage remembered
    assert note_committed(s, "a:2", 2, 1, accepted=(7, 3))
    assert s.watermark == Watermark(2, 1, 1, 3)
    # whoever watched the commits still remembers step 7: from before the reset (lineage 3), it must not raise the
    # watermark again (the restored replicas would look behind and restore a second time)
    assert not seed_watermark(s, 7, 3)
    assert s.watermark == Watermark(2, 1, 1, 3)
    # a commit after the reset is in a quorum issued after it: a later lineage, taken
    assert seed_watermark(s, 4, 5)
    assert s.watermark == Watermark(4, 5, 1, 3)
    # a second reset remembers the higher lost lineage
    assert note_committed(s, "b:3", 1, 1, accepted=(4, 5))
    assert s.watermark == Watermark(1, 1, 2, 5) and not seed_watermark(s, 4, 5)


def test_holders_are_healthy_replicas_at_the_watermark():
    s = LighthouseState()
    opts = QuorumOptions(heartbeat_timeout_ms=1000)
    for rid, step, beat in (("a:1", 5, 10.0), ("b:1", 5, 7.0), ("c:1", 4, 10.0)):
        note_committed(s, rid, step, 2)
        s.heartbeats[rid] = beat
    assert holders(10.5, s, opts) == ["a:1"]  # b has been silent for 3.5 heartbeat timeouts, c is behind
    s.heartbeats["b:1"] = 8.0  # 2.5 timeouts: too late for a quorum, but a slow holder is still a holder
    assert holders(10.5, s, opts) == ["a:1", "b:1"]


def _plan(**kw):
    args = dict(watermark=9, lineage=4, holders=[], replica_id="r1:new", own_step=0, can_fetch=True,
                give_up=False, backstop=None, backstop_root="/bs")
    args.update(kw)
    return recovery_plan(**args)


def test_recovery_plan_prefers_a_live_holder_then_own_state_then_the_backstop():
    assert _plan(own_step=9)["kind"] == "none"  # holds the watermark already
    early = _plan(holders=[("r1:old", "h:1"), ("r0:a", "h:2")])  # its own dead incarnation is no donor
    assert (early["kind"], early["donor"], early["address"]) == ("early", "r0:a", "h:2")
    # a live holder a restarted Lighthouse has no address for yet: alive, so nothing is lost; heal at the quorum
    assert _plan(holders=[("r0:a", "")])["kind"] == "none"
    assert _plan(holders=[("r0:a", "h:2")], can_fetch=False)["kind"] == "none"
    assert _plan() is None  # nobody named yet: ask again until the grace is over
    assert _plan(give_up=True)["kind"] == "fatal" and "/bs has none" in _plan(give_up=True)["reason"]
    restore = _plan(give_up=True, own_step=5, backstop=(7, "/bs/7"))
    assert (restore["kind"], restore["path"]) == ("restore", "/bs/7")
    # the survivors of a lost watermark that hold more than the backstop keep it instead of going back further
    keep = _plan(give_up=True, own_step=8, backstop=(7, "/bs/7"))
    assert keep["kind"] == "keep" and "own committed step 8" in keep["reason"]


def test_restarted_lighthouse_waits_for_the_last_quorums_groups():
    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0, heartbeat_timeout_ms=2000)
    s = LighthouseState()
    restart_grace(s, ["r0", "r1"], now=100.0, opts=opts)
    from regent.ft.quorum import Participant

    note_heartbeat(s, "r0:x", 100.1)
    s.participants["r0:x"] = Participant(100.1, QuorumMember(replica_id="r0:x"))
    members, why = quorum_compute(100.2, s, opts)
    assert members is None and "['r1']" in why  # r1 has not heartbeated since the restart: no solo quorum
    note_heartbeat(s, "r1:y", 100.3)  # back: from here on the usual rules apply (it joins the quorum)
    s.participants["r1:y"] = Participant(100.3, QuorumMember(replica_id="r1:y"))
    members, _ = quorum_compute(100.4, s, opts)
    assert [m.replica_id for m in members] == ["r0:x", "r1:y"] and s.not_before == 0.0
    # a group that never comes back is waited for one heartbeat timeout only
    s2 = LighthouseState()
    restart_grace(s2, ["r0", "r1"], now=0.0, opts=opts)
    note_heartbeat(s2, "r0:x", 0.1)
    s2.participants["r0:x"] = Participant(0.1, QuorumMember(replica_id="r0:x"))
    assert quorum_compute(1.9, s2, opts)[0] is None
    note_heartbeat(s2, "r0:x", 2.0)
    assert [m.replica_id for m in quorum_compute(2.1, s2, opts)[0]] == ["r0:x"]
    s3 = LighthouseState()
    restart_grace(s3, [], now=0.0, opts=opts)  # a first start (no quorum saved): no grace
    assert s3.not_before == 0.0


def test_a_fresh_runs_first_quorum_waits_for_every_launched_group_bounded():
    from regent.ft.quorum import Participant

    opts = QuorumOptions(min_replicas=1, join_timeout_ms=0, heartbeat_timeout_ms=2000)
    s = LighthouseState()
    expect_first_groups(s, ["replica_0", "replica_1", "replica_2"], now=0.0, within_s=30.0)
    for rid, t in (("replica_2:a", 5.0), ("replica_3:z", 5.0)):
        note_heartbeat(s, rid, t)
        s.participants[rid] = Participant(t, QuorumMember(replica_id=rid))
    members, why = quorum_compute(5.1, s, opts)
    assert members is None and "['replica_0', 'replica_1']" in why  # no quorum of the first ones up
    for rid, t in (("replica_0:b", 5.4), ("replica_1:c", 5.6)):
        note_heartbeat(s, rid, t)
        s.participants[rid] = Participant(t, QuorumMember(replica_id=rid))
    members, _ = quorum_compute(5.7, s, opts)
    assert [m.replica_id for m in members] == ["replica_0:b", "replica_1:c", "replica_2:a", "replica_3:z"]
    # a group that never starts delays the first quorum by `within_s`, no more
    s2 = LighthouseState()
    expect_first_groups(s2, ["replica_0", "replica_1"], now=0.0, within_s=30.0)
    note_heartbeat(s2, "replica_0:a", 29.0)
    s2.participants["replica_0:a"] = Participant(29.0, QuorumMember(replica_id="replica_0:a"))
    assert quorum_compute(29.5, s2, opts)[0] is None
    note_heartbeat(s2, "replica_0:a", 30.1)
    assert [m.replica_id for m in quorum_compute(30.2, s2, opts)[0]] == ["replica_0:a"]
    # a Lighthouse that knows a previous quorum is left to restart_grace
    s3 = LighthouseState()
    restart_grace(s3, ["r0"], now=0.0, opts=opts)
    expect_first_groups(s3, ["replica_0", "replica_1"], now=0.0, within_s=30.0)
    assert s3.expected_groups == frozenset({"r0"})


@contextlib.contextmanager
def serving(state: Path, **kwargs: Any) -> Iterator[tuple[LighthouseServer, LighthouseClient]]:
    """A Lighthouse over `state` (its state file) and a client of it, both closed on the way out: each test
    below starts several in a row, as restarts of one Lighthouse."""
    lh = LighthouseServer(bind="127.0.0.1:0", state_file=state, **kwargs)
    client = LighthouseClient(lh.address())
    try:
        yield lh, client
    finally:
        client.close()
        lh.shutdown()


def test_lighthouse_saves_the_last_quorums_groups_for_its_successor(tmp_path):
    state = tmp_path / "lh.state"
    with serving(state, join_timeout_ms=100) as (_, client):
        q = client.quorum("g:1", timeout=10.0, address="a:1", store_address="s:1")
        assert [m.replica_id for m in q.participants] == ["g:1"]
    assert json.loads(state.read_text())["groups"] == ["g"]
    with serving(state, heartbeat_timeout_ms=60_000) as (lh2, _):
        assert lh2._state.expected_groups == {"g"} and lh2._state.not_before > 0


def test_lighthouse_keeps_the_watermark_across_a_restart(tmp_path):
    state = tmp_path / "lh.state"
    with serving(state) as (_, client):
        client.heartbeat("g:1", committed=(7, 4, 0, 0))
        assert client.holders()[:2] == (7, 4)
        # never asked for a quorum: named (it is alive and holds the watermark) but without an address yet
        assert [(m.replica_id, m.address) for m in client.holders()[2]] == [("g:1", "")]
    assert json.loads(state.read_text())["committed"]["step"] == 7
    with serving(state) as (_, client):
        assert client.holders()[:2] == (7, 4)  # a restarted Lighthouse still knows what was committed


def test_lighthouse_started_with_what_the_controller_saw_committed(tmp_path):
    state = tmp_path / "lh.state"
    with serving(state) as (_, client):
        client.heartbeat("g:1", committed=(5, 3, 0, 0))
    # the next Lighthouse never hears of steps 6-7 from a replica (all died): the controller's record raises it,
    # and the state file keeps it for the one after
    with serving(state, seed_committed=(7, 3)) as (lh2, _):
        assert lh2.status()["committed"] == {"step": 7, "lineage": 3, "resets": 0}
        assert lh2.committed_watermark() == (7, 3)
    assert json.loads(state.read_text())["committed"] == {"step": 7, "lineage": 3, "resets": 0, "lost_lineage": 0}
    with serving(state) as (_, client):
        assert client.holders()[:2] == (7, 3)
        client.heartbeat("g:2", committed=(2, 1, 7, 3))  # restored older state and accepts losing step 7
        assert client.holders()[:2] == (2, 1)
    assert json.loads(state.read_text())["committed"] == {"step": 2, "lineage": 1, "resets": 1, "lost_lineage": 3}
    # a controller that still remembers step 7 (from before that counted loss) does not undo it
    with serving(state, seed_committed=(7, 3)) as (lh4, _):
        assert lh4.status()["committed"] == {"step": 2, "lineage": 1, "resets": 1}
    # nor with a state file of an older Regent, which does not say which lineage the reset lost: every lineage
    # up to its last quorum id counts as lost then
    saved = json.loads(state.read_text())
    del saved["committed"]["lost_lineage"]
    saved["quorum_id"] = 5
    state.write_text(json.dumps(saved))
    for seed, step in (((7, 3), 2), ((7, 5), 2), ((7, 6), 7)):
        with serving(state, seed_committed=seed) as (lh5, _):
            assert lh5.committed_watermark()[0] == step, seed
        state.write_text(json.dumps(saved))


def test_backstop_saves_asynchronously_prunes_and_ignores_incomplete(tmp_path):
    events = []
    b = Backstop(tmp_path, rank=0, world_size=1, every_s=1e-3, keep=2, on_event=lambda k, d: events.append(k))
    t = torch.arange(4.0)
    for step in (1, 2, 3):
        time.sleep(0.002)
        assert b.maybe_save(step, lambda s=step: {"w": t, "step": s})
        b.wait_copied()  # what a caller does before it changes the tensors
        t.add_(1)  # the live state moves on; the saved copy must not
        b.wait()
    assert complete_steps(tmp_path, 1) == [2, 3]  # pruned to `keep`
    step, path = b.latest()
    assert step == 3 and torch.equal(b.load(path, 0)["w"], torch.arange(4.0) + 2)
    # a save that died before its .done is never a candidate
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "rank0.pt.tmp").write_bytes(b"partial")
    assert b.latest()[0] == 3
    # a two-rank replica: complete only when both ranks finished
    b2 = Backstop(tmp_path / "two", rank=1, world_size=2, every_s=1e-3)
    time.sleep(0.002)
    b2.maybe_save(5, lambda: {"x": 1})
    b2.wait()
    assert b2.latest() is None
    assert events.count("backstop_saved") == 3
    # the interval counts from the newest backstop on disk, not from the process start: a replica that
    # restarts more often than the interval still saves one (and a fresh one with none saves at once)
    again = Backstop(tmp_path, rank=0, world_size=1, every_s=3600)
    assert not again.due()
    assert Backstop(tmp_path / "empty", rank=0, world_size=1, every_s=3600).due()


def test_backstop_copy_runs_beside_training_until_waited_for(tmp_path):
    b = Backstop(tmp_path, rank=0, world_size=1, every_s=1e-3)
    big = torch.zeros(4_000_000)
    time.sleep(0.002)
    assert b.maybe_save(1, lambda: {"w": big})  # returns at once: nothing copied on this thread
    b.wait_copied()
    big.fill_(7.0)
    b.wait()
    assert float(b.load(b.latest()[1], 0)["w"].max()) == 0.0


def test_a_copy_past_its_bound_is_abandoned_not_waited_for_forever(tmp_path, monkeypatch):
    """A stuck host copy must not stop training: the wait is bounded, and the snapshot, which the changing
    tensors would tear, is dropped and reported instead of written."""
    import regent.ft.backstop as backstop_mod

    release = threading.Event()
    real_copy = backstop_mod.host_copy

    def stuck_copy(state):
        release.wait(10)
        return real_copy(state)

    monkeypatch.setattr(backstop_mod, "host_copy", stuck_copy)
    events = []
    b = Backstop(tmp_path, rank=0, world_size=1, every_s=1e-3, on_event=lambda k, d: events.append((k, d)))
    b.copy_timeout_s = 0.2
    time.sleep(0.002)
    assert b.maybe_save(1, lambda: {"w": torch.zeros(8)})
    waited = b.wait_copied()
    assert 0.15 <= waited < 5
    release.set()
    b.wait(10)
    assert b.latest() is None  # nothing torn on disk
    assert [k for k, _ in events] == ["backstop_failed"] and "copy_timeout_s" in events[0][1]["error"]
    monkeypatch.setattr(backstop_mod, "host_copy", real_copy)
    time.sleep(0.002)
    assert b.maybe_save(2, lambda: {"w": torch.ones(8)})  # the next save is whole again
    assert b.wait_copied() < 5
    b.wait(10)
    assert b.latest()[0] == 2


# ---- real replicas ---------------------------------------------------------------------------------------


@pytest.fixture
def lighthouse(tmp_path):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1500,
                              state_file=tmp_path / "lighthouse.state")
    yield server
    server.shutdown()


def test_per_step_update_changes_the_weights_only_after_the_backstop_copy(lighthouse, tmp_path):
    """The per-step mode's arrangement (`FaultTolerantStep.update`): the backstop copies the full state beside
    forward and backward, and the optimizer step waits for that copy before it changes the weights."""
    from regent.ft.manager import Manager
    from regent.ft.step import FaultTolerantStep

    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    b = Backstop(tmp_path / "backstop", rank=0, world_size=1, every_s=1e-3)
    manager = Manager(load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      lighthouse_addr=lighthouse.address(), replica_id="solo", timeout=5, quorum_timeout=10)
    ft = FaultTolerantStep(manager, per_step=True, backstop=b)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    time.sleep(0.002)
    b.maybe_save(1, model.state_dict)
    model(torch.ones(4, 512)).sum().backward()
    try:
        ft.update(opt.step)  # waits for the copy, then changes the weights
    finally:
        manager.shutdown()
    b.wait()
    saved = b.load(b.latest()[1], 0)
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert not torch.equal(model.weight, before["weight"])
