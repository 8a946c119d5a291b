"""Regent: fault-tolerant distributed training for PyTorch.

Layers (import only what you need; `regent.actor` never imports torch):
  regent.actor       single-controller actor runtime (Monarch-compatible API)
  regent.platform    CUDA / ROCm / CPU detection
  regent.jobs        where hosts come from (local, SLURM, Kubernetes, SkyPilot)
  regent.ft          Lighthouse, Manager, replicated groups, peer transfer, DiLoCo
  regent.train       Llama 3, FSDP2, data, optimizer, checkpoints, metrics
  regent.orchestrate the fault-tolerant training case study
"""

__version__ = "0.1.0"
