"""How long starting one child blocks the event loop, as the parent's memory grows.

Regent's procs used to be started with uvloop's `subprocess_exec` (libuv `fork()`, which copies the parent's
page tables and runs its after-fork hooks in the child). They are now started by `regent.actor._child_process`
(CPython's `subprocess.Popen`, vfork, no Python in the child). This measures, for a parent holding 0.1-8 GiB of
touched memory, the wall time of one `await` that starts `/bin/true` (the loop is blocked for most of it), and
counts the after-fork hooks that ran in children. Anchor: asyncio's own loop with `create_subprocess_exec`.

    .venv/bin/python benchmarks/spawn_child_bench.py [--sizes-gib 0.1,2,8] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from regent.actor._child_process import start_child


def _hook_counter(path: str):
    def hook() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(fd, b"x")
        os.close(fd)
    return hook


async def _time_starts(kind: str, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if kind == "regent":
            child = await start_child("/bin/true", ["/bin/true"], dict(os.environ))
            times.append(time.perf_counter() - t0)
            await child.wait()
        else:
            proc = await asyncio.create_subprocess_exec("/bin/true", stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            times.append(time.perf_counter() - t0)
            await proc.wait()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gib", default="0.1,2,8")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    import uvloop

    marker = tempfile.mktemp(prefix="regent-atfork-")
    os.register_at_fork(after_in_child=_hook_counter(marker))
    loops = {"uvloop subprocess_exec (old)": uvloop.new_event_loop,
             "asyncio subprocess_exec (anchor)": asyncio.new_event_loop,
             "regent start_child (uvloop)": uvloop.new_event_loop}
    print(f"# {sys.version.split()[0]}, {os.cpu_count()} CPUs; median / p90 ms per start of /bin/true; "
          f"hooks = after-fork hooks that ran in children")
    print("| parent memory | " + " | ".join(loops) + " |")
    print("|---:|" + "---|" * len(loops))
    ballast: list[np.ndarray] = []
    for size in [float(s) for s in args.sizes_gib.split(",")]:
        ballast.clear()
        ballast.append(np.ones(int(size * 2**30 // 8), dtype=np.float64))  # touched: every page mapped
        cells = []
        for name, make in loops.items():
            if os.path.exists(marker):
                os.unlink(marker)
            loop = make()
            try:
                kind = "regent" if name.startswith("regent") else "exec"
                times = loop.run_until_complete(_time_starts(kind, args.rounds))
            finally:
                loop.close()
            hooks = os.path.getsize(marker) if os.path.exists(marker) else 0
            ms = sorted(t * 1e3 for t in times)
            cells.append(f"{statistics.median(ms):.2f} / {ms[int(0.9 * (len(ms) - 1))]:.2f} (hooks {hooks})")
        print(f"| {size:g} GiB | " + " | ".join(cells) + " |", flush=True)
    if os.path.exists(marker):
        os.unlink(marker)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
