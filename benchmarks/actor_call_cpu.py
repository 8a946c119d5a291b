"""Where a `call()` over many actors spends its CPU: per call, the CPU time of the controller, the host agents
(`regent worker`) and the procs, and the procs' context switches (voluntary: a thread went to sleep; involuntary:
it was preempted).

On a machine whose cores are all busy during a call, latency is about total CPU / cores, so this says which
process class to make cheaper; the switch count says how many thread sleeps a call costs (a sync actor's thread
sleeps at least once per call: the floor is one per actor plus two per proc).

    .venv/bin/python benchmarks/actor_call_cpu.py [--hosts 8 --procs 16 --actors 8] [--seconds 10] [--async-actors | --shared-sync]

Prints one line; with --json, a JSON object. The same job layout as `actor_scale_bench.py` (local `regent worker`
hosts, `ProcMesh.colocated` actors, a no-op `ping` endpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import actor_scale_bench as bench  # the same actor and process helpers


def context_switches(pids: list[int]) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of the processes `pids`, so far."""
    vol = invol = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # exited
        for tid in tids:
            try:
                text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue  # that thread exited between the listing and the read
            for line in text.splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol += int(line.split()[1])
    return vol, invol


def measure(hosts: int, procs: int, actors: int, seconds: float, is_async: bool, shared_sync: bool = False) -> dict:
    import regent.actor as api
    from regent.jobs.local import ProcessJob

    api.config.configure(shared_asyncio_runtime=shared_sync)  # the procs started below inherit it
    job = ProcessJob(hosts=hosts)
    try:
        pm = job.host_mesh().spawn_procs(per_host={"procs": procs})
        pm.initialized.get(timeout=600)
        mesh = pm.colocated("actors", actors).spawn("members", bench.define_actor(api, is_async))
        mesh.initialized.get(timeout=600)
        workers = job.worker_pids()
        proc_pids = [c for w in workers for c in bench.children_of(w)]
        for _ in range(20):
            mesh.ping.call(0).get(timeout=120)
        me = [os.getpid()]
        tick = os.sysconf("SC_CLK_TCK")
        before = [bench.cpu_ticks(p) for p in (me, workers, proc_pids)]
        sw0 = context_switches(proc_pids)
        lat = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            mesh.ping.call(len(lat)).get(timeout=120)
            lat.append(time.perf_counter() - t)
        sw1 = context_switches(proc_pids)
        after = [bench.cpu_ticks(p) for p in (me, workers, proc_pids)]
        n = len(lat)
        cpu = [1000 * (a - b) / tick / n for a, b in zip(after, before)]
        pm.stop().get(timeout=120)
        return {"hosts": hosts, "procs": procs, "actors": actors, "async": is_async, "shared_sync": shared_sync,
                "calls": n,
                "median_ms": 1000 * sorted(lat)[n // 2], "cpu_ms_per_call": {
                    "controller": cpu[0], "workers": cpu[1], "procs": cpu[2], "total": sum(cpu)},
                "procs_switches_per_call": {"voluntary": (sw1[0] - sw0[0]) / n, "involuntary": (sw1[1] - sw0[1]) / n}}
    finally:
        job.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--actors", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--async-actors", action="store_true")
    ap.add_argument("--shared-sync", action="store_true",
                    help="sync actors of a proc share one thread (config.shared_asyncio_runtime)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if min(args.hosts, args.procs, args.actors) < 1 or args.seconds <= 0:
        raise SystemExit("--hosts, --procs and --actors must be >= 1 and --seconds > 0")
    r = measure(args.hosts, args.procs, args.actors, args.seconds, args.async_actors, args.shared_sync)
    if args.json:
        print(json.dumps(r))
        return
    c, s = r["cpu_ms_per_call"], r["procs_switches_per_call"]
    kind = "async" if r["async"] else ("sync (shared thread)" if r["shared_sync"] else "sync")
    print(f"{r['hosts']} x {r['procs']} x {r['actors']} {kind}: {r['calls']} calls, median {r['median_ms']:.2f} ms; "
          f"CPU ms per call: controller {c['controller']:.2f}, workers {c['workers']:.2f}, procs {c['procs']:.2f}, "
          f"total {c['total']:.2f}; procs' switches per call: {s['voluntary']:.0f} voluntary, "
          f"{s['involuntary']:.0f} involuntary")


if __name__ == "__main__":
    main()
