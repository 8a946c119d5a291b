"""The floor under a `call()` to many sync actors: waking one OS thread per actor, with no actor runtime at all.

Regent gives every sync actor a thread of its own (Monarch's semantics: an actor's thread-local state lasts across
its endpoints, and actors of one process run concurrently, so one may block on another). A call to 1,024 sync
actors therefore wakes 1,024 threads, whatever the messaging does. This benchmark measures what those wake-ups
cost on this machine by themselves, so the actor runtime's figures (`actor_scale_bench.py`) can be read against
them.

P processes (fresh interpreters, as Regent's procs are), each with T threads asleep on a `queue.SimpleQueue`
(Regent's hand-off). Per round the parent writes one byte to every process (a socketpair each). Modes:
  threads - the process's main thread, blocked in `recv`, puts one token per thread; each thread wakes, does the
            `--work`, adds itself to a list under a lock, and the last one writes the reply byte;
  loop    - as Regent's procs: the main thread runs an event loop (uvloop when installed) that reads the socket
            and puts the tokens; the last thread hands the reply to the loop (`call_soon_threadsafe`);
  inline  - no threads: the main thread does the T pieces of work itself, as an async actor's process does.
The parent waits for all P replies. Everything is plain Python doing less than any actor runtime does per message,
so the times are lower bounds. `--work N` adds N units of per-message work (unpickle the arguments, look the
endpoint up, pickle the result) to show how work on a woken thread costs more at scale than the same work done
in a row on one thread.

    .venv/bin/python benchmarks/thread_wake_floor.py [--layouts 128x8,32x32,16x64,1x64] [--rounds 40] [--work 0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import queue
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

_ARGS = pickle.dumps(((7,), {}), 5)
_TABLE = {f"endpoint{j}": j for j in range(32)}


def unit_work(i: int, units: int) -> None:
    """What an actor runtime does per message besides the hand-off, roughly: unpickle the arguments, look the
    endpoint up, pickle the result (`--work` units of it)."""
    for _ in range(units):
        args, _kwargs = pickle.loads(_ARGS)
        _TABLE.get("endpoint3")
        pickle.dumps(args[0] + i, 5)


def _woken_thread(tokens: queue.SimpleQueue, i: int, units: int, lock: threading.Lock, done: list[int], n: int,
                  reply: Callable[[], None]) -> None:
    """One actor's thread: per token, its work; the last of the round's T threads sends the reply."""
    while True:
        if tokens.get() is None:
            return
        unit_work(i, units)
        with lock:
            done.append(i + 1)
            last = len(done) == n
        if last:
            done.clear()
            reply()


def child(sock: socket.socket, threads: int, mode: str, units: int) -> None:
    """One process: T threads woken per round (`threads`, `loop`), or T bits of work on the main thread (`inline`)."""
    inline = mode == "inline"
    n = threads
    lock = threading.Lock()
    done: list[int] = []
    if mode == "loop":
        _loop_child(sock, n, units)
        return

    def reply() -> None:
        sock.sendall(b"r")

    def run(tokens: queue.SimpleQueue, i: int) -> None:
        _woken_thread(tokens, i, units, lock, done, n, reply)

    queues = []
    if not inline:
        for i in range(n):
            q: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=run, args=(q, i), daemon=True).start()
            queues.append(q)
    sock.sendall(b"u")  # up
    while True:
        data = sock.recv(1)
        if not data or data == b"x":
            for q in queues:
                q.put(None)
            return
        if inline:
            total = 0
            for i in range(n):
                unit_work(i, units)
                with lock:
                    total += i + 1
            reply()
        else:
            for q in queues:
                q.put(1)


def _loop_child(sock: socket.socket, n: int, units: int) -> None:
    """As Regent's procs: the main thread runs an event loop (uvloop when installed) that reads the socket and
    puts the tokens; the last thread hands the reply to the loop (`call_soon_threadsafe`), which writes it."""
    import asyncio

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    lock = threading.Lock()
    done: list[int] = []
    queues: list[queue.SimpleQueue] = []
    sock.setblocking(False)

    def write_reply() -> None:
        sock.send(b"r")

    def run(tokens: queue.SimpleQueue, i: int) -> None:
        _woken_thread(tokens, i, units, lock, done, n, lambda: loop.call_soon_threadsafe(write_reply))

    for i in range(n):
        q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=run, args=(q, i), daemon=True).start()
        queues.append(q)

    def readable() -> None:
        data = sock.recv(1)
        if not data or data == b"x":
            for q in queues:
                q.put(None)
            loop.stop()
            return
        for q in queues:
            q.put(1)

    loop.add_reader(sock.fileno(), readable)
    sock.send(b"u")
    loop.run_forever()


def measure(procs: int, threads: int, rounds: int, mode: str, start: str, units: int) -> dict[str, float]:
    ctx = mp.get_context(start)
    pairs = [socket.socketpair() for _ in range(procs)]
    workers = []
    for _parent_end, child_end in pairs:
        p = ctx.Process(target=child, args=(child_end, threads, mode, units), daemon=True)
        p.start()
        child_end.close()
        workers.append(p)
    socks = [p for p, _ in pairs]
    for s in socks:
        assert s.recv(1) == b"u"
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    cpu0 = _children_cpu([p.pid for p in workers])
    samples = []
    for r in range(rounds + 5):
        t0 = time.perf_counter()
        for s in socks:
            s.sendall(b"g")
        left = procs
        while left:
            for key, _ in sel.select():
                key.fileobj.recv(1)
                left -= 1
        if r >= 5:
            samples.append(time.perf_counter() - t0)
    cpu1 = _children_cpu([p.pid for p in workers])
    for s in socks:
        s.sendall(b"x")
    for p in workers:
        p.join(timeout=10)
    for s in socks:
        s.close()
    samples.sort()
    return {"median_ms": 1000 * statistics.median(samples), "p90_ms": 1000 * samples[int(0.9 * (len(samples) - 1))],
            "procs_cpu_ms_per_round": 1000 * (cpu1 - cpu0) / (rounds + 5)}


def _children_cpu(pids: list[int]) -> float:
    """Seconds of CPU (user + system) the processes `pids` have used."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


MODES = ("threads", "loop", "inline")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="128x8,64x16,32x32,16x64,1x8",
                    help="comma-separated PROCSxTHREADS (threads per process = sync actors per process)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--start", choices=("spawn", "fork"), default="spawn",
                    help="spawn: a fresh interpreter per process, as Regent's procs are (default); fork: copies")
    ap.add_argument("--work", type=int, default=0,
                    help="units of per-message Python work (unpickle, look up, pickle) done on each woken thread, or "
                         "by the main thread in `inline` (default 0: the bare hand-off)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "thread_wake_floor.json"))
    args = ap.parse_args(argv)
    rows = []
    for layout in args.layouts.split(","):
        procs, threads = (int(x) for x in layout.lower().split("x"))
        if procs < 1 or threads < 1:
            raise SystemExit(f"bad layout {layout!r}: want PROCSxTHREADS, both >= 1")
        row = {"procs": procs, "threads_per_proc": threads, "threads": procs * threads}
        for mode in MODES:
            row[mode] = measure(procs, threads, args.rounds, mode, args.start, args.work)
        rows.append(row)
        print(f"{procs:4d} procs x {threads:3d}: " + ", ".join(
            f"{m} {row[m]['median_ms']:.1f} ms (procs CPU {row[m]['procs_cpu_ms_per_round']:.1f})" for m in MODES),
            flush=True)
    print("\n| procs x threads | " + " | ".join(f"{m}: median / p90 ms (procs' CPU)" for m in MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for r in rows:
        print(f"| {r['procs']} x {r['threads_per_proc']} | " + " | ".join(
            f"{r[m]['median_ms']:.1f} / {r[m]['p90_ms']:.1f} ({r[m]['procs_cpu_ms_per_round']:.1f})" for m in MODES)
            + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpus": os.cpu_count(), "rounds": args.rounds, "start": args.start, "work": args.work,
                               "rows": rows},
                              indent=2))


if __name__ == "__main__":
    main()
