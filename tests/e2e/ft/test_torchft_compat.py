"""TorchFT code runs on regent.ft after an import change: TorchFT's module layout and names, its keyword
arguments, and its training loops (per-step DDP + OptimizerWrapper, LocalSGD, DiLoCo), on real processes over
Gloo with a replica killed mid-run and healed from the live one."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from regent.ft.lighthouse import LighthouseServer

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "ft_custom_loop.py"
STYLE_WORKER = Path(__file__).resolve().parents[2] / "support" / "torchft_style_worker.py"


def test_torchft_module_layout_and_names_import():
    from regent.ft import (  # noqa: F401 - the import is the test
        DistributedDataParallel,
        DistributedSampler,
        Manager,
        Optimizer,
        ProcessGroupBabyNCCL,
        ProcessGroupGloo,
        ProcessGroupNCCL,
    )
    from regent.ft.coordination import LighthouseClient, LighthouseServer, ManagerClient, ManagerServer  # noqa: F401
    from regent.ft.data import DistributedSampler as Sampler
    from regent.ft.ddp import DistributedDataParallel as DDP  # noqa: F401
    from regent.ft.local_sgd import DiLoCo, LocalSGD  # noqa: F401
    from regent.ft.manager import Manager as M
    from regent.ft.optim import OptimizerWrapper

    assert Optimizer is OptimizerWrapper and M is Manager and Sampler is DistributedSampler
    assert issubclass(OptimizerWrapper, torch.optim.Optimizer)


def test_the_lighthouse_alone_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, regent.ft.lighthouse; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out


def test_distributed_sampler_gives_each_rank_of_each_group_its_own_shard():
    from regent.ft.data import DistributedSampler

    data = list(range(48))
    seen = []
    for replica in range(3):
        for rank in range(2):
            s = DistributedSampler(data, replica_rank=replica, num_replica_groups=3, group_rank=rank,
                                   num_replicas=2, shuffle=False)
            assert s.rank == rank + 2 * replica and s.num_replicas == 6
            seen.append(set(s))
    assert set().union(*seen) == set(data) and sum(map(len, seen)) == len(data)
    with pytest.raises(ValueError, match="replica_rank"):
        DistributedSampler(data, replica_rank=3, num_replica_groups=3, group_rank=0, num_replicas=1)


def test_process_group_gloo_speaks_torchft_calls():
    """configure() with TorchFT's newer keyword arguments, then allreduce (ReduceOp and AllreduceOptions, SUM and
    AVG), broadcast and allgather, waited on as torch Work (`wait`, `get_future`)."""
    from regent.ft import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    groups = [ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)) for _ in range(2)]
    addr = f"127.0.0.1:{store.port}/torchft/1/0"

    def run(rank: int) -> list:
        pg = groups[rank]
        pg.configure(addr, f"r{rank}", rank, 2, quorum_id=1, group_rank=0, group_world_size=1)
        t = torch.full((3,), float(rank + 1))
        pg.allreduce([t], dist.ReduceOp.SUM).wait()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        a = torch.full((2,), float(rank + 1))
        pg.allreduce([a], opts).get_future().wait()
        b = torch.full((2,), float(rank * 10))
        work = pg.broadcast([b], 1)
        work.wait()
        out = [[torch.zeros(1), torch.zeros(1)]]
        pg.allgather(out, [torch.tensor([float(rank)])]).wait()
        return [t.tolist(), a.tolist(), b.tolist(), [x.item() for x in out[0]], pg.size(), work.is_completed()]

    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(run, range(2)))
    finally:
        for g in groups:
            g.shutdown()
    for r in results:
        assert r == [[3.0] * 3, [1.5, 1.5], [10.0, 10.0], [0.0, 1.0], 2, True], r


def _lighthouse(**extra):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1500,
                              **extra)
    yield server
    server.shutdown()


@pytest.fixture
def lighthouse():
    yield from _lighthouse()


@pytest.fixture
def lighthouse_both_styles():
    # The first quorum waits for both style workers. A join timeout alone does not: it only waits for replicas
    # that already heartbeat, and on a loaded box (the suite run on two pytest-xdist workers) replica 1 trained
    # all 60 syncs alone before replica 0 had imported torch, so the spare joined a finished run.
    yield from _lighthouse(expect_groups=["torchft_style_0", "torchft_style_1"])


def _start(cmd: list[str], log: Path, lighthouse: LighthouseServer) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "REGENT_FT_LIGHTHOUSE": lighthouse.address(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "a") as f:
        return subprocess.Popen([sys.executable, *cmd], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)


def _wait_for(log: Path, predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and predicate(log.read_text()):
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting on {log}:\n{log.read_text() if log.exists() else ''}")


# The replacement process imports torch and regent before the kill and starts the script when told: a cold start
# on a loaded 2-core box (10-20 s) would otherwise outlast the survivor's whole run, and the test would measure the
# machine's load rather than the recovery.
_WAIT_THEN_RUN = (
    "import os, runpy, sys, time\n"
    "import torch, regent.ft\n"
    "go, script = sys.argv[1], sys.argv[2]\n"
    "while not os.path.exists(go):\n"
    "    time.sleep(0.02)\n"
    "sys.argv = [script, *sys.argv[3:]]\n"
    "runpy.run_path(script, run_name='__main__')\n"
)


def _run_with_a_kill(cmd, lighthouse, tmp_path, ready, done_line):
    """Two replicas; once replica 1 shows `ready`, kill it (SIGKILL) and start it again; both must finish."""
    logs = [tmp_path / "r0.log", tmp_path / "r1.log", tmp_path / "r1b.log"]
    go = tmp_path / "go"
    procs = [_start(cmd(0), logs[0], lighthouse), _start(cmd(1), logs[1], lighthouse),
             _start(["-c", _WAIT_THEN_RUN, str(go), *cmd(1)], logs[2], lighthouse)]
    try:
        _wait_for(logs[1], ready)
        procs[1].kill()
        procs[1].wait(30)
        assert procs[0].poll() is None, logs[0].read_text()  # the survivor trains on
        go.touch()
        codes = [procs[0].wait(240), procs[2].wait(240)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n---\n".join(text)
    finals = [done_line(text[0]), done_line(text[2])]
    assert finals[0] == finals[1], "\n---\n".join(text)  # same step, bit-identical parameters
    return text


def test_the_readme_loop_survives_a_kill_and_ends_bit_identical(lighthouse, tmp_path):
    """examples/ft_custom_loop.py, the README's loop: Manager + ProcessGroupGloo + DDP + OptimizerWrapper."""
    def cmd(r: int) -> list[str]:
        return [str(EXAMPLE), "--replica", str(r), "--steps", "400", "--step-time", "0.03"]

    def done(text: str) -> str:
        line = [x for x in text.splitlines() if " done at step " in x][-1]
        return line.split(" done at ")[1]

    text = _run_with_a_kill(cmd, lighthouse, tmp_path, lambda t: "replicas 2" in t, done)
    assert "done at step 400" in text[0]
    # the restarted replica came back in the middle and trained alongside the survivor
    assert "replicas 2" in text[2], text[2]


@pytest.mark.parametrize("mode", ["localsgd", "diloco"])
def test_torchft_style_local_sgd_and_diloco_recover_from_a_kill(lighthouse, tmp_path, mode):
    def cmd(r: int) -> list[str]:
        return [str(STYLE_WORKER), "--replica", str(r), "--mode", mode, "--syncs", "40", "--sync-every", "4",
                "--step-time", "0.05"]

    def done(text: str) -> dict:
        return [json.loads(x) for x in text.splitlines() if x.startswith('{"done"')][-1]

    text = _run_with_a_kill(cmd, lighthouse, tmp_path, lambda t: '"participants": 2' in t, done)
    before_kill = max(json.loads(x)["sync"] for x in text[1].splitlines() if x.startswith('{"sync"'))
    syncs = [json.loads(x) for x in text[2].splitlines() if x.startswith('{"sync"')]
    assert syncs and syncs[0]["sync"] > before_kill  # healed to the run's step, not from 0
    assert any(s["participants"] == 2 for s in syncs)


def test_fixed_with_spares_trains_min_replica_size_and_keeps_the_spare_in_step(lighthouse_both_styles, tmp_path):
    """WorldSizeMode.FIXED_WITH_SPARES, min_replica_size=1: one replica trains, the other is a spare that
    contributes nothing but applies every update, so both stay bit-identical."""
    def cmd(r: int) -> list[str]:
        return [str(STYLE_WORKER), "--replica", str(r), "--mode", "ddp", "--spares", "--syncs", "60",
                "--step-time", "0.01"]

    logs = [tmp_path / "r0.log", tmp_path / "r1.log"]
    procs = [_start(cmd(r), logs[r], lighthouse_both_styles) for r in range(2)]
    codes = [p.wait(240) for p in procs]
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n---\n".join(text)
    steps = [[json.loads(x) for x in t.splitlines() if x.startswith('{"sync"')] for t in text]
    assert all(s["participants"] == 1 for rows in steps for s in rows)  # never more than min_replica_size
    together = [{s["sync"]: s["participating"] for s in rows if s["sync"] > 5} for rows in steps]
    common = set(together[0]) & set(together[1])
    assert common and all(together[0][k] != together[1][k] for k in common)  # exactly one trains, one spares
    finals = [[json.loads(x) for x in t.splitlines() if x.startswith('{"done"')][-1] for t in text]
    assert finals[0] == finals[1]
