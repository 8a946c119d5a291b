"""CPU time per actor message, the whole job counted: for comparing two versions of the runtime on a loaded box.

    .venv/bin/python benchmarks/actor_cpu_bench.py [--calls 5000] [--broadcasts 10000] [--rounds 5]

On a shared 2-core machine the wall-clock rates of `actor_bench.py` swing 2-5x with the other work, so a small
change in the runtime's cost hides in them. The CPU time the job's processes spent (this client, all its
threads, and every proc it started, from /proc, in clock ticks: 10 ms, hence the counts) moves far less with
the load: this prints it per message for
sequential `call_one`, pipelined `call_one` (10 x 1,000 in flight) and fire-and-forget `broadcast`, median of rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

TICK = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc's children lists."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue  # gone meanwhile: its time is no longer counted, for both versions alike
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system time of `pids` (all their threads), from /proc/PID/stat."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except OSError:
            continue  # gone meanwhile (see descendants)
    return total / TICK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--broadcasts", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from regent.actor import Actor, endpoint, this_host

    class Counter(Actor):
        def __init__(self) -> None:
            self.n = 0

        @endpoint
        def incr(self) -> None:
            self.n += 1

        @endpoint
        def count(self) -> int:
            return self.n

        @endpoint
        def echo(self, b: bytes) -> bytes:
            return b

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    counter = procs.spawn("counter", Counter)
    payload = b"x" * 64
    for _ in range(100):
        counter.echo.call_one(payload).get()
    pids = descendants(os.getpid())

    def sequential() -> int:
        for _ in range(args.calls):
            counter.echo.call_one(payload).get()
        return args.calls

    def pipelined() -> int:
        for _ in range(10):
            futures = [counter.echo.call_one(payload) for _ in range(1000)]
            for fut in futures:
                fut.get()
        return 10_000

    def broadcast() -> int:
        before = counter.count.call_one().get()
        for _ in range(args.broadcasts):
            counter.incr.broadcast()
        assert counter.count.call_one().get() == before + args.broadcasts
        return args.broadcasts + 2

    result = {}
    for name, fn in (("call_one", sequential), ("pipelined", pipelined), ("broadcast", broadcast)):
        per_msg = []
        for _ in range(args.rounds):
            cpu0 = cpu_seconds(pids)
            n = fn()
            per_msg.append((cpu_seconds(pids) - cpu0) / n * 1e6)
        result[name] = {"cpu_us_per_msg": statistics.median(per_msg), "rounds": per_msg}
        print(f"{name}: {statistics.median(per_msg):.1f} us CPU per message (rounds "
              f"{', '.join(f'{x:.1f}' for x in per_msg)})", flush=True)
    print(json.dumps({"loadavg": os.getloadavg(), "time": time.strftime("%H:%M:%S"), **result}))
    procs.stop().get()


if __name__ == "__main__":
    main()
