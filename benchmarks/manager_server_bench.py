"""ManagerServer call cost: one `ShouldCommit` round trip from TorchFT's `ManagerClient` (a group rank other than 0
calls the ManagerServer of its group over gRPC once per step; rank 0 calls it in process).

    PYTHONPATH=src .venv/bin/python benchmarks/manager_server_bench.py
    PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/manager_server_bench.py   # another tree, same way

Client and server share this process (as a group's ranks share a host, not a process; here the CPU figure
counts both ends). Reported: median wall time per call over `--rounds` rounds of `--calls` calls, and the
process's CPU per call. No secret, no TLS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from regent.ft import manager_server
    from regent.ft.coordination import LighthouseServer, ManagerClient, ManagerServer
    from regent.ft.rpc_security import TLSFiles

    lh = LighthouseServer(min_replicas=1, secret=b"", tls=TLSFiles())
    mgr = ManagerServer("bench", lh.address(), "127.0.0.1", store_address="127.0.0.1:1", world_size=1,
                        heartbeat_interval=1.0, secret=b"", tls=TLSFiles())
    client = ManagerClient(mgr.address(), connect_timeout=10, secret=b"", tls=TLSFiles())
    try:
        for step in range(200):
            client.should_commit(0, step, True, timeout=5)
        wall, cpu = [], []
        step = 200
        for _ in range(args.rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                client.should_commit(0, step, True, timeout=5)
                step += 1
            wall.append((time.perf_counter() - t0) / args.calls * 1e6)
            cpu.append((time.process_time() - c0) / args.calls * 1e6)
    finally:
        client.close()
        mgr.shutdown()
        lh.shutdown()
    row = {"server": manager_server.__file__, "calls": args.calls * args.rounds,
           "us_per_call_median": round(statistics.median(wall), 1), "cpu_us_per_call_median": round(statistics.median(cpu), 1)}
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
