"""Helpers to run ft_worker.py processes against a real in-process Lighthouse."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("ft_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_groups(timeout: float = 5.0) -> Iterator[list[Any]]:
    """`gloo_pair`'s two groups, shut down (and their store released) when the block ends."""
    store, groups = gloo_pair(timeout)
    try:
        yield groups
    finally:
        for g in groups:
            g.shutdown()
        del store


def gloo_pair(timeout: float = 5.0) -> tuple[Any, list[Any]]:
    """Two `ReplicatedGroup`s (ranks 0 and 1 of one Gloo group, in this process) and the store they met at."""
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from regent.ft.process_group import ReplicatedGroup

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    groups = [ReplicatedGroup("gloo", timeout=timeout, connect_timeout=30) for _ in range(2)]
    addr = f"127.0.0.1:{store.port}/regent/1/0"
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: groups[r].configure(addr, f"r{r}", r, 2), range(2)))
    return store, groups


def spawn(lighthouse: str, name: str, out: Path, *extra: str, group_rank: int = 0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(out.with_suffix(f".{group_rank}.log"), "a") as log:
        return subprocess.Popen(
            [sys.executable, str(WORKER), "--lighthouse", lighthouse, "--name", name, "--out", str(out),
             "--group-rank", str(group_rank), *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )


def wait_all(procs: list[subprocess.Popen], timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hashes(path: Path) -> dict[int, str]:
    """step -> state hash after that committed step (last write wins: a healed replica rewrites a step)."""
    return {r["step"]: r["hash"] for r in records(path) if r["kind"] == "state"}


def logs(out: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(out.parent.glob(out.stem + ".*.log")))
