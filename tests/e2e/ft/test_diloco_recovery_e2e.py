"""DiLoCo / Streaming DiLoCo with real replicas: late joiners get the global params and outer momentum; a
failed sync rolls back and retries the same fragment: the cases that start processes (the others:
tests/unit/ft/test_diloco_recovery.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regent.ft.lighthouse import LighthouseServer
from regent.ft.local_sgd import ARRIVE_EARLY_STEPS
from tests.support.ft_harness import logs, records, wait_all
from tests.unit.ft.test_diloco_recovery import lighthouse  # noqa: F401 - the fixture

WORKER = Path(__file__).resolve().parents[2] / "support" / "diloco_worker.py"


def _spawn(lighthouse: str, name: str, out: Path, *extra: str) -> subprocess.Popen:  # noqa: F811 - an address here, not the fixture
    with open(out.with_suffix(".0.log"), "a") as log:
        return subprocess.Popen(
            [sys.executable, str(WORKER), "--lighthouse", lighthouse, "--name", name, "--out", str(out), *extra],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT,
        )


def _syncs(path: Path) -> list[dict]:
    return [r for r in records(path) if r["kind"] == "sync"]


def _committed_hashes(path: Path) -> dict[int, str]:
    return {r["step"]: r["hash"] for r in _syncs(path) if r["committed"]}


def _wait_for_sync(path: Path, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s >= step for s in _committed_hashes(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never committed sync {step}")


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("--fragments", "1", "--sync-every", "3"), id="diloco"),
        pytest.param(("--fragments", "2", "--sync-every", "4", "--delay", "1", "--alpha", "0.5"), id="streaming"),
    ],
)
def test_late_joiner_gets_global_params_and_outer_momentum(lighthouse, tmp_path, extra):  # noqa: F811 - the fixture, imported
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = (*extra, "--syncs", "4", "--until-participants", "2")
    a = _spawn(lighthouse.address(), "a", a_out, *common)
    _wait_for_sync(a_out, 3)  # a has outer momentum by now
    b = _spawn(lighthouse.address(), "b", b_out, *common, "--seed", "9")
    assert wait_all([a, b], timeout=150) == [0, 0], logs(a_out) + logs(b_out)
    heal = [r for r in records(b_out) if r["kind"] == "heal_done"]
    assert len(heal) == 1 and heal[0]["step"] >= 3
    ha, hb = _committed_hashes(a_out), _committed_hashes(b_out)
    assert hb and min(hb) == heal[0]["step"] + 1
    # The first sync after the heal already matches: b had a's global params AND outer momentum.
    assert all(ha[s] == hb[s] for s in hb), (ha, hb)
    if "--fragments" in extra and extra[1] == "2":
        fragments = [r["fragment"] for r in _syncs(a_out) if r["committed"]]
        assert set(fragments) == {0, 1} and fragments[:4] == [0, 1, 0, 1]


def test_failed_sync_rolls_back_and_retries_same_fragment(lighthouse, tmp_path):  # noqa: F811 - the fixture, imported
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = ("--fragments", "2", "--sync-every", "4", "--syncs", "6")
    lh2 = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    try:
        procs = [_spawn(lh2.address(), "a", a_out, *common, "--abort-at", "3"),
                 _spawn(lh2.address(), "b", b_out, *common, "--seed", "4")]
        assert wait_all(procs, timeout=150) == [0, 0], logs(a_out) + logs(b_out)
    finally:
        lh2.shutdown()
    for path in (a_out, b_out):
        syncs = _syncs(path)
        failed = [i for i, r in enumerate(syncs) if not r["committed"]]
        assert failed, syncs
        first = failed[0]
        assert syncs[first]["rolled_back"]
        assert syncs[first]["fragment"] == 1  # step 3 -> fragment 3 % 2
        nxt = syncs[first + 1]
        assert nxt["committed"] and nxt["fragment"] == syncs[first]["fragment"]
    assert _committed_hashes(a_out) == _committed_hashes(b_out)


def test_a_healed_replica_joins_the_round_in_progress(lighthouse, tmp_path):  # noqa: F811 - the fixture, imported
    """Issue 36 item 5: b starts while a is inside a round. b pulls the committed state from a (early heal),
    estimates from a's round clock how many inner steps a has taken, takes the rest of the round, and syncs
    with a at the round's end: its pseudo-gradient weighted by the share of the round it covered, a's by 1.
    Both end with the same global state; sitting out, b would have added nothing to that round."""
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    # rounds of 30 inner steps (~5 s): b's start-up (a few seconds) ends inside one, not in its last two steps,
    # where b would rightly sit the round out (rounds of 10 steps made that a coin toss on an idle box)
    common = ("--sync-every", "30", "--early-heal", "--step-sleep", "0.15", "--syncs", "3", "--until-participants", "2")
    a = _spawn(lighthouse.address(), "a", a_out, *common)
    _wait_for_sync(a_out, 2)
    b = _spawn(lighthouse.address(), "b", b_out, *common, "--join", "--seed", "9")
    assert wait_all([a, b], timeout=150) == [0, 0], logs(a_out) + logs(b_out)
    (recovered,) = [r for r in records(b_out) if r["kind"] == "recovered"]
    assert recovered["how"] == "early"
    (joined,) = [r for r in records(b_out) if r["kind"] == "joined"]
    pos = joined["mid_round"]["round_position"]
    assert 1 + ARRIVE_EARLY_STEPS <= pos <= 28 and joined["local_step"] == pos, joined
    first = _syncs(b_out)[0]
    assert first["committed"] and first["participants"] == 2, first
    assert first["weight"] == (30 - pos) / 30  # the inner steps it took, of a round of 30
    a_same = [s for s in _syncs(a_out) if s["step"] == first["step"]]
    assert a_same and a_same[0]["weight"] == 1.0 and a_same[0]["hash"] == first["hash"]
    # from the next round on it is a full member, in phase with a
    assert all(s["weight"] == 1.0 for s in _syncs(b_out)[1:])
    ha, hb = _committed_hashes(a_out), _committed_hashes(b_out)
    assert all(ha[s] == hb[s] for s in hb), (ha, hb)
