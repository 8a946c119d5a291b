"""Llama 3 in one page: RMSNorm, RoPE (theta 500000, Llama 3.1 scaling), grouped-query attention, SwiGLU.

Named configs follow TorchTitan's flavors (`debug` = TorchTitan's debugmodel dims, `1b`, `8b`); `150m` is
ours, a mid-size model for CPU-heavy experiments. Initialization follows TorchTitan's depth-scaled scheme and
is a pure function of the torch RNG state, so the same seed gives bit-identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

# Attention kernels in order of preference, as TorchTitan orders them (cuDNN, then flash); torch takes the first
# that supports the inputs, so CPU and older GPUs fall through to flash or math. On an H200 at `1b` this measured
# the same as torch's default order (benchmarks/RESULTS.md, fifth GPU session).
SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None = n_heads (plain multi-head attention)
    vocab_size: int = 2048
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = True  # Llama 3.1 long-context frequency scaling
    max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# vocab_size None = taken from the tokenizer at build time.
MODEL_CONFIGS: dict[str, tuple[ModelArgs, bool]] = {
    # name: (args, vocab follows tokenizer)
    "debug": (ModelArgs(dim=256, n_layers=6, n_heads=16), True),
    "150m": (ModelArgs(dim=1024, n_layers=12, n_heads=16, n_kv_heads=8), True),
    "1b": (ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                     multiple_of=1024, ffn_dim_multiplier=1.5), False),
    "8b": (ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                     multiple_of=1024, ffn_dim_multiplier=1.3), False),
}


def model_args(name: str, tokenizer_vocab: int, max_seq_len: int = 8192) -> ModelArgs:
    """Args for a named config; small models size their vocab to the tokenizer (padded to a multiple of 64)."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_CONFIGS)}")
    args, vocab_follows_tokenizer = MODEL_CONFIGS[name]
    if vocab_follows_tokenizer:
        args = replace(args, vocab_size=64 * math.ceil(tokenizer_vocab / 64))
    elif tokenizer_vocab > args.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer_vocab} ids but model {name!r} has vocab {args.vocab_size}")
    return replace(args, max_seq_len=max(max_seq_len, 1))


def analytic_param_count(args: ModelArgs) -> int:
    """Parameter count from the formula (embeddings + layers + final norm + output), for tests and MFU."""
    d, kv = args.dim, args.kv_heads * args.head_dim
    attention = d * d + 2 * d * kv + d * d
    ffn = 3 * d * args.ffn_hidden
    per_layer = attention + ffn + 2 * d
    return 2 * args.vocab_size * d + args.n_layers * per_layer + d


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (TorchTitan's formula): 6 x non-embedding params + causal attention term."""
    non_embedding = analytic_param_count(args) - args.vocab_size * args.dim
    return 6.0 * non_embedding + 6.0 * args.n_layers * args.n_heads * args.head_dim * seq_len


def rope_frequencies(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, head_dim/2], with Llama 3.1 scaling of the low frequencies."""
    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / args.head_dim))
    if args.rope_scaling:
        scale, low_factor, high_factor, old_context = 8.0, 1.0, 4.0, 8192.0
        wavelen = 2 * math.pi / freqs
        low_wavelen, high_wavelen = old_context / low_factor, old_context / high_factor
        smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
        mixed = (1 - smooth) * freqs / scale + smooth * freqs
        freqs = torch.where(wavelen < high_wavelen, freqs, torch.where(wavelen > low_wavelen, freqs / scale, mixed))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def rope_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """e^(i angle) per (position, pair) as complex64. Passed to the blocks in this form: FSDP's mixed
    precision casts floating-point block inputs to bf16 (cos/sin would lose their precision), not complex."""
    return torch.complex(cos.float(), sin.float())


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0,x1),(x2,x3)... of the head dim; x is [batch, seq, heads, head_dim],
    rotation is `rope_rotation(...)` [seq, head_dim / 2].

    As one complex multiply in fp32 (each pair is a complex number times e^(i angle)): three kernels where
    the real-arithmetic form takes ten, which shows in eager mode."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation[None, :, None, :]).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel with the scale inside: one pass in the activations' dtype (it accumulates in
        # fp32), no dtype copies around it. Autocast stays out: it could upcast the input to fp32.
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, rotation), apply_rope(k, rotation)
        # GQA: each key/value head serves n_heads / n_kv_heads query heads; SDPA broadcasts them itself
        # (measured ~10% faster than materializing repeated k/v on an H200).
        with sdpa_kernel(SDPA_PRIORITY, set_priority=True):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def reset_parameters(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def reset_parameters(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotation)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            # Recompute this block in backward instead of keeping its activations: memory for compute.
            return checkpoint(self._forward, x, rotation, use_reentrant=False)
        return self._forward(x, rotation)

    def reset_parameters(self) -> None:
        out_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5  # depth-scaled, as TorchTitan's depth_init
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.reset_parameters(out_std)
        self.feed_forward.reset_parameters(out_std)


class Llama3(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_frequencies(args, args.max_seq_len)
        # Not persistent: derived from args, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]."""
        seq = tokens.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds the model's max_seq_len {self.rope_cos.shape[0]}")
        rotation = rope_rotation(self.rope_cos[:seq], self.rope_sin[:seq])
        h = self.tok_embeddings(tokens)
        if torch.is_autocast_enabled(h.device.type):
            # The residual stream in the compute dtype, as under FSDP's mixed precision: an fp32 stream would
            # make every residual add and norm move twice the bytes (and cast) for no use of the precision.
            h = h.to(torch.get_autocast_dtype(h.device.type))
        for layer in self.layers:
            h = layer(h, rotation)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialize every parameter from the current RNG state; also rebuilds the RoPE tables.

        Works on materialized or FSDP-sharded parameters, so a model built on the meta device can be
        initialized after sharding.
        """
        cos, sin = rope_frequencies(self.args, self.args.max_seq_len)
        device = buffer_device or self.rope_cos.device
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()
        std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        for layer in self.layers:
            layer.activation_checkpointing = enabled

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
