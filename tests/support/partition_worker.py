"""One replica of the partition tests (test_partitions.py): a small model trained with `regent.ft.Manager` over
Gloo, run inside a network namespace, advertising that namespace's address.

It trains until the stop file exists, then until its step reaches the number written there (so every replica
ends at one step and their states can be compared). Every Manager event and every committed step is written,
with the wall-clock time (shared by all namespaces), as a JSON line to --out; a committed step carries a hash
of the parameters and optimizer state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from ft_worker import state_hash  # the sibling worker's hash (this file runs as a script from tests/support)

from regent.ft import Manager, ProcessGroupGloo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--host", required=True, help="this namespace's address: advertised to the Lighthouse and peers")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3.0, help="collective timeout (s)")
    ap.add_argument("--quorum-timeout", type=float, default=5.0)
    ap.add_argument("--connect-timeout", type=float, default=10.0)
    ap.add_argument("--sleep", type=float, default=0.05, help="pause per step (s): keeps 3 replicas light on CPU")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{args.name}] %(name)s %(message)s")
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    out = open(args.out, "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def record(kind: str, details: dict) -> None:
        out.write(json.dumps({"t": time.time(), "kind": kind, **details}, default=str) + "\n")

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=args.timeout, connect_timeout=args.connect_timeout),
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        min_replica_size=args.min_replica_size,
        use_async_quorum=True,
        timeout=args.timeout,
        quorum_timeout=args.quorum_timeout,
        connect_timeout=args.connect_timeout,
        lighthouse_addr=args.lighthouse,
        replica_id=args.name,
        hostname=args.host,
        store_addr=args.host,
        on_event=record,
    )
    stop = Path(args.stop_file)
    record("started", {"replica_id": manager.replica_id})
    while True:
        if stop.exists() and stop.read_text().strip() and manager.current_step() >= int(stop.read_text()):
            break
        step = manager.current_step()
        manager.start_quorum()
        gen = torch.Generator().manual_seed(1000 * step + args.seed)
        x = torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        for f in [manager.allreduce(p.grad) for p in model.parameters()]:
            f.wait()
        if manager.should_commit():
            opt.step()
            record("state", {"step": manager.current_step(), "hash": state_hash(model, opt),
                             "participants": manager.num_participants()})
        time.sleep(args.sleep)
    record("done", {"step": manager.current_step(), "hash": state_hash(model, opt)})
    manager.shutdown()
    out.close()


if __name__ == "__main__":
    main()
