"""A second model family for the built-in trainer (not Llama): a causal convolution language model.

    regent train --train.spec examples.tiny_lm_spec:SPEC --model tiny --replicas 2 --duration 60s

The trainer keeps its data, schedule, precision, checkpoints and fault tolerance; this file only says how to
build and parallelize the model (`regent.train.spec.TrainSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from regent.train.spec import ParallelContext, TrainSpec


@dataclass
class TinyArgs:
    vocab_size: int
    dim: int = 64
    kernel: int = 4
    layers: int = 2


class CausalConvLM(nn.Module):
    """Embeddings, a stack of causal depthwise-separable convolutions with residuals, and an output head."""

    def __init__(self, args: TinyArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.convs = nn.ModuleList(nn.Conv1d(args.dim, args.dim, args.kernel, groups=args.dim)
                                   for _ in range(args.layers))
        self.mixes = nn.ModuleList(nn.Linear(args.dim, args.dim) for _ in range(args.layers))
        self.out = nn.Linear(args.dim, args.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # [batch, seq, dim]
        for conv, mix in zip(self.convs, self.mixes):
            x = F.pad(h.transpose(1, 2), (self.args.kernel - 1, 0))  # left padding: position t sees <= t
            h = h + mix(F.gelu(conv(x).transpose(1, 2)))
        return self.out(h)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)


def parallelize(model: nn.Module, ctx: ParallelContext) -> None:
    if ctx.sharded:  # one FSDP2 unit: the model is small
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)


SPEC = TrainSpec(
    name="tiny_conv_lm",
    flavors=("tiny",),
    model_args=lambda flavor, vocab, seq_len: TinyArgs(vocab_size=64 * -(-vocab // 64)),
    build_model=CausalConvLM,
    parallelize=parallelize,
)
