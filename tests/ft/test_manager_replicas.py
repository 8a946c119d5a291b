"""Manager end to end: real processes, real Lighthouse, Gloo on CPU."""

from __future__ import annotations

import pytest

from regent.ft.lighthouse import LighthouseServer
from tests.ft.ft_harness import hashes, logs, records, spawn, wait_all


def _lighthouse(min_replicas: int) -> LighthouseServer:
    return LighthouseServer(
        bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )


@pytest.fixture
def lighthouse():
    server = _lighthouse(1)
    yield server
    server.shutdown()


@pytest.fixture
def lighthouse2():
    server = _lighthouse(2)
    yield server
    server.shutdown()


def test_healthy_replicas_stay_bit_identical_and_initial_sync(lighthouse2, tmp_path):
    lighthouse = lighthouse2
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    # Different seeds: different initial weights; init_sync makes them identical from step 1 on.
    procs = [
        spawn(lighthouse.address(), name, out, "--steps", "6", "--seed", str(seed))
        for name, out, seed in zip(["a", "b"], outs, [1, 2])
    ]
    codes = wait_all(procs)
    assert codes == [0, 0], logs(outs[0]) + logs(outs[1])
    ha, hb = hashes(outs[0]), hashes(outs[1])
    assert sorted(ha) == sorted(hb) == [1, 2, 3, 4, 5, 6]
    assert ha == hb
    heals = [r for r in records(outs[0]) + records(outs[1]) if r["kind"] == "heal_done"]
    assert len(heals) == 1 and heals[0]["bytes"] > 0  # the non-primary pulled the primary's weights once
    assert heals[0]["step"] == 0  # initial sync, not a late join


def test_crash_and_rejoin_heals_from_donor(lighthouse, tmp_path):
    """b crashes at step 4 (a's allreduce fails, no commit, a goes on alone); b restarts and heals from a."""
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = spawn(lighthouse.address(), "a", a_out, "--steps", "40", "--sleep", "0.1", "--timeout", "5")
    b = spawn(lighthouse.address(), "b", b_out, "--steps", "40", "--crash-at", "4", "--sleep", "0.1")
    assert b.wait(timeout=90) == 3, logs(b_out)
    b2 = spawn(lighthouse.address(), "b", b_out, "--steps", "40", "--sleep", "0.1")
    codes = wait_all([a, b2])
    assert codes == [0, 0], logs(a_out) + logs(b_out)
    ha, hb = hashes(a_out), hashes(b_out)
    heal = [r for r in records(b_out) if r["kind"] == "heal_done" and r["step"] > 4]
    assert heal, "restarted replica never healed"
    assert heal[0]["donor"].startswith("a:")
    common = [s for s in hb if s > heal[0]["step"]]
    assert len(common) >= 3, (ha, hb)
    assert all(ha[s] == hb[s] for s in common), (ha, hb)
    assert ha[40] == hb[40]
    # a saw the crash as a failed (or lonely) step and reconfigured into a new quorum.
    quorum_ids = [r["quorum_id"] for r in records(a_out) if r["kind"] == "quorum"]
    assert len(quorum_ids) >= 3 and quorum_ids == sorted(quorum_ids)
