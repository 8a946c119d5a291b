"""Fault-tolerance benchmarks: Regent vs TorchFT, side by side in one run.

    .venv/bin/python benchmarks/ft_bench.py                 # every section
    .venv/bin/python benchmarks/ft_bench.py --only quorum   # one section

Sections (each a function `bench_<name>(args) -> list[dict]` registered in SECTIONS):
- quorum:   Lighthouse quorum latency with 1, 4 and 64 replicas (this file's owner: the Lighthouse).
- overhead: per-step FT overhead (owned by the Manager work; add `bench_overhead` below).
- transfer: peer state-transfer bandwidth (owned by the Manager work; add `bench_transfer` below).

Quorum method: both Lighthouses run as separate processes (`regent lighthouse` and TorchFT's
`torchft_lighthouse`), so neither shares a GIL with the clients. Each replica is one thread with its own client;
all replicas heartbeat first, then run synchronized rounds: every replica calls `quorum()` and the round ends when
the last one has its answer. Reported: median and p90 milliseconds per round (for 1 replica: per call). Every
server is measured with both clients (TorchFT's Rust client and Regent's Python client) in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
os.environ.setdefault("RUST_LOG", "error")  # TorchFT's Rust clients log every connection at INFO otherwise


# ---- helpers shared by sections ---------------------------------------------------------------------------------


def free_port_pair() -> int:
    """A port P with P and P+1 free (Regent's Lighthouse serves its dashboard on P+1)."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair on 127.0.0.1")


def wait_for_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


# ---- quorum latency ---------------------------------------------------------------------------------------------


def start_lighthouse(kind: str, port: int, min_replicas: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
    if kind == "regent":
        cmd = [PYTHON, "-m", "regent.cli", "lighthouse", "--log-level", "WARNING"]
    else:
        exe = shutil.which("torchft_lighthouse") or str(Path(PYTHON).parent / "torchft_lighthouse")
        cmd = [exe]
    cmd += ["--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas), "--join_timeout_ms", "60000",
            "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "5000"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    wait_for_port(port)
    return proc


def make_client(kind: str, addr: str) -> Callable[[str], Callable[[], object]]:
    """Returns replica_id -> (zero-arg quorum call, heartbeat call)."""
    if kind == "torchft":
        from torchft._torchft import LighthouseClient as TorchftClient

        def build(rid: str):
            c = TorchftClient(addr, timedelta(seconds=30))
            return (lambda: c.quorum(rid, timedelta(seconds=60))), (lambda: c.heartbeat(rid))
    else:
        from regent.ft.lighthouse_client import LighthouseClient

        def build(rid: str):
            c = LighthouseClient(addr, connect_timeout=30)
            return (lambda: c.quorum(rid, 60.0)), (lambda: c.heartbeat(rid))

    return build


def measure_rounds(build, replicas: int, rounds: int, warmup: int) -> list[float]:
    """Seconds per synchronized quorum round across `replicas` threads."""
    calls = [build(f"replica_{i}:bench") for i in range(replicas)]
    for _, heartbeat in calls:
        heartbeat()
    if replicas == 1:
        quorum = calls[0][0]
        for _ in range(warmup):
            quorum()
        out = []
        for _ in range(rounds):
            t = time.perf_counter()
            quorum()
            out.append(time.perf_counter() - t)
        return out

    start = threading.Barrier(replicas + 1)
    done = threading.Barrier(replicas + 1)
    errors: list[BaseException] = []

    def worker(quorum) -> None:
        for _ in range(warmup + rounds):
            start.wait()
            try:
                quorum()
            except BaseException as err:  # reported after the run
                errors.append(err)
            done.wait()

    threads = [threading.Thread(target=worker, args=(q,), daemon=True) for q, _ in calls]
    for t in threads:
        t.start()
    out = []
    for i in range(warmup + rounds):
        start.wait()
        t0 = time.perf_counter()
        done.wait()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} quorum calls failed; first: {errors[0]!r}")
    return out


def bench_quorum(args: argparse.Namespace) -> list[dict]:
    import importlib.util

    have_torchft = importlib.util.find_spec("torchft") is not None
    servers = ["regent"] + (["torchft"] if have_torchft else [])
    clients = (["torchft"] if have_torchft else []) + ["regent"]
    if not have_torchft:
        print("torchft-nightly not installed: measuring Regent only (pip install torchft-nightly)")
    results = []
    for replicas in args.replicas:
        rounds = args.rounds if replicas == 1 else max(20, args.rounds // max(1, replicas // 2))
        for server in servers:
            port = free_port_pair()
            proc = start_lighthouse(server, port, min_replicas=replicas)
            try:
                for client in clients:
                    samples = measure_rounds(
                        make_client(client, f"http://127.0.0.1:{port}"), replicas, rounds, warmup=max(5, rounds // 10)
                    )
                    ms = sorted(s * 1000 for s in samples)
                    results.append({
                        "replicas": replicas, "server": server, "client": client, "rounds": len(ms),
                        "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
                    })
            finally:
                proc.kill()
                proc.wait()
    rows = [
        [str(r["replicas"]), r["server"], r["client"], str(r["rounds"]), f"{r['median_ms']:.3f}", f"{r['p90_ms']:.3f}"]
        for r in results
    ]
    print_table(
        "Quorum latency per round (ms; lower is better). TorchFT reference: 0.41 ms per single-replica call",
        ["replicas", "lighthouse", "client", "rounds", "median ms", "p90 ms"],
        rows,
    )
    return results


# ---- sections owned by the Manager work go here: bench_overhead(args), bench_transfer(args) ----------------------


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "quorum": bench_quorum,
    # "overhead": bench_overhead,
    # "transfer": bench_transfer,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 64], help="quorum sizes (default 1 4 64)")
    parser.add_argument("--rounds", type=int, default=1000, help="quorum calls for 1 replica (fewer for more)")
    args = parser.parse_args(argv)
    for name in args.only or list(SECTIONS):
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
