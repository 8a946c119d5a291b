"""DiLoCo / Streaming DiLoCo with real replicas: late joiners get the global params and outer momentum;
a failed sync rolls back and retries the same fragment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from regent.ft.lighthouse import LighthouseServer
from regent.ft.local_sgd import DiLoCo, LocalSGD
from regent.ft.manager import Manager
from tests.ft.ft_harness import logs, records, wait_all

WORKER = Path(__file__).with_name("diloco_worker.py")


def _spawn(lighthouse: str, name: str, out: Path, *extra: str) -> subprocess.Popen:
    with open(out.with_suffix(".0.log"), "a") as log:
        return subprocess.Popen(
            [sys.executable, str(WORKER), "--lighthouse", lighthouse, "--name", name, "--out", str(out), *extra],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT,
        )


def _syncs(path: Path) -> list[dict]:
    return [r for r in records(path) if r["kind"] == "sync"]


def _committed_hashes(path: Path) -> dict[int, str]:
    return {r["step"]: r["hash"] for r in _syncs(path) if r["committed"]}


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    yield server
    server.shutdown()


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
def test_late_joiner_gets_global_params_and_outer_momentum(lighthouse, tmp_path, extra):
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


def test_failed_sync_rolls_back_and_retries_same_fragment(lighthouse, tmp_path):
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


def _solo_manager(lh: LighthouseServer, model: torch.nn.Module) -> Manager:
    return Manager(
        load_state_dict=model.load_state_dict, state_dict=model.state_dict, use_async_quorum=False,
        lighthouse_addr=lh.address(), replica_id="solo", timeout=5, quorum_timeout=10,
    )


def test_diloco_outer_step_math_single_replica(lighthouse):
    """lr=1, no momentum: new global = old global - (old global - local) = local; alpha mixes nothing more."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        with DiLoCo(manager, [model], inner, outer, sync_every=2) as diloco:
            for _ in range(2):
                inner.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                inner.step()
            assert diloco.last_sync == {"fragment": 0, "committed": True, "step": 1}
        # Inner SGD on a linear model: two identical steps; outer lr 1 reproduces the local result.
        for n, p in model.named_parameters():
            grad = torch.ones(1, 4) * 3 if n == "weight" else torch.tensor([3.0])
            assert torch.allclose(p, start[n] - 0.2 * grad, atol=1e-6)
            assert torch.equal(diloco.fragments[0].original[n], p.detach())
    finally:
        manager.shutdown()


def test_a_mid_round_joiners_weight_cancels_in_the_average(lighthouse):
    """Alone in its quorum, a replica that joined mid-round (weight 2/5: two of five inner steps) gets its own
    pseudo-gradient back from the weighted average, (w * pg) / w: with outer lr 1 the new global parameters are
    its local ones. A pseudo-gradient sent unweighted, or averaged without dividing by the weight, is not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        steps: list[int] = []
        with DiLoCo(manager, [model], inner, outer, sync_every=5, on_contributor_step=steps.append) as diloco:
            diloco._round_info = {"at": time.time() - 0.25, "step_s": 0.1}  # a holder 3 steps into the round
            assert not diloco.join_now() and diloco.joined_mid_round == {"round_position": 3, "period": 5}
            assert steps == [3] and diloco.local_step == 3
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            for _ in range(2):
                inner.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                inner.step()
            assert diloco.last_sync["committed"] and diloco._pending_weight == 2 / 5
        # two identical inner SGD steps on a linear model (the sync ran inside the second)
        for n, p in model.named_parameters():
            grad = torch.ones(1, 4) * 3 if n == "weight" else torch.tensor([3.0])
            assert torch.allclose(p, start[n] - 0.2 * grad, atol=1e-6), n
    finally:
        manager.shutdown()


def test_a_round_nobody_trained_in_takes_no_outer_step(lighthouse):
    """A replica that sits a round out (just healed) and ends up alone in its quorum commits the round without
    an outer step: with outer momentum, a step on zero pseudo-gradients would still move its parameters, and
    the same committed state would have two values (seen at the end of a run: replicas differing)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(manager, [model], inner, outer, sync_every=2) as diloco:
            for _ in range(2):  # one trained round: the outer momentum is not zero any more
                inner.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                inner.step()
            assert diloco.last_sync["committed"] and outer.state[model.weight]["momentum_buffer"].abs().sum() > 0
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert diloco.join_now()  # a round this replica sits out, alone: committed, nothing to average
            for n, p in model.named_parameters():
                assert torch.equal(p, before[n]), n
    finally:
        manager.shutdown()


def test_diloco_validates_its_arguments(lighthouse):
    model = torch.nn.Linear(2, 2)
    manager = _solo_manager(lighthouse, model)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="multiple"):
            DiLoCo(manager, [model, model], opt, opt, sync_every=3)
        with pytest.raises(ValueError, match="fragment_sync_delay"):
            DiLoCo(manager, [model], opt, opt, sync_every=3, fragment_sync_delay=3)
        manager.use_async_quorum = True
        with pytest.raises(ValueError, match="use_async_quorum=False"):
            DiLoCo(manager, [model], opt, opt, sync_every=3)
    finally:
        manager.shutdown()


def test_local_sgd_single_replica_keeps_params(lighthouse):
    model = torch.nn.Linear(3, 1)
    manager = _solo_manager(lighthouse, model)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with LocalSGD(manager, model, opt, sync_every=2):
            for _ in range(4):
                opt.zero_grad()
                model(torch.ones(2, 3)).sum().backward()
                before = [p.detach().clone() for p in model.parameters()]
                opt.step()
        after = list(model.parameters())
        assert manager.current_step() == 2  # two syncs committed
        assert not all(torch.equal(a, b) for a, b in zip(before, after))
    finally:
        manager.shutdown()


def test_a_healed_replica_joins_the_round_in_progress(lighthouse, tmp_path):
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
    assert 1 <= pos <= 28 and joined["local_step"] == pos, joined
    first = _syncs(b_out)[0]
    assert first["committed"] and first["participants"] == 2, first
    assert first["weight"] == (30 - pos) / 30  # the inner steps it took, of a round of 30
    a_same = [s for s in _syncs(a_out) if s["step"] == first["step"]]
    assert a_same and a_same[0]["weight"] == 1.0 and a_same[0]["hash"] == first["hash"]
    # from the next round on it is a full member, in phase with a
    assert all(s["weight"] == 1.0 for s in _syncs(b_out)[1:])
    ha, hb = _committed_hashes(a_out), _committed_hashes(b_out)
    assert all(ha[s] == hb[s] for s in hb), (ha, hb)
