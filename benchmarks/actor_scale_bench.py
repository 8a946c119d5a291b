"""Actor meshes at scale: `call()` latency from 8 to 1,024 actors over simulated hosts, tree fan-out against
flat sends, spawn time over 1, 4 and 16 hosts, and memory (issue 17, "Actor meshes").

    .venv/bin/python benchmarks/actor_scale_bench.py [--hosts 8 --procs 16 --actors 8] [--rounds 40] [--async-actors | --shared-sync]
        [--spawn-hosts 1,4,16] [--skip-calls] [--skip-spawn] [--monarch /work/benchvenv/bin/python]

Hosts are local `regent worker` processes (`ProcessJob`), each the parent of its procs, as on a real cluster.
1,024 actors are 8 hosts x 16 procs x 8 actors per proc (`ProcMesh.colocated`); the smaller sizes are slices of
the same mesh, spread over every host: 8 = one actor per host, 64 = one per proc of 8 per host, 256 = 2 per
proc. Each size is timed in three send modes (`Runtime.cast_mode`):
  tree  - one message per host agent, which forwards to its procs; replies gathered per proc and per host;
  proc  - one message per process straight from the caller; replies gathered per proc;
  actor - one message per actor and one reply per actor (the runtime's design before tree casts).
Spawn: `spawn_procs` over H hosts with P procs each, cold (new Python processes) and warm (claiming the workers'
`keep_warm` spares), then an actor mesh on them; the controller's exchanges are counted (`Runtime.stats`).
Memory: resident set size of every process of the job (controller, workers, procs), from /proc.
`--monarch PY` runs the same call() measure against Monarch (one actor per proc on this host, which is the
only placement its API offers) under the interpreter PY of a separate venv; one JSON line comes back.
Everything is also written to benchmarks/results/actor_scale_bench.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_mb(pids: list[int]) -> float:
    """Sum of resident memory of `pids` (MiB), from /proc; processes that are gone count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def wait_spares_ready(workers: list[int], per_host: int, timeout: float = 600.0) -> None:
    """Until every worker has `per_host` spare children and they stopped using CPU (imports done)."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        kids = [c for w in workers for c in children_of(w)]
        ticks = cpu_ticks(kids)
        if len(kids) >= per_host * len(workers) and ticks == last:
            return
        last = ticks if len(kids) >= per_host * len(workers) else -1
        time.sleep(1.0)


def lat(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
            "min_ms": ordered[0] * 1e3, "n": len(ordered)}


def define_actor(api: Any, is_async: bool = False) -> type:
    """A no-op endpoint; sync actors run on a thread of their own, async ones on their process's loop."""
    if is_async:
        class AsyncMember(api.Actor):
            @api.endpoint
            async def ping(self, x: int) -> int:
                return x

        return AsyncMember

    class Member(api.Actor):
        @api.endpoint
        def ping(self, x: int) -> int:
            return x

    return Member


def time_calls(mesh: Any, rounds: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        mesh.ping.call(0).get(timeout=120)
    out = []
    for i in range(rounds):
        t0 = time.perf_counter()
        vm = mesh.ping.call(i).get(timeout=120)
        out.append(time.perf_counter() - t0)
        assert len(vm) == len(mesh)
    return out


def bench_calls(hosts: int, procs: int, actors: int, rounds: int, is_async: bool = False,
                shared_sync: bool = False) -> dict[str, Any]:
    """call() latency by mesh size and send mode, on one job of `hosts` x `procs` x `actors`. `shared_sync`:
    the sync actors of a proc share one thread (`config.shared_asyncio_runtime`, Monarch's knob)."""
    import regent.actor as api
    from regent.actor._process import get_runtime
    from regent.jobs.local import ProcessJob

    api.config.configure(shared_asyncio_runtime=shared_sync)  # the procs started below inherit it
    rt = get_runtime()
    t0 = time.perf_counter()
    job = ProcessJob(hosts=hosts)
    try:
        hm = job.host_mesh()
        pm = hm.spawn_procs(per_host={"procs": procs})
        pm.initialized.get(timeout=600)
        t_procs = time.perf_counter() - t0
        mesh = pm.colocated("actors", actors).spawn("members", define_actor(api, is_async))
        mesh.initialized.get(timeout=600)
        log(f"job up: {hosts} hosts x {procs} procs x {actors} actors in {time.perf_counter() - t0:.1f} s")
        workers = job.worker_pids()
        proc_pids = [c for w in workers for c in children_of(w)]
        memory = {"controller_mb": rss_mb([os.getpid()]), "workers_mb": rss_mb(workers),
                  "procs_mb": rss_mb(proc_pids), "n_procs": len(proc_pids)}
        memory["total_mb"] = memory["controller_mb"] + memory["workers_mb"] + memory["procs_mb"]
        memory["per_proc_mb"] = memory["procs_mb"] / max(1, len(proc_pids))
        log(f"memory: {memory}")
        if (hosts, procs, actors) == (8, 16, 8):  # the sizes, each spread over all 8 hosts
            sizes = {8: mesh.slice(procs=0, actors=0), 64: mesh.slice(procs=slice(0, 8), actors=0),
                     256: mesh.slice(actors=slice(0, 2)), 1024: mesh}
        else:  # one actor per host, one per proc, all
            sizes = {hosts: mesh.slice(procs=0, actors=0), hosts * procs: mesh.slice(actors=0), len(mesh): mesh}
        rows = []
        for n, view in sizes.items():
            assert len(view) == n, (n, len(view))
            for mode in ("tree", "proc", "actor"):
                rt.cast_mode = mode
                before = rt.stats.copy()
                samples = time_calls(view, rounds)
                after = rt.stats.copy()
                after.subtract(before)
                calls = rounds + 5
                msgs = (after["cast_sent"] + after["m_sent"]) / calls
                replies = after["reply_batches"] / calls
                row = {"actors": n, "mode": mode, **lat(samples), "msgs_per_call": msgs,
                       "reply_batches_per_call": replies}
                rows.append(row)
                log(f"{n:5d} actors {mode:5s}: median {row['median_ms']:.2f} ms p90 {row['p90_ms']:.2f} ms, "
                    f"{msgs:.0f} msgs sent/call, {replies:.0f} gathered replies/call")
        rt.cast_mode = "tree"
        pm.stop().get(timeout=120)
        return {"hosts": hosts, "procs": procs, "actors": actors, "async": is_async, "shared_sync": shared_sync,
                "setup_s": t_procs,
                "memory": memory, "rows": rows}
    finally:
        rt.cast_mode = "tree"
        job.kill()


def bench_spawn(host_counts: list[int], procs: int, warm: bool) -> list[dict[str, Any]]:
    """Time of spawn_procs (+ an actor mesh on them) over H hosts of `procs` procs each."""
    import regent.actor as api
    from regent.actor._process import get_runtime
    from regent.jobs.local import ProcessJob

    rt = get_runtime()
    out = []
    Member = define_actor(api)
    for hosts in host_counts:
        job = ProcessJob(hosts=hosts)
        try:
            hm = job.host_mesh()
            hm.initialized.get(timeout=600)
            if warm:
                # refills start a minute later, so they do not compete with the spawn being measured
                hm.keep_warm(procs, refill_delay_s=60.0).get(timeout=60)
                wait_spares_ready(job.worker_pids(), procs)
            before = rt.stats.copy()
            t0 = time.perf_counter()
            pm = hm.spawn_procs(per_host={"procs": procs})
            pm.initialized.get(timeout=600)
            t_procs = time.perf_counter() - t0
            mesh = pm.spawn("m", Member)
            mesh.initialized.get(timeout=600)
            mesh.ping.call(0).get(timeout=120)
            t_all = time.perf_counter() - t0
            after = rt.stats.copy()
            after.subtract(before)
            row = {"hosts": hosts, "procs_per_host": procs, "warm": warm, "spawn_procs_s": t_procs,
                   "with_actors_s": t_all, "host_exchanges": after["host_spawn_sent"]}
            out.append(row)
            log(f"spawn {'warm' if warm else 'cold'} {hosts:2d} hosts x {procs}: procs {t_procs:.2f} s, "
                f"+actors+call {t_all:.2f} s, {after['host_spawn_sent']} host exchanges")
            pm.stop().get(timeout=120)
        finally:
            job.kill()
    return out


MONARCH_SNIPPET = r"""
import json, statistics, sys, time, os
import monarch.actor as api
n_list = [int(x) for x in sys.argv[1].split(",")]
rounds = int(sys.argv[2])
class Member(api.Actor):
    @api.endpoint
    def ping(self, x: int) -> int:
        return x
def tree_rss_mb(root):
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo += [int(p) for p in f.read().split()]
            with open(f"/proc/{pid}/status") as f:
                total += next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024
out = []
for n in n_list:
    t0 = time.perf_counter()
    pm = api.this_host().spawn_procs(per_host={"gpus": n})
    mesh = pm.spawn("m", Member)
    mesh.ping.call(0).get()
    spawn_s = time.perf_counter() - t0
    for _ in range(5):
        mesh.ping.call(0).get()
    s = []
    for i in range(rounds):
        t = time.perf_counter(); mesh.ping.call(i).get(); s.append(time.perf_counter() - t)
    s.sort()
    out.append({"actors": n, "median_ms": statistics.median(s) * 1e3, "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3,
                "spawn_s": spawn_s, "rss_mb": tree_rss_mb(os.getpid())})
    print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    pm.stop().get()
sys.stdout.write(json.dumps(out) + "\n"); sys.stdout.flush()
os._exit(0)
"""


def bench_monarch(python: str, sizes: list[int], rounds: int) -> dict[str, Any]:
    """Monarch's call() at `sizes` actors (one per proc, this host), in its own venv."""
    if not Path(python).exists():
        return {"error": f"{python} does not exist"}
    # Monarch gives up on a proc mesh whose procs are not all up within 30 s, which 32 cold procs on 2 busy
    # cores exceed; the same budget Regent's spawn gets (REGENT_SPAWN_TIMEOUT, 60 s) and more
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE": "300s",
           "HYPERACTOR_MESH_ACTOR_SPAWN_MAX_IDLE": "300s", "HYPERACTOR_MESH_ATTACH_CONFIG_TIMEOUT": "300s"}
    try:
        proc = subprocess.run([python, "-c", MONARCH_SNIPPET, ",".join(map(str, sizes)), str(rounds)], env=env,
                              cwd="/tmp", stdout=subprocess.PIPE, stderr=None, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    if not lines:
        return {"error": f"no result (exit code {proc.returncode})"}
    return {"rows": json.loads(lines[-1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--procs", type=int, default=16)
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--spawn-hosts", default="1,4,16")
    parser.add_argument("--spawn-procs", default="1,4", help="procs per host in the spawn measure (list)")
    parser.add_argument("--skip-calls", action="store_true")
    parser.add_argument("--async-actors", action="store_true", help="async endpoints (no thread per actor)")
    parser.add_argument("--shared-sync", action="store_true",
                        help="sync actors of a proc share one thread (config.shared_asyncio_runtime)")
    parser.add_argument("--skip-spawn", action="store_true")
    parser.add_argument("--monarch", default=None, help="python of a venv with torchmonarch")
    parser.add_argument("--monarch-sizes", default="8,32,64")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "actor_scale_bench.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "cpus": os.cpu_count(), "argv": sys.argv}
    if not args.skip_calls:
        result["calls"] = bench_calls(args.hosts, args.procs, args.actors, args.rounds, args.async_actors,
                                      args.shared_sync)
    if not args.skip_spawn:
        counts = [int(h) for h in args.spawn_hosts.split(",") if h]
        result["spawn"] = []
        for per_host in [int(p) for p in args.spawn_procs.split(",") if p]:
            for warm in (False, True):
                result["spawn"] += bench_spawn(counts, per_host, warm=warm)
    if args.monarch:
        result["monarch"] = bench_monarch(args.monarch, [int(x) for x in args.monarch_sizes.split(",")], args.rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_tables(result)


def print_tables(result: dict[str, Any]) -> None:
    calls = result.get("calls")
    if calls:
        kind = "async" if calls.get("async") else ("sync (shared thread)" if calls.get("shared_sync") else "sync")
        print(f"\ncall() latency, {calls['hosts']} hosts x {calls['procs']} procs x {calls['actors']} {kind} actors/proc "
              "(median / p90 ms; messages sent by the caller per call)")
        print("| actors | tree | proc (flat per process) | actor (flat per actor, old) |")
        print("|---:|---|---|---|")
        by = {(r["actors"], r["mode"]): r for r in calls["rows"]}
        for n in sorted({r["actors"] for r in calls["rows"]}):
            cells = []
            for mode in ("tree", "proc", "actor"):
                r = by.get((n, mode))
                cells.append("-" if r is None else
                             f"{r['median_ms']:.1f} / {r['p90_ms']:.1f} ({r['msgs_per_call']:.0f} msgs)")
            print(f"| {n} | " + " | ".join(cells) + " |")
        m = calls["memory"]
        print(f"\nmemory: {m['total_mb']:.0f} MiB total; controller {m['controller_mb']:.0f}, workers "
              f"{m['workers_mb']:.0f}, {m['n_procs']} procs {m['procs_mb']:.0f} ({m['per_proc_mb']:.1f} each)")
    spawn = result.get("spawn")
    if spawn:
        print("\n| hosts | procs/host | start | spawn_procs (s) | + actor mesh + call (s) | host exchanges |")
        print("|---:|---:|---|---:|---:|---:|")
        for r in spawn:
            print(f"| {r['hosts']} | {r['procs_per_host']} | {'warm' if r['warm'] else 'cold'} | "
                  f"{r['spawn_procs_s']:.2f} | {r['with_actors_s']:.2f} | {r['host_exchanges']} |")
    mon = result.get("monarch")
    if mon:
        if "error" in mon:
            print(f"\nMonarch: {mon['error']}")
        else:
            print("\nMonarch (one actor per proc, this host): " + ", ".join(
                f"{r['actors']} actors {r['median_ms']:.1f} ms (p90 {r['p90_ms']:.1f}, spawn {r['spawn_s']:.1f} s, "
                f"{r.get('rss_mb', 0):.0f} MiB)"
                for r in mon["rows"]))


if __name__ == "__main__":
    main()
