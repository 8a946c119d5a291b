"""Manual GPU check (2 GPUs, run through the device tool): the NCCL replicated group aborts a hung allreduce
within its timeout and the next configure works. Prints each stage; dumps stacks if anything hangs."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import socket
import sys
import time
from datetime import timedelta


def rank_main(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from regent.ft.process_group import ReplicatedGroup

    faulthandler.dump_traceback_later(90, exit=True)
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=60))
    group = ReplicatedGroup("nccl", timeout=5, connect_timeout=60)
    group.configure(f"127.0.0.1:{port}/check/1/0", f"r{rank}", rank, 2)
    t = torch.ones(4, device="cuda")
    group.allreduce(t).wait()
    torch.cuda.synchronize()
    print(rank, "first allreduce", t.tolist(), flush=True)
    if rank == 0:
        start = time.perf_counter()
        try:
            group.allreduce(torch.ones(4, device="cuda")).wait()
            print(rank, "hung allreduce returned?!", flush=True)
        except Exception as err:  # noqa: BLE001 - reported: printed, the test reads it
            print(rank, f"hung allreduce failed after {time.perf_counter() - start:.2f}s: {type(err).__name__}: {err}",
                  flush=True)
        print(rank, "errored:", group.errored() is not None, flush=True)
        time.sleep(2)
        print(rank, "abort thread done; reconfiguring", flush=True)
    else:
        time.sleep(12)
    group.configure(f"127.0.0.1:{port}/check/2/0", f"r{rank}", rank, 2)
    print(rank, "reconfigured", flush=True)
    t = torch.full((4,), float(rank + 1), device="cuda")
    group.allreduce(t).wait()
    torch.cuda.synchronize()
    print(rank, "after reconfigure", t.tolist(), flush=True)
    group.shutdown()
    del store


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    print("exit codes", [p.exitcode for p in procs])
    sys.exit(0 if all(p.exitcode == 0 for p in procs) else 1)
