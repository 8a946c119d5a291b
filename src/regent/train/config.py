"""TrainConfig: every knob of one training run, as a plain dataclass with up-front validation.

Importing this module does not import torch, so a CLI can parse and validate a config cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MODEL_NAMES: tuple[str, ...] = ("debug", "150m", "1b", "8b")  # = llama3.MODEL_CONFIGS (kept torch-free here)


@dataclass
class TrainConfig:
    spec: str = "llama3"  # the model family (regent.train.spec): llama3, or module.path:SPEC for your own
    model: str = "debug"  # the spec's flavor; llama3: debug | 150m | 1b | 8b
    seq_len: int = 256
    batch_size: int = 8  # sequences per rank per step
    lr: float = 1e-3  # peak learning rate (after warmup); 1e-3 suits the small configs, use ~3e-4 for 1b/8b
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 20
    max_steps: int = 1000  # length of the cosine schedule
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    seed: int = 0
    # a glob of text files, a shard directory (`regent data prepare`), or hf:NAME[:split] (needs `datasets`);
    # None = built-in corpus (Python stdlib sources)
    data: str | None = None
    data_max_bytes: int = 16_000_000  # cap on bytes read from a text glob (shards and hf: have no cap)
    tokenizer: str | None = None  # HF tokenizers json; None = byte-level
    mixed_precision: bool | None = None  # None = bf16 on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    compile: bool = False
    # unsharded replicas: parameters and each AdamW moment in one buffer apiece (a peer heal is then a few
    # large messages instead of one per tensor)
    contiguous_state: bool = True
    # > 1: plain HSDP over the whole world, no fault tolerance: this many replicas of world/hsdp_replicate
    # FSDP shards (the baseline that fault tolerance across replica groups is compared with)
    hsdp_replicate: int = 1
    checkpoint_dir: str | None = None  # save_checkpoint(<dir>/step-N) every checkpoint_every steps
    checkpoint_every: int = 0
    async_checkpoint: bool = False
    log_every: int = 1  # progress log cadence (metrics.jsonl gets every step)
    tensorboard: bool = False  # also write TensorBoard events to <run_dir>/tb (needs the tensorboard package)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, carried into metrics/summary

    def validate(self) -> None:
        """Raise ValueError naming the bad field and the fix; called before anything is launched."""
        if self.spec == "llama3" and self.model not in MODEL_NAMES:  # other specs check their flavors at load
            raise ValueError(f"model={self.model!r} is unknown; use --model with one of {', '.join(MODEL_NAMES)}")
        positive = {"seq_len": self.seq_len, "batch_size": self.batch_size, "max_steps": self.max_steps,
                    "data_max_bytes": self.data_max_bytes, "log_every": self.log_every}
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.seq_len > 8192 * 16:
            raise ValueError(f"seq_len={self.seq_len} is larger than this trainer supports (131072)")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not isinstance(self.hsdp_replicate, int) or self.hsdp_replicate < 1:
            raise ValueError(f"hsdp_replicate must be a positive integer, got {self.hsdp_replicate!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every > 0 and not self.checkpoint_dir:
            raise ValueError("checkpoint_every > 0 needs checkpoint_dir; set --checkpoint-dir or checkpoint_every=0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a dict (TOML table, JSON): each value parsed to its field's type (regent.config_values);
        unknown keys are an error naming the valid ones."""
        from regent.config_values import coerce, field_types

        types = field_types(cls)
        unknown = sorted(set(values) - set(types))
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; valid fields: {', '.join(sorted(types))}")
        return cls(**{k: coerce(v, types[k], f"train.{k}") for k, v in values.items()})
