"""Where TorchTitan's first backward fails under the engine on a GPU ("data is not allocated yet", torch 2.11):
the engine's trainer driven directly in this process, outside any Regent session, with variants.
    python benchmarks/gpu/titan_diag.py VARIANT   (direct | direct_anomaly | direct_nochunk | direct_fp32)"""

from __future__ import annotations

import sys
import tempfile
import traceback

import torch

from regent.orchestrate import titan_engine
from regent.orchestrate.user_trainer import TrainerContext


def main(variant: str) -> int:
    args = "--training.seq_len 512 --training.local_batch_size 4"
    if variant == "direct_fp32":
        args += " --training.mixed_precision_param float32"
    options = {"titan.config": "debugmodel", "titan.args": args, "ac": "off"}
    ctx = TrainerContext(rank=0, world_size=1, replica_index=0, num_replicas=1, device=torch.device("cuda", 0),
                         seed=7, run_dir=tempfile.mkdtemp(), options=options)
    if variant == "direct_anomaly":
        torch.autograd.set_detect_anomaly(True)
    trainer = titan_engine.make_trainer(ctx)
    t = trainer.titan
    print("model type", type(trainer.model).__mro__[:3], "fsdp", t.parallel_dims.fsdp_enabled,
          "loss", type(t.loss_fn).__name__, flush=True)
    if variant == "direct_nochunk" and hasattr(t.loss_fn, "num_chunks"):
        t.loss_fn.num_chunks = 1
    p = next(trainer.model.parameters())
    print("param", type(p).__name__, p.dtype, p.device, flush=True)
    for i in range(3):
        trainer.optimizer.zero_grad()
        try:
            out = trainer.forward_backward(i)
        except Exception:  # noqa: BLE001 - the diagnosis: print it all and go on to the next variant
            traceback.print_exc()
            return 1
        trainer.optimizer.step()
        print(variant, "step", i, "loss", float(out["loss"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
