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
sys.path.insert(0, str(REPO / "src"))  # regent from this checkout
from regent.ports import free_port_pair  # noqa: E402 (after the path; scale_bench and control_plane_sim import it from here)

PYTHON = sys.executable
os.environ.setdefault("RUST_LOG", "error")  # TorchFT's Rust clients log every connection at INFO otherwise


# ---- helpers shared by sections ---------------------------------------------------------------------------------




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
            except BaseException as err:  # noqa: BLE001 - reported after the run
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
    return results + bench_manager_quorum(args)


def _manager_quorum_replica(lighthouse: str, name: str, calls: int, results) -> None:
    """One replica group (one rank) in its own process: time each synchronous `Manager.start_quorum()`."""
    import torch

    torch.set_num_threads(1)
    from regent.ft.manager import Manager

    manager = Manager(
        load_state_dict=lambda _: None, state_dict=dict, use_async_quorum=False, init_sync=False,
        lighthouse_addr=lighthouse,
        replica_id=name, timeout=30, quorum_timeout=30,
    )
    try:
        out = []
        for i in range(calls):
            t = time.perf_counter()
            manager.start_quorum()
            if i >= calls // 10:
                out.append(time.perf_counter() - t)
        results.put((name, out))
    finally:
        manager.shutdown()


def bench_manager_quorum(args: argparse.Namespace, groups: int = 2) -> list[dict]:
    """Per-call time of `Manager.start_quorum()` (sync) with `groups` replica groups of one rank, each in its
    own process, against Regent's Lighthouse: the rank -> ManagerServer -> Lighthouse path end to end."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port_pair()
    proc = start_lighthouse("regent", port, min_replicas=groups)
    calls = max(100, args.rounds // 2)
    try:
        queue = ctx.Queue()
        workers = [
            ctx.Process(target=_manager_quorum_replica, args=(f"http://127.0.0.1:{port}", f"g{i}", calls, queue))
            for i in range(groups)
        ]
        for w in workers:
            w.start()
        samples = [queue.get(timeout=300)[1] for _ in workers]
        for w in workers:
            w.join(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    ms = sorted(s * 1000 for out in samples for s in out)
    row = {"groups": groups, "calls": len(ms), "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))]}
    print_table(
        "Manager.start_quorum() (sync), one rank per group (ms; TorchFT reference: 1.5 ms with 2 groups)",
        ["groups", "calls", "median ms", "p90 ms"],
        [[str(groups), str(row["calls"]), f"{row['median_ms']:.3f}", f"{row['p90_ms']:.3f}"]],
    )
    return [row]


# ---- sections owned by the Manager work: bench_overhead(args), bench_transfer(args) -----------------------------


def _overhead_replica(lighthouse: str, name: str, steps: int, use_manager: bool, results) -> None:
    """One replica process: the same small MLP training, with or without the Manager (CPU, Gloo)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    manager = None
    if use_manager:
        from regent.ft.manager import Manager

        manager = Manager(
            load_state_dict=model.load_state_dict, state_dict=model.state_dict, lighthouse_addr=lighthouse,
            replica_id=name, timeout=30, quorum_timeout=60, init_sync=False,
        )
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    times = []
    for step in range(steps + 5):
        start = time.perf_counter()
        if manager is not None:
            manager.start_quorum()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if manager is not None:
            for f in [manager.allreduce(p.grad) for p in model.parameters()]:
                f.wait()
            if manager.should_commit():
                opt.step()
        else:
            opt.step()
        if step >= 5:
            times.append(time.perf_counter() - start)
    if manager is not None:
        manager.shutdown()
    results.put((name, use_manager, times))


def bench_overhead(args: argparse.Namespace) -> list[dict]:
    """Per-step time of the same CPU training without the Manager and with it (1 and 2 replicas)."""
    import multiprocessing as mp

    from regent.ft.lighthouse import LighthouseServer

    ctx = mp.get_context("spawn")
    out = []
    for replicas, use_manager in [(1, False), (1, True), (2, True)]:
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=replicas, join_timeout_ms=5000)
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_overhead_replica, args=(lighthouse.address(), f"r{i}", args.steps, use_manager, queue))
            for i in range(replicas)
        ]
        for p in procs:
            p.start()
        samples = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        lighthouse.shutdown()
        ms = sorted(t * 1000 for _, _, times in samples for t in times)
        out.append({
            "replicas": replicas, "manager": use_manager, "steps": args.steps,
            "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        })
    base = out[0]["median_ms"]
    print_table(
        "Per-step time, CPU MLP (ms): same training without / with the Manager",
        ["replicas", "manager", "median ms", "p90 ms", "overhead ms"],
        [[str(r["replicas"]), str(r["manager"]), f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}",
          f"{r['median_ms'] - base:+.2f}"] for r in out],
    )
    return out


def _transfer_state(total_bytes: int, tensor_bytes: int) -> dict:
    import torch

    n = max(1, total_bytes // tensor_bytes)
    return {f"layer{i}": torch.full((tensor_bytes // 4,), float(i)) for i in range(n)}


def _time_transfer(donor, healer, state: dict, into: dict | None, step: int = 1) -> float:
    from datetime import timedelta

    start = time.perf_counter()
    donor.send_checkpoint([1], step, state, timedelta(seconds=300) if into is None else 300)
    if into is None:
        got = healer.recv_checkpoint(0, donor.metadata(), step, timedelta(seconds=300))
    else:
        got = healer.recv_checkpoint(0, donor.metadata(), step, 300, into=into)
    elapsed = time.perf_counter() - start
    donor.disallow_checkpoint()
    assert float(got["layer1"][0]) == 1.0
    return elapsed


def bench_transfer(args: argparse.Namespace) -> list[dict]:
    """CPU loopback peer-transfer bandwidth: Regent's TCP streaming transport (in place) and its Gloo group
    transport, against TorchFT's HTTPTransport when torchft-nightly is installed."""
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from regent.ft.transfer import StreamTransport

    total = int(args.transfer_gb * (1 << 30))
    tensor_bytes = 1 << 20 if args.transfer_gb <= 2 else 4 << 20
    state = _transfer_state(total, tensor_bytes)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    results = []

    def record(name: str, chunks: int, seconds: float) -> None:
        results.append({"transport": name, "chunks": chunks, "gb": nbytes / 1e9, "seconds": seconds,
                        "gb_per_s": nbytes / 1e9 / seconds})

    into = {k: torch.empty_like(v) for k, v in state.items()}
    for chunks in (1, 4, 8):
        donor, healer = StreamTransport(num_chunks=chunks), StreamTransport(num_chunks=chunks)
        try:
            _time_transfer(donor, healer, state, into)  # warm-up
            record("regent tcp (in place)", chunks, min(_time_transfer(donor, healer, state, into) for _ in range(2)))
        finally:
            donor.shutdown()
            healer.shutdown()

    import datetime

    import torch.distributed as dist

    from regent.ft.process_group import ReplicatedGroup
    from regent.ft.transfer import GroupTransport

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [ReplicatedGroup("gloo", timeout=300) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: groups[r].configure(f"127.0.0.1:{store.port}/bench/1/0", f"r{r}", r, 2), range(2)))
        donor_t, healer_t = GroupTransport(groups[0]), GroupTransport(groups[1])
        for attempt in range(2):
            start = time.perf_counter()
            f = pool.submit(donor_t.send_checkpoint, [1], 1, state, 300)
            healer_t.recv_checkpoint(0, "<group>", 1, 300, into=into)
            f.result()
            if attempt:
                record("regent gloo group (in place)", 1, time.perf_counter() - start)
    for g in groups:
        g.shutdown()
    del datetime

    if importlib.util.find_spec("torchft") is not None:
        from torchft.checkpointing.http_transport import HTTPTransport

        for chunks in (0, 8):
            from datetime import timedelta

            donor = HTTPTransport(timedelta(seconds=300), num_chunks=chunks)
            healer = HTTPTransport(timedelta(seconds=300), num_chunks=chunks)
            try:
                _time_transfer(donor, healer, state, None)
                record("torchft http", chunks, min(_time_transfer(donor, healer, state, None) for _ in range(2)))
            finally:
                donor.shutdown(wait=False)
                healer.shutdown(wait=False)
    else:
        print("torchft-nightly not installed: measuring Regent only (pip install torchft-nightly)")
    print_table(
        f"Peer transfer, CPU loopback, {nbytes / 1e9:.2f} GB in {len(state)} tensors (GB/s; higher is better). "
        "TorchFT reference: HTTPTransport ~4 GB/s at best",
        ["transport", "chunks", "seconds", "GB/s"],
        [[r["transport"], str(r["chunks"]), f"{r['seconds']:.3f}", f"{r['gb_per_s']:.2f}"] for r in results],
    )
    return results


def _gpu_transfer_rank(rank: int, port: int, sizes_gb: list[float], timeout: float, results) -> None:
    """One GPU of the pair: raw NCCL send/recv vs GroupTransport (in place) for the same bytes."""
    import faulthandler
    from datetime import timedelta

    faulthandler.dump_traceback_later(150, exit=True)
    import torch
    import torch.distributed as dist

    from regent.ft.process_group import ReplicatedGroup
    from regent.ft.transfer import GroupTransport

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=120))
    group = ReplicatedGroup("nccl", timeout=timeout, connect_timeout=120)
    group.configure(f"127.0.0.1:{port}/bench/1/0", f"r{rank}", rank, 2)
    transport = GroupTransport(group)
    out: list[dict] = []
    tensor_elems = 32 << 20  # 64 MiB of bf16 per tensor
    for gb in sizes_gb:
        n = max(1, int(gb * (1 << 30)) // (tensor_elems * 2))
        fill = (lambda i: float(i % 100)) if rank == 0 else (lambda i: 0.0)
        state = {f"layer{i}": torch.full((tensor_elems,), fill(i), dtype=torch.bfloat16, device="cuda") for i in range(n)}
        nbytes = n * tensor_elems * 2
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        ptr = state["layer1"].data_ptr() if n > 1 else state["layer0"].data_ptr()
        for attempt in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            (group.send if rank == 0 else group.recv)([flat], 1 - rank, 99)
            torch.cuda.synchronize()
            raw = time.perf_counter() - start
            start = time.perf_counter()
            if rank == 0:
                transport.send_checkpoint([1], 7, state, timeout)
            else:
                got = transport.recv_checkpoint(0, "<group>", 7, timeout, into=state)
                assert float(got[f"layer{n - 1}"][0]) == float((n - 1) % 100)
                assert (got["layer1"] if n > 1 else got["layer0"]).data_ptr() == ptr  # in place
            torch.cuda.synchronize()
            moved = time.perf_counter() - start
            if attempt:
                out.append({"gb": nbytes / 1e9, "raw_p2p_gb_per_s": nbytes / 1e9 / raw,
                            "transfer_gb_per_s": nbytes / 1e9 / moved, "tensors": n})
                print(f"rank {rank}: {out[-1]}", flush=True)
        del state, flat
        torch.cuda.empty_cache()
    # The hung-peer check on NCCL lives in tests/support/nccl_hang_check.py (run through the device tool).
    hang: dict = {}
    results.put((rank, out, hang))
    group.shutdown()
    del store


def bench_transfer_gpu(args: argparse.Namespace) -> list[dict]:
    """GPU peer transfer between two GPUs of one host over NCCL (run through the device tool on
    nvidia-h200-x2): GroupTransport in place vs raw NCCL point-to-point of the same bytes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gpu_transfer_rank, args=(r, port, args.gpu_gb, 60.0, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, out, hang = queue.get(timeout=500)
        got[rank] = (out, hang)
    for p in procs:
        p.join(timeout=60)
    rows = got[1][0]
    print_table(
        "GPU peer transfer over NCCL, 2 GPUs of one host (GB/s; target >= 80% of raw point-to-point)",
        ["GB", "tensors", "raw p2p GB/s", "transfer GB/s", "ratio"],
        [[f"{r['gb']:.2f}", str(r["tensors"]), f"{r['raw_p2p_gb_per_s']:.1f}", f"{r['transfer_gb_per_s']:.1f}",
          f"{r['transfer_gb_per_s'] / r['raw_p2p_gb_per_s']:.2f}"] for r in rows],
    )
    return rows


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "quorum": bench_quorum,
    "overhead": bench_overhead,
    "transfer": bench_transfer,
    "transfer_gpu": bench_transfer_gpu,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 64], help="quorum sizes (default 1 4 64)")
    parser.add_argument("--rounds", type=int, default=1000, help="quorum calls for 1 replica (fewer for more)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per overhead measurement")
    parser.add_argument("--transfer-gb", type=float, default=1.0, help="state size for the transfer benchmark")
    parser.add_argument("--gpu-gb", type=float, nargs="+", default=[1.0, 8.0], help="GPU transfer sizes")
    args = parser.parse_args(argv)
    for name in args.only or [s for s in SECTIONS if s != "transfer_gpu"]:
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
