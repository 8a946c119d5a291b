"""A DiLoCo / Streaming DiLoCo replica process for the tests (one group rank per replica).

After every fragment sync it records the Manager step, the fragment, whether it committed, and a hash of
the global state (every fragment's last global parameters and outer optimizer state) into JSON lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
import zlib

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from regent.ft.backstop import Backstop
from regent.ft.local_sgd import DiLoCo
from regent.ft.manager import Manager, StateLostError


def global_hash(diloco: DiLoCo) -> str:
    h = hashlib.sha256()
    for frag in diloco.fragments:
        for t in frag.original.values():
            h.update(t.numpy().tobytes())
        for st in frag.outer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    h.update(v.numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--syncs", type=int, default=6)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--abort-at", type=int, default=-1, help="abort the group before the sync at this step")
    ap.add_argument("--until-participants", type=int, default=0)
    ap.add_argument("--group-rank", type=int, default=0)
    ap.add_argument("--sync-retries", type=int, default=0)
    ap.add_argument("--early-heal", action="store_true")
    ap.add_argument("--backstop", default="", help="durable backstop directory (saved after every commit)")
    ap.add_argument("--die-in-allreduce-at", type=int, default=-1, help="os._exit(1) in the sync at this step")
    ap.add_argument("--backstop-every", type=int, default=1, help="save the backstop every N committed syncs")
    ap.add_argument("--start-file", default="", help="start training once this file exists")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per inner step (a slower replica)")
    ap.add_argument("--lost-state", default="raise", choices=["raise", "accept"])
    ap.add_argument("--join", action="store_true", help="after recovering, join the round in progress (join_now)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"[{args.name}] %(name)s %(message)s")
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    fragments = [model[0], model[2]] if args.fragments == 2 else [model]
    outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    out = open(args.out, "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def record(kind: str, details: dict) -> None:
        out.write(json.dumps({"kind": kind, **{k: v for k, v in details.items() if k != "replica_id"}}) + "\n")

    backstop = Backstop(args.backstop, rank=0, world_size=1, every_s=1e-3, on_event=record) if args.backstop else None
    manager = Manager(
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        use_async_quorum=False, timeout=5, quorum_timeout=60, connect_timeout=20,
        lighthouse_addr=args.lighthouse, replica_id=args.name, on_event=record, backstop=backstop,
        lost_state=args.lost_state,
    )
    inner_step = 0
    joining = {"round_step": lambda: inner_step,
               "on_contributor_step": lambda step: record("aligned", {"to": step})} if args.join else {}
    diloco = DiLoCo(manager, fragments, inner, outers, sync_every=args.sync_every,
                    fragment_sync_delay=args.delay, fragment_update_alpha=args.alpha,
                    sync_retries=args.sync_retries, early_heal=args.early_heal, **joining)
    if args.die_in_allreduce_at >= 0:
        allreduce = manager.allreduce

        def dying_allreduce(tensor: torch.Tensor):  # the sync's quorum and group are up; we die in it
            if manager.current_step() == args.die_in_allreduce_at:
                record("dying", {"step": manager.current_step()})
                out.flush()
                os._exit(1)
            return allreduce(tensor)

        manager.allreduce = dying_allreduce
    record("ready", {})
    while args.start_file and not os.path.exists(args.start_file):
        time.sleep(0.05)
    try:
        how = diloco.recover()
    except StateLostError as err:
        record("fatal", {"error": str(err)})
        out.flush()
        os._exit(3)
    record("recovered", {"how": how, "step": manager.current_step()})
    streak = 0
    if args.join:
        diloco.join_now()
        record("joined", {"mid_round": diloco.joined_mid_round, "local_step": diloco.local_step})
    with diloco:
        while manager.current_step() < args.syncs or (args.until_participants and streak < 3):
            gen = torch.Generator().manual_seed(inner_step * 31 + zlib.crc32(args.name.encode()) % 101)
            x = torch.randn(16, 8, generator=gen)
            y = x.sum(dim=1, keepdim=True)
            inner.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            about_to_prepare = diloco.local_step + 1 == args.sync_every // args.fragments - args.delay
            if about_to_prepare and manager.current_step() == args.abort_at:
                args.abort_at = -1
                record("inject_abort", {"step": manager.current_step()})
                manager.pg.abort(RuntimeError("injected fault before the pseudo-gradient allreduce"))
            inner.step()
            inner_step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if diloco.local_step == 0 and diloco.last_sync:
                sync = diloco.last_sync
                diloco.last_sync = {}
                frag = diloco.fragments[sync["fragment"]]
                rolled_back = all(torch.equal(p, frag.original[n]) for n, p in frag.params.items())
                if sync["committed"]:
                    streak = streak + 1 if manager.num_participants() >= args.until_participants else 0
                record("sync", {**sync, "hash": global_hash(diloco), "loss": loss.item(),
                                "weight": diloco._pending_weight,
                                "rolled_back": rolled_back, "participants": manager.num_participants(),
                                "retried": diloco.retried_syncs})
                if (backstop is not None and sync["committed"] and manager.replica_rank() == 0
                        and manager.current_step() % args.backstop_every == 0):
                    backstop.maybe_save(manager.current_step(), manager.full_state_dict)
                    backstop.wait()
    record("done", {"step": manager.current_step()})
    manager.shutdown()
    out.close()


if __name__ == "__main__":
    main()
