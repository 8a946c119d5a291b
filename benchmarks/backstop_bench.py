"""What the durable backstop costs training: the host copy on the training thread, and the slowdown of the steps
that run while the background write goes on.

    .venv/bin/python benchmarks/backstop_bench.py --model debug
    .venv/bin/python benchmarks/backstop_bench.py --model 150m --steps 12

Method (one process, one trainer, the per-step mode's arrangement, the costlier one):
1. `--steps` timed training steps with no save (after warm-up): the step time T.
2. A backstop save (`regent.ft.backstop.Backstop`) of the full trainer state started at a step boundary, with
   the optimizer's pre-step hook waiting for its host copy (as `regent train` does in per-step mode): the time
   the training thread spent starting the save and waiting for the copy, and the step times while the copy and
   the write run beside training. (In DiLoCo the backstop holds only the committed state, which does not
   change for a round: nothing waits at all.)
3. Overhead at the default interval I (`ft.backstop_every_s`, 120 s): (start + wait + extra step time during
   the save) / I; the target is <= 1%. Writes benchmarks/results/backstop_bench_<model>.json.
The anchor is the same trainer without a save, in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--interval", type=float, default=120.0, help="backstop interval the overhead is shared over")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from regent.ft.backstop import Backstop
    from regent.train.config import TrainConfig
    from regent.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, data_max_bytes=4_000_000)
    trainer = Trainer(cfg)
    for _ in range(3):
        trainer.train_step()

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            trainer.train_step()
            out.append(time.perf_counter() - t0)
        return out

    plain = timed(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        events: list[dict] = []
        backstop = Backstop(tmp, rank=0, world_size=1, every_s=1e-3, on_event=lambda k, d: events.append(d))
        def wait_for_copy(*_: object) -> None:  # what `regent train` does in per-step mode
            backstop.wait_copied()

        trainer.optimizer.register_step_pre_hook(wait_for_copy)
        time.sleep(0.002)
        t0 = time.perf_counter()
        backstop.maybe_save(trainer.step, trainer.state_dict)
        blocking = time.perf_counter() - t0
        during = []
        while backstop.busy() or len(during) < 2:
            t1 = time.perf_counter()
            trainer.train_step()
            during.append(time.perf_counter() - t1)
        write_s = events[0]["seconds"] if events else None
        size = sum(p.stat().st_size for p in Path(tmp).rglob("*.pt"))
    step = statistics.median(plain)
    extra = max(0.0, sum(during) - step * len(during))  # includes the pre-step wait for the copy
    overhead = (blocking + extra) / args.interval
    rows = [
        ("model / threads", f"{args.model} / {args.threads}"),
        ("state size on disk", f"{size / 2**20:.1f} MiB"),
        ("step time, no save (anchor)", f"{step * 1e3:.1f} ms (median of {len(plain)})"),
        ("starting the save (training thread)", f"{blocking * 1e3:.2f} ms ({blocking / step:.1%} of one step)"),
        ("training thread waited for the copy", f"{backstop.snapshot_seconds * 1e3:.1f} ms"),
        ("copy + write beside training", f"{write_s} s, {len(during)} steps ran meanwhile"),
        ("step time during the write", f"{statistics.mean(during) * 1e3:.1f} ms (extra {extra * 1e3:.1f} ms in all)"),
        (f"overhead at one save per {args.interval:.0f} s", f"{overhead:.4%} (target <= 1%)"),
    ]
    for k, v in rows:
        print(f"{k:40s} {v}")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "command": " ".join(sys.argv),
              "torch": torch.__version__, "rows": dict(rows), "overhead": overhead}
    (ROOT / "benchmarks/results").mkdir(parents=True, exist_ok=True)
    (ROOT / f"benchmarks/results/backstop_bench_{args.model}.json").write_text(json.dumps(result, indent=2))
    return 0 if overhead <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
