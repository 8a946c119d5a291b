"""Micro-benchmarks of regent.actor: latency, pipelining, broadcast, large arguments, spawn time.

    python benchmarks/actor_bench.py [--quick] [--json out.json]

Prints a Markdown table. Numbers depend heavily on the machine and its load; run on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from regent.actor import Actor, endpoint, this_host  # noqa: E402


class SyncPong(Actor):
    @endpoint
    def pong(self, x):
        return x

    @endpoint
    def count(self, n: int) -> None:
        self.n = getattr(self, "n", 0) + n

    @endpoint
    def total(self) -> int:
        return getattr(self, "n", 0)

    @endpoint
    def nbytes(self, arr) -> int:
        return memoryview(arr).nbytes if not hasattr(arr, "nbytes") else int(arr.nbytes)


class AsyncPong(Actor):
    @endpoint
    async def pong(self, x):
        return x


def median_us(fn, n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def run(quick: bool) -> list[tuple[str, str, str]]:
    n = 300 if quick else 2000
    rows = []
    t0 = time.perf_counter()
    pm8 = this_host().spawn_procs(per_host={"gpus": 8})
    m8 = pm8.spawn("p8", SyncPong)
    m8.pong.call(0).get(timeout=300)
    rows.append(("spawn 8 procs + actors to first reply", f"{time.perf_counter() - t0:.2f} s", "-"))
    pm8.stop().get(timeout=120)

    pm = this_host().spawn_procs(per_host={"gpus": 2})
    sync = pm.spawn("sync", SyncPong)
    asyn = pm.spawn("async", AsyncPong)
    one, one_async = sync.slice(gpus=0), asyn.slice(gpus=0)
    for _ in range(200):
        one.pong.call_one(1).get()
        one_async.pong.call_one(1).get()
        sync.pong.call(1).get()

    rows.append(("call_one round trip, sync actor (median)", f"{median_us(lambda: one.pong.call_one(1).get(), n):.0f} us",
                 "<= 250 us"))
    rows.append(("call_one round trip, async actor (median)",
                 f"{median_us(lambda: one_async.pong.call_one(1).get(), n):.0f} us", "<= 250 us"))

    async def await_loop() -> float:
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            await one_async.pong.call_one(1)
            samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1e6

    rows.append(("await call_one from asyncio client (median)", f"{asyncio.run(await_loop()):.0f} us", "-"))
    rows.append(("call to 2 procs (median)", f"{median_us(lambda: sync.pong.call(1).get(), n):.0f} us", "<= 400 us"))

    k = 2000 if quick else 20000
    t = time.perf_counter()
    futures = [one_async.pong.call_one(i) for i in range(k)]
    for f in futures:
        f.get(timeout=300)
    rows.append(("pipelined call_one", f"{k / (time.perf_counter() - t):,.0f} calls/s", ">= 20k/s"))

    t = time.perf_counter()
    for _ in range(k):
        one.count.broadcast(1)
    assert one.total.call_one().get(timeout=300) == k
    rows.append(("broadcast (fire-and-forget)", f"{k / (time.perf_counter() - t):,.0f} msg/s", ">= 50k/s"))

    try:
        import numpy as np

        arr = np.ones(100 * 1024 * 1024 // 8)
        label = "100 MB numpy argument"
        try:
            import torch

            torch.set_num_threads(1)
            arr = torch.ones(100 * 1024 * 1024 // 4)
            label = "100 MB torch tensor argument"
        except ImportError:
            pass
        one.nbytes.call_one(arr).get(timeout=300)
        times = []
        for _ in range(3 if quick else 5):
            t = time.perf_counter()
            one.nbytes.call_one(arr).get(timeout=300)
            times.append(time.perf_counter() - t)
        rows.append((label, f"{0.1 / statistics.median(times) * 1.048576:.2f} GB/s", ">= 1 GB/s"))
    except ImportError:
        rows.append(("100 MB argument", "numpy missing", ">= 1 GB/s"))
    pm.stop().get(timeout=120)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = run(args.quick)
    print(f"\nregent.actor on {os.cpu_count()} CPUs, Python {sys.version.split()[0]}\n")
    print("| measure | Regent | target |\n|---|---|---|")
    for name, value, target in rows:
        print(f"| {name} | {value} | {target} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
