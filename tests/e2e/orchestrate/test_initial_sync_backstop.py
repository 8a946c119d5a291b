"""DiLoCo's initial weight sync is a commit like any other, so it gets a durable backstop at once.

Found by a soak: one replica formed the first quorum alone (the others still starting on a busy machine),
committed the initial sync (step 1), trained its first round and was killed before that round ended. No live
replica and no backstop held step 1, so the run stopped, fatally, 38 s in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_initial_weight_sync_is_backed_up_before_the_first_round(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "regent.cli", "train", "--replicas", "1", "--procs-per-replica", "1",
         "--model", "debug", "--no-live", "--no-faults", "--steps", "5", "--ft.sync-every", "5",
         "--train.seq-len", "32", "--train.batch-size", "2", "--ft.backstop-every-s", "600",
         "--run-dir", str(run_dir)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    saved = [e for e in events if e["kind"] == "backstop_saved"]
    assert saved and saved[0]["manager_step"] == 1, saved  # the initial sync, not the first round's end
