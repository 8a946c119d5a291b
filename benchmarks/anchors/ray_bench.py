"""Ray anchor: the same measures as mesh_api_measures.py, in Ray's idiom; prints one JSON object on stdout.

Run with the benchmark venv (Ray must never be installed into .venv):
    .venv-bench/bin/python benchmarks/anchors/ray_bench.py [--quick]
Create that venv with:
    python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 torchmonarch ray torchft-nightly

Ray has no meshes, so two measures are analogues, marked in the JSON: "call to 2 procs" is
`ray.get([a.ping.remote(x), b.ping.remote(x)])` over two actors, and "broadcast" is `a.incr.remote()`
with the ObjectRef dropped, flushed by one `ray.get(a.count.remote())`. Ray runs on loopback
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, no dashboard, num_cpus=2); `ray.init` itself is not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from importlib import metadata
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mesh_api_measures import (
    SMALL_PAYLOAD,
    TENSOR_BYTES,
    counts,
    guarded,
    latency_stats,
    log,
    make_ndarray,
    make_tensor,
    rate_stats,
    timed_calls,
)

GET_TIMEOUT_S = 120.0


def run_ray_measures(ray: Any, quick: bool, only: set[str] | None = None) -> dict[str, Any]:
    c = counts(quick)

    # num_cpus=0: Ray reserves one CPU per actor for scheduling by default, and this machine has 2
    @ray.remote(num_cpus=0)
    class Echo:
        def __init__(self) -> None:
            self.count_seen = 0

        def ping(self, payload: Any) -> Any:
            return payload

        def incr(self) -> None:
            self.count_seen += 1

        def count(self) -> int:
            return self.count_seen

        def nbytes(self, array: Any) -> int:
            return int(array.nbytes)

    def get(ref: Any) -> Any:
        return ray.get(ref, timeout=GET_TIMEOUT_S)

    results: dict[str, Any] = {}
    one = Echo.remote()
    get(one.ping.remote(0))

    def call_one() -> dict[str, Any]:
        return latency_stats(timed_calls(lambda: get(one.ping.remote(SMALL_PAYLOAD)), c["warmup"], c["rtt"]))

    guarded(results, "call_one", call_one, only)

    @ray.remote(num_cpus=0)
    class AsyncEcho:
        async def ping(self, payload: Any) -> Any:
            return payload

    def call_one_async() -> dict[str, Any]:
        aecho = AsyncEcho.remote()
        try:
            get(aecho.ping.remote(0))
            samples = timed_calls(lambda: get(aecho.ping.remote(SMALL_PAYLOAD)), c["warmup"], c["rtt"] // 2)
            return {**latency_stats(samples), "analogue": "async actor (asyncio)"}
        finally:
            ray.kill(aecho)

    guarded(results, "call_one_async", call_one_async, only)

    def call_one_awaited() -> dict[str, Any]:
        async def calls() -> list[float]:
            for _ in range(c["warmup"]):
                await one.ping.remote(SMALL_PAYLOAD)
            samples = []
            for _ in range(c["rtt"] // 2):
                t0 = time.perf_counter()
                await one.ping.remote(SMALL_PAYLOAD)
                samples.append(time.perf_counter() - t0)
            return samples

        return latency_stats(asyncio.run(asyncio.wait_for(calls(), GET_TIMEOUT_S)))

    guarded(results, "call_one_awaited", call_one_awaited, only)

    def call_two() -> dict[str, Any]:
        pair = [Echo.remote(), Echo.remote()]
        try:
            get([a.ping.remote(0) for a in pair])
            samples = timed_calls(lambda: get([a.ping.remote(SMALL_PAYLOAD) for a in pair]),
                                  c["warmup"], c["rtt"] // 2)
            return {**latency_stats(samples), "analogue": "ray.get over two actors"}
        finally:
            for a in pair:
                ray.kill(a)

    guarded(results, "call_2procs", call_two, only)

    def pipelined() -> dict[str, Any]:
        n = c["pipelined"]
        rates = []
        for _ in range(c["pipelined_rounds"]):
            t0 = time.perf_counter()
            get([one.ping.remote(SMALL_PAYLOAD) for _ in range(n)])
            rates.append(n / (time.perf_counter() - t0))
        return {**rate_stats(rates), "in_flight": n}

    guarded(results, "pipelined", pipelined, only)

    def broadcast() -> dict[str, Any]:
        n = c["broadcast"]
        rates = []
        for _ in range(c["broadcast_rounds"]):
            before = get(one.count.remote())
            t0 = time.perf_counter()
            for _ in range(n):
                one.incr.remote()
            after = get(one.count.remote())  # Ray actor tasks from one caller run in submission order
            elapsed = time.perf_counter() - t0
            if after - before != n:
                raise RuntimeError(f"lost messages: sent {n}, actor counted {after - before}")
            rates.append(n / elapsed)
        return {**rate_stats(rates), "messages": n, "analogue": "remote() with the ObjectRef dropped"}

    guarded(results, "broadcast", broadcast, only)

    def big_argument(make: Any) -> Any:
        def measure() -> dict[str, Any]:
            array = make()
            got = get(one.nbytes.remote(array))
            if got != TENSOR_BYTES:
                raise RuntimeError(f"actor saw {got} bytes, expected {TENSOR_BYTES}")
            rates = []
            for _ in range(c["tensor_rounds"]):
                t0 = time.perf_counter()
                get(one.nbytes.remote(array))
                rates.append(TENSOR_BYTES / (time.perf_counter() - t0) / 1e9)
            return {**rate_stats(rates), "bytes": TENSOR_BYTES}

        return measure

    guarded(results, "tensor_100mb", big_argument(make_tensor), only)
    guarded(results, "ndarray_100mb", big_argument(make_ndarray), only)
    ray.kill(one)

    def spawn8() -> dict[str, Any]:
        times = []
        for _ in range(c["spawn_rounds"]):
            t0 = time.perf_counter()
            actors = [Echo.remote() for _ in range(8)]
            replies = get([a.ping.remote(1) for a in actors])
            times.append(time.perf_counter() - t0)
            if len(replies) != 8:
                raise RuntimeError("8 actors did not give 8 replies")
            for a in actors:
                ray.kill(a)
            time.sleep(1.0)  # let the killed workers go before the next cold round
        return {"median_s": statistics.median(times), "rounds": times,
                "analogue": "8 new actors (8 worker processes), ray.init already done"}

    guarded(results, "spawn8_first_reply", spawn8, only)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter run (smoke test)")
    parser.add_argument("--only", default="", help="comma-separated measures (default: all)")
    args = parser.parse_args()
    only = {m for m in args.only.split(",") if m} or None
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    torch.set_num_threads(1)
    try:
        import ray
    except ImportError as exc:
        raise SystemExit(f"ray is not importable ({exc}); create the bench venv: python3 -m venv .venv-bench"
                         " && .venv-bench/bin/pip install torch==2.13.0 torchmonarch ray torchft-nightly") from exc
    version = metadata.version("ray")
    log(f"ray {version}: starting a local cluster on loopback")
    t0 = time.perf_counter()
    ray.init(include_dashboard=False, num_cpus=2, _node_ip_address="127.0.0.1", logging_level="WARNING",
             log_to_driver=False)
    init_s = time.perf_counter() - t0
    try:
        results = run_ray_measures(ray, quick=args.quick, only=only)
    finally:
        ray.shutdown()
    out = {"runtime": "ray", "version": version, "ray_init_s": init_s, "results": results}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
