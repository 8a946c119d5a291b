"""The actor-runtime measures, written once against the Monarch API so Monarch and Regent run the same code.

`run_measures(api)` takes the module that provides the API (`monarch.actor` or `regent.actor`) and returns a
dict of results. Both runtimes therefore execute exactly the same calls, payloads and repeat counts; only
the import differs. The actor classes are defined inside `define_actors`, so they pickle by value and the
worker processes need no import path to this file.

Only the standard library and torch/numpy are used, because this file runs under two different venvs.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# Sizes and counts shared by every runtime (ray_bench.py imports these too, so all three agree).
SMALL_PAYLOAD = b"x" * 64
TENSOR_BYTES = 100_000_000  # "100 MB" in decimal bytes; GB/s below is 1e9 bytes per second
GET_TIMEOUT_S = 120.0


def counts(quick: bool) -> dict[str, int]:
    """Repeat counts; --quick keeps every measure but shortens it (for a smoke run, not for the record)."""
    if quick:
        return {"warmup": 20, "rtt": 200, "pipelined": 1000, "pipelined_rounds": 2, "broadcast": 2000,
                "broadcast_rounds": 2, "tensor_rounds": 2, "spawn_rounds": 1}
    return {"warmup": 100, "rtt": 2000, "pipelined": 1000, "pipelined_rounds": 5, "broadcast": 10000,
            "broadcast_rounds": 3, "tensor_rounds": 5, "spawn_rounds": 2}


def log(msg: str) -> None:
    """Progress goes to stderr: anchors print their JSON result on stdout and nothing else."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def latency_stats(seconds: list[float]) -> dict[str, float]:
    """Median and p99 in milliseconds (nearest-rank p99, so it is a latency that really happened)."""
    ordered = sorted(seconds)
    p99_index = min(len(ordered) - 1, max(0, int(round(0.99 * len(ordered))) - 1))
    return {"median_ms": statistics.median(ordered) * 1e3, "p99_ms": ordered[p99_index] * 1e3,
            "n": len(ordered)}


def rate_stats(rates: list[float]) -> dict[str, Any]:
    """The median of several rounds (rounds listed too): a shared 2-core machine is noisy."""
    return {"median": statistics.median(rates), "rounds": rates}


def timed_calls(call: Callable[[], Any], warmup: int, n: int) -> list[float]:
    for _ in range(warmup):
        call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


MEASURES = ("call_one", "call_one_async", "call_one_awaited", "call_2procs", "pipelined", "broadcast", "tensor_100mb", "ndarray_100mb",
            "spawn8_first_reply")


def guarded(results: dict[str, Any], key: str, fn: Callable[[], Any], only: set[str] | None = None) -> None:
    """Run one measure; a failure is recorded as an error string and the other measures still run."""
    if only is not None and key not in only:
        return
    log(f"{key} ...")
    t0 = time.perf_counter()
    try:
        results[key] = fn()
    except BaseException as exc:  # a runtime under test may fail in any way; keep going
        if isinstance(exc, KeyboardInterrupt):
            raise
        results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"{key} FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    log(f"{key} done in {time.perf_counter() - t0:.1f} s: {results[key]}")


def make_tensor() -> Any:
    import torch

    return torch.ones(TENSOR_BYTES // 4, dtype=torch.float32)


def make_ndarray() -> Any:
    import numpy

    return numpy.ones(TENSOR_BYTES // 8, dtype=numpy.float64)


def define_async_actor(api: Any) -> type:
    """An async-endpoint echo: it runs on the proc's event loop, with no hand-off to an actor thread."""

    class AsyncEcho(api.Actor):
        @api.endpoint
        async def ping(self, payload: Any) -> Any:
            return payload

    return AsyncEcho


def define_actors(api: Any) -> type:
    """The benchmark actor, built on whichever Monarch-compatible module `api` is."""

    class Echo(api.Actor):
        def __init__(self) -> None:
            self.count_seen = 0

        @api.endpoint
        def ping(self, payload: Any) -> Any:
            return payload

        @api.endpoint
        def incr(self) -> None:
            self.count_seen += 1

        @api.endpoint
        def count(self) -> int:
            return self.count_seen

        @api.endpoint
        def nbytes(self, array: Any) -> int:
            # works for torch tensors and numpy arrays alike
            return int(array.nbytes)

    return Echo


def stop_mesh(mesh: Any) -> None:
    """Stop a proc mesh, tolerating either a Future-returning or a plain `stop()`."""
    with contextlib.suppress(Exception):  # a mesh that fails to stop must not end the benchmark run
        fut = mesh.stop()
        if hasattr(fut, "get"):
            fut.get(timeout=GET_TIMEOUT_S)


def install_fault_hook(api: Any, faults: list[str]) -> None:
    """Record unhandled mesh failures instead of exiting (the default hook exits the client with code 1).

    A failed measure then raises SupervisionError in its own calls, is recorded as an error, and the other
    measures (and the other runtimes' results) survive. Same hook for Monarch and Regent.
    """

    def hook(failure: Any) -> None:
        faults.append(str(failure))
        log(f"unhandled fault (recorded, benchmark continues): {failure}")

    api.unhandled_fault_hook = hook


def run_measures(api: Any, quick: bool = False, only: set[str] | None = None) -> dict[str, Any]:
    """Every actor measure of the benchmark (or those in `only`), against the Monarch-compatible `api`."""
    faults: list[str] = []
    install_fault_hook(api, faults)
    try:
        results = _run_measures(api, quick, only)
    except BaseException as exc:  # e.g. the mesh for every measure failed to start
        if isinstance(exc, KeyboardInterrupt):
            raise
        log(f"measures aborted: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        results = {"aborted": {"error": f"{type(exc).__name__}: {exc}"}}
    if faults:
        results["unhandled_faults"] = faults
    return results


def _run_measures(api: Any, quick: bool, only: set[str] | None) -> dict[str, Any]:
    c = counts(quick)
    echo_cls = define_actors(api)
    results: dict[str, Any] = {}
    host = api.this_host()

    procs1 = host.spawn_procs(per_host={"gpus": 1})
    one = procs1.spawn("echo", echo_cls)
    one.ping.call_one(0).get(timeout=GET_TIMEOUT_S)  # the mesh is up before anything is timed

    def call_one_rtt() -> dict[str, float]:
        samples = timed_calls(lambda: one.ping.call_one(SMALL_PAYLOAD).get(timeout=GET_TIMEOUT_S),
                              c["warmup"], c["rtt"])
        return latency_stats(samples)

    guarded(results, "call_one", call_one_rtt, only)

    def call_one_async_rtt() -> dict[str, float]:
        procs = host.spawn_procs(per_host={"gpus": 1})
        try:
            aecho = procs.spawn("aecho", define_async_actor(api))
            aecho.ping.call_one(0).get(timeout=GET_TIMEOUT_S)
            samples = timed_calls(lambda: aecho.ping.call_one(SMALL_PAYLOAD).get(timeout=GET_TIMEOUT_S),
                                  c["warmup"], c["rtt"] // 2)
            return latency_stats(samples)
        finally:
            stop_mesh(procs)

    guarded(results, "call_one_async", call_one_async_rtt, only)

    def call_one_awaited_rtt() -> dict[str, float]:
        async def calls() -> list[float]:
            for _ in range(c["warmup"]):
                await one.ping.call_one(SMALL_PAYLOAD)
            samples = []
            for _ in range(c["rtt"] // 2):
                t0 = time.perf_counter()
                await one.ping.call_one(SMALL_PAYLOAD)
                samples.append(time.perf_counter() - t0)
            return samples

        return latency_stats(asyncio.run(asyncio.wait_for(calls(), GET_TIMEOUT_S)))

    guarded(results, "call_one_awaited", call_one_awaited_rtt, only)

    def call_two_procs() -> dict[str, float]:
        procs2 = host.spawn_procs(per_host={"gpus": 2})
        try:
            two = procs2.spawn("echo2", echo_cls)
            two.ping.call(0).get(timeout=GET_TIMEOUT_S)
            samples = timed_calls(lambda: two.ping.call(SMALL_PAYLOAD).get(timeout=GET_TIMEOUT_S),
                                  c["warmup"], c["rtt"] // 2)
            return latency_stats(samples)
        finally:
            stop_mesh(procs2)

    guarded(results, "call_2procs", call_two_procs, only)

    def pipelined() -> dict[str, Any]:
        n = c["pipelined"]
        rates = []
        for _ in range(c["pipelined_rounds"]):
            t0 = time.perf_counter()
            futures = [one.ping.call_one(SMALL_PAYLOAD) for _ in range(n)]
            for fut in futures:
                fut.get(timeout=GET_TIMEOUT_S)
            rates.append(n / (time.perf_counter() - t0))
        return {**rate_stats(rates), "in_flight": n}

    guarded(results, "pipelined", pipelined, only)

    def broadcast() -> dict[str, Any]:
        n = c["broadcast"]
        rates = []
        for _ in range(c["broadcast_rounds"]):
            before = one.count.call_one().get(timeout=GET_TIMEOUT_S)
            t0 = time.perf_counter()
            for _ in range(n):
                one.incr.broadcast()
            after = one.count.call_one().get(timeout=GET_TIMEOUT_S)  # per-sender FIFO: flushes the broadcasts
            elapsed = time.perf_counter() - t0
            if after - before != n:
                raise RuntimeError(f"broadcast lost messages: sent {n}, actor counted {after - before}")
            rates.append(n / elapsed)
        return {**rate_stats(rates), "messages": n}

    guarded(results, "broadcast", broadcast, only)

    def big_argument(make: Callable[[], Any]) -> Callable[[], dict[str, Any]]:
        def measure() -> dict[str, Any]:
            array = make()
            got = one.nbytes.call_one(array).get(timeout=GET_TIMEOUT_S)  # warm-up, and a correctness check
            if got != TENSOR_BYTES:
                raise RuntimeError(f"actor saw {got} bytes, expected {TENSOR_BYTES}")
            rates = []
            for _ in range(c["tensor_rounds"]):
                t0 = time.perf_counter()
                one.nbytes.call_one(array).get(timeout=GET_TIMEOUT_S)
                rates.append(TENSOR_BYTES / (time.perf_counter() - t0) / 1e9)
            return {**rate_stats(rates), "bytes": TENSOR_BYTES}

        return measure

    guarded(results, "tensor_100mb", big_argument(make_tensor), only)
    guarded(results, "ndarray_100mb", big_argument(make_ndarray), only)
    stop_mesh(procs1)

    def spawn8() -> dict[str, Any]:
        times = []
        for _ in range(c["spawn_rounds"]):
            t0 = time.perf_counter()
            procs8 = host.spawn_procs(per_host={"gpus": 8})
            mesh8 = procs8.spawn("cold", echo_cls)
            replies = mesh8.ping.call(1).get(timeout=GET_TIMEOUT_S)
            times.append(time.perf_counter() - t0)
            if len(list(replies.values())) != 8:
                raise RuntimeError("an 8-process mesh did not give 8 replies")
            stop_mesh(procs8)
        return {"median_s": statistics.median(times), "rounds": times}

    guarded(results, "spawn8_first_reply", spawn8, only)
    return results
