"""A tiny fault-tolerant trainer process used by the Manager tests (one process per replica x group rank).

It trains a small Linear model with per-(replica, step) data, averages gradients through the Manager, and
records, after each committed step, a hash of its parameters and optimizer state into a JSON-lines file.
Faults are injected by flags: crash at a step, abort the replicated group before an allreduce.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import zlib

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from regent.ft.manager import Manager
from regent.ft.transfer import StreamTransport


def state_hash(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--group-rank", type=int, default=0)
    ap.add_argument("--group-world-size", type=int, default=1)
    ap.add_argument("--store-port", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--abort-at", type=int, default=-1)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--no-init-sync", action="store_true")
    ap.add_argument("--transport", default="group")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument(
        "--until-participants", type=int, default=0,
        help="after --steps, keep going until 3 consecutive commits had this many participants",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"[{args.name}/{args.group_rank}] %(name)s %(message)s")

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    out = open(args.out, "a", buffering=1)  # noqa: SIM115 (kept open for the whole run; closed at the end)

    def record(kind: str, details: dict) -> None:
        out.write(json.dumps({"kind": kind, **{k: v for k, v in details.items() if k != "replica_id"}}) + "\n")

    transport = StreamTransport(num_chunks=3, timeout=args.timeout) if args.transport == "tcp" else None
    manager = Manager(
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        min_replica_size=args.min_replica_size,
        use_async_quorum=not args.sync,
        timeout=args.timeout,
        quorum_timeout=60,
        connect_timeout=20,
        group_rank=args.group_rank,
        group_world_size=args.group_world_size,
        store_port=args.store_port,
        lighthouse_addr=args.lighthouse,
        replica_id=args.name,
        init_sync=not args.no_init_sync,
        transport=transport,
        on_event=record,
    )
    # The target: y = sum(x) with a per-group-rank twist so ranks differ.
    streak = 0
    while manager.current_step() < args.steps or (args.until_participants and streak < 3):
        step = manager.current_step()
        if 0 <= args.crash_at <= step:  # >=: a late joiner may heal straight past the crash step
            record("crash", {"step": step})
            os._exit(3)
        manager.start_quorum()
        gen = torch.Generator().manual_seed(1000 * step + 7 * args.group_rank + zlib.crc32(args.name.encode()) % 97)
        x = torch.randn(32, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True) * (1 + args.group_rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == args.abort_at and manager.replica_rank() == 0:
            args.abort_at = -1
            record("inject_abort", {"step": step})
            manager.pg.abort(RuntimeError("injected fault: replicated group aborted"))
        futures = [manager.allreduce(p.grad) for p in model.parameters()]
        for f in futures:
            f.wait()
        if manager.should_commit():
            opt.step()
            streak = streak + 1 if manager.num_participants() >= args.until_participants else 0
            record(
                "state",
                {
                    "step": manager.current_step(),
                    "hash": state_hash(model, opt),
                    "loss": loss.item(),
                    "participants": manager.num_participants(),
                },
            )
        if args.sleep:
            time.sleep(args.sleep)
    record("done", {"step": manager.current_step()})
    manager.shutdown()
    out.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
