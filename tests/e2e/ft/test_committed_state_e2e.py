"""Never lose committed progress: the Lighthouse's committed watermark, the early heal of a restarted replica,
the durable backstop when every holder is gone, and the sync retried with the survivors: the cases that start
processes (the others: tests/unit/ft/test_committed_state.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from regent.ft.backstop import complete_steps
from regent.ft.lighthouse import LighthouseServer
from tests.e2e.ft.test_diloco_recovery_e2e import _committed_hashes, _spawn, _syncs, _wait_for_sync
from tests.support.ft_harness import logs, records, wait_all


@pytest.fixture
def lighthouse(tmp_path):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1500,
                              state_file=tmp_path / "lighthouse.state")
    yield server
    server.shutdown()


def _kinds(path: Path, kind: str) -> list[dict]:
    return [r for r in records(path) if r["kind"] == kind]


def _start_together(outs: list[Path], start: Path) -> None:
    """Once every worker heartbeats, let them train: the first quorum then waits for all of them."""
    deadline = time.monotonic() + 60
    while not all(out.exists() and _kinds(out, "ready") for out in outs) and time.monotonic() < deadline:
        time.sleep(0.1)
    start.touch()


# make test runs this scenario with the job secret (test_transfer_security.py::
# test_early_heal_between_processes_with_the_job_secret, as `regent train` always does); the unauthenticated
# library path runs here, under make test-long, to keep make test inside its budget.
@pytest.mark.long
def test_restarted_replica_heals_early_from_a_live_holder(lighthouse, tmp_path):
    """b starts while a is in the middle of a long local phase: b pulls a's committed state at once (not at
    a's next sync), sits out that round, and from the next sync on the two are bit-identical."""
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = ("--sync-every", "10", "--syncs", "5", "--until-participants", "2", "--early-heal")
    a = _spawn(lighthouse.address(), "a", a_out, *common, "--step-sleep", "0.4")
    _wait_for_sync(a_out, 2)
    b = _spawn(lighthouse.address(), "b", b_out, *common, "--seed", "9")
    assert wait_all([a, b], timeout=180) == [0, 0], logs(a_out) + logs(b_out)
    early = _kinds(b_out, "early_heal_done")
    assert len(early) == 1, logs(b_out)
    assert _kinds(b_out, "recovered")[0]["how"] == "early"
    assert not _kinds(b_out, "heal_done")  # nothing left to heal at the sync
    # b held the committed state before a's next sync committed
    t_heal = early[0]["manager_step"]
    assert t_heal >= 2
    ha, hb = _committed_hashes(a_out), _committed_hashes(b_out)
    assert hb and all(ha[s] == hb[s] for s in hb), (ha, hb)
    # the round b sat out did not shrink a's update: a's sync with b matches a solo-style average
    joined = [r for r in _syncs(b_out) if r["committed"]][0]
    assert joined["participants"] == 2


def test_failed_sync_is_retried_with_the_survivors(tmp_path):
    """c dies inside the sync at step 2: a and b re-form the quorum and commit that sync without c, instead
    of rolling back to the last global parameters and losing the round."""
    # the first quorum waits for all three (the join timeout only waits for groups that already heartbeat: on a
    # loaded box c's first heartbeat came after a and b had formed quorum 1, so c never died in "its" sync)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=1500,
                          expect_groups=["a", "b", "c"])
    outs = [tmp_path / f"{n}.jsonl" for n in "abc"]
    start = tmp_path / "start"
    common = ("--sync-every", "4", "--syncs", "5", "--sync-retries", "2", "--start-file", str(start))
    try:
        procs = [_spawn(lh.address(), "a", outs[0], *common),
                 _spawn(lh.address(), "b", outs[1], *common, "--seed", "3"),
                 _spawn(lh.address(), "c", outs[2], *common, "--seed", "5", "--die-in-allreduce-at", "2")]
        _start_together(outs, start)
        codes = wait_all(procs, timeout=180)
    finally:
        lh.shutdown()
    assert codes[:2] == [0, 0] and codes[2] == 1, "".join(logs(o) for o in outs)
    assert _kinds(outs[2], "dying")
    for out in outs[:2]:
        syncs = _syncs(out)
        assert all(r["committed"] for r in syncs), syncs  # no sync was given up and rolled back
        at2 = next(r for r in syncs if r["step"] == 3)  # the sync of step 2 committed (manager step -> 3)
        assert at2["retried"] >= 1 and at2["participants"] == 2
    ha, hb = _committed_hashes(outs[0]), _committed_hashes(outs[1])
    common = set(ha) & set(hb)  # on a loaded machine one may have joined a sync late (and healed)
    assert {3, 4, 5} <= common and all(ha[s] == hb[s] for s in common)


def test_all_replicas_down_restores_the_backstop_and_counts_it(lighthouse, tmp_path):
    backstop = tmp_path / "backstop"
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    start = tmp_path / "start"
    common = ("--sync-every", "3", "--syncs", "100", "--backstop", str(backstop), "--early-heal",
              "--backstop-every", "4", "--step-sleep", "0.02", "--start-file", str(start))
    procs = [_spawn(lighthouse.address(), "a", a_out, *common),
             _spawn(lighthouse.address(), "b", b_out, *common, "--seed", "2")]
    _start_together([a_out, b_out], start)
    _wait_for_sync(a_out, 5)
    _wait_for_sync(b_out, 5)
    for p in procs:  # every holder of the committed state is gone at once
        p.kill()
    wait_all(procs, timeout=30)
    lost = max(max(_committed_hashes(a_out)), max(_committed_hashes(b_out)))
    saved = complete_steps(backstop, 1)[-1]
    known = lighthouse.status()["committed"]["step"]  # what the Lighthouse was told was committed
    # a commit reaches the Lighthouse before any rank applies it: the watermark never lags what was held (it may
    # name one more step, voted but not yet written to the log when the kill came)
    assert lost <= known <= lost + 1
    a2_out, b2_out = tmp_path / "a2.jsonl", tmp_path / "b2.jsonl"
    again = ("--sync-every", "3", "--syncs", str(lost + 2), "--backstop", str(backstop), "--early-heal")
    procs = [_spawn(lighthouse.address(), "a", a2_out, *again),
             _spawn(lighthouse.address(), "b", b2_out, *again, "--seed", "2")]
    assert wait_all(procs, timeout=120) == [0, 0], logs(a2_out) + logs(b2_out)
    events = _kinds(a2_out, "state_lost") + _kinds(b2_out, "state_lost")
    assert events, logs(a2_out)
    for e in events:  # what was lost and what it came back from, never silently
        assert e["lost_step"] >= lost and e["restored_step"] == saved and not e["fatal"]
        assert e["restored_step"] <= e["lost_step"]
    # the Lighthouse counted the reset (when something was lost; with nothing lost there is nothing to lower)
    assert lighthouse.status()["committed"]["resets"] == int(saved < known)
    assert all(e["lost_step"] == known for e in events)
    # and the run went on from the backstop, not from step 0
    first = min(_committed_hashes(a2_out))
    assert first == saved + 1
    assert _committed_hashes(a2_out) == _committed_hashes(b2_out)


def test_all_replicas_down_without_backstop_stops_with_a_clear_error(lighthouse, tmp_path):
    a_out = tmp_path / "a.jsonl"
    a = _spawn(lighthouse.address(), "a", a_out, "--sync-every", "3", "--syncs", "100")
    _wait_for_sync(a_out, 3)
    a.kill()
    wait_all([a], timeout=30)
    a2_out = tmp_path / "a2.jsonl"
    a2 = _spawn(lighthouse.address(), "a", a2_out, "--sync-every", "3", "--syncs", "100")
    assert wait_all([a2], timeout=60) == [3], logs(a2_out)
    fatal = _kinds(a2_out, "fatal")[0]["error"]
    assert "no live replica holds committed step" in fatal and "backstop" in fatal
    lost = _kinds(a2_out, "state_lost")
    assert lost and lost[0]["fatal"] and lost[0]["restored_step"] is None


def test_all_replicas_down_with_lost_state_accept_goes_on_and_counts_the_reset(lighthouse, tmp_path):
    """TorchFT's behaviour, the library default: with every holder gone and no backstop, go on from what is
    held, but never silently: a `state_lost` event and a reset counted by the Lighthouse."""
    a_out = tmp_path / "a.jsonl"
    a = _spawn(lighthouse.address(), "a", a_out, "--sync-every", "3", "--syncs", "100")
    _wait_for_sync(a_out, 3)
    a.kill()
    wait_all([a], timeout=30)
    known = lighthouse.status()["committed"]["step"]
    a2_out = tmp_path / "a2.jsonl"
    a2 = _spawn(lighthouse.address(), "a", a2_out, "--sync-every", "3", "--syncs", "4", "--lost-state", "accept")
    assert wait_all([a2], timeout=60) == [0], logs(a2_out)
    lost = _kinds(a2_out, "state_lost")
    assert len(lost) == 1 and not lost[0]["fatal"] and lost[0]["cause"] == "no_holder"
    assert lost[0]["lost_step"] == known and lost[0]["restored_step"] == 0
    status = lighthouse.status()["committed"]
    assert status["resets"] == 1 and status["step"] == 4
