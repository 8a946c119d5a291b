"""Llama 3 model: shapes, parameter counts against the analytic formula, RoPE scaling, deterministic init."""

from __future__ import annotations

import math

import pytest
import torch

from regent.train.models.llama3 import (
    Llama3,
    ModelArgs,
    analytic_param_count,
    apply_rope,
    flops_per_token,
    model_args,
    rope_frequencies,
    rope_rotation,
)

torch.set_num_threads(1)
TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=32)


def test_forward_shapes_and_gqa():
    torch.manual_seed(0)
    model = Llama3(TINY)
    model.init_weights()
    tokens = torch.randint(0, TINY.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert model.layers[0].attention.wk.weight.shape == (2 * 16, 64)  # 2 kv heads x head_dim 16
    assert torch.isfinite(logits).all()


def test_causality():
    torch.manual_seed(0)
    model = Llama3(TINY)
    model.init_weights()
    tokens = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_sequence_longer_than_max_is_refused():
    model = Llama3(TINY)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("name", ["debug", "150m", "1b", "8b"])
def test_param_count_matches_formula(name):
    args = model_args(name, tokenizer_vocab=259, max_seq_len=16)
    with torch.device("meta"):
        model = Llama3(args)
    assert model.num_params() == analytic_param_count(args)


def test_known_sizes():
    debug = model_args("debug", tokenizer_vocab=259)
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.ffn_hidden, debug.vocab_size) == (256, 6, 16, 768, 320)
    eight = model_args("8b", tokenizer_vocab=259)
    assert (eight.dim, eight.n_layers, eight.n_heads, eight.kv_heads, eight.ffn_hidden) == (4096, 32, 32, 8, 14336)
    assert analytic_param_count(eight) == 8_030_261_248  # TorchTitan / Meta's Llama 3 8B
    one = model_args("1b", tokenizer_vocab=259)
    assert one.ffn_hidden == 8192 and 1.2e9 < analytic_param_count(one) < 1.6e9
    assert 1.3e8 < analytic_param_count(model_args("150m", tokenizer_vocab=259)) < 1.7e8
    with pytest.raises(ValueError, match="unknown model"):
        model_args("3b", tokenizer_vocab=259)


def test_flops_per_token_formula():
    args = model_args("8b", tokenizer_vocab=259)
    expected = 6 * (8_030_261_248 - 128256 * 4096) + 6 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, 8192) == expected


def test_rope_scaling_only_touches_low_frequencies():
    args = ModelArgs(dim=256, n_heads=2, max_seq_len=4)  # head_dim 128 like Llama 3
    plain = ModelArgs(dim=256, n_heads=2, max_seq_len=4, rope_scaling=False)
    cos_s, sin_s = rope_frequencies(args, 4)
    cos_p, sin_p = rope_frequencies(plain, 4)
    # position 1 angle == frequency; high frequencies unchanged, the lowest divided by 8
    freq_s, freq_p = torch.atan2(sin_s[1], cos_s[1]), torch.atan2(sin_p[1], cos_p[1])
    assert math.isclose(freq_s[0].item(), freq_p[0].item(), rel_tol=1e-6)
    assert math.isclose(freq_s[-1].item(), freq_p[-1].item() / 8, rel_tol=1e-4)


def test_rope_preserves_norm_and_position_zero():
    cos, sin = rope_frequencies(TINY, 8)
    x = torch.randn(2, 8, 4, 16)
    y = apply_rope(x, rope_rotation(cos, sin))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])


def test_init_is_deterministic_from_seed():
    def build(seed):
        torch.manual_seed(seed)
        model = Llama3(TINY)
        torch.manual_seed(seed)
        model.init_weights()
        return torch.cat([p.flatten() for p in model.parameters()])

    assert torch.equal(build(3), build(3))
    assert not torch.equal(build(3), build(4))
    torch.manual_seed(0)
    model = Llama3(TINY)
    model.init_weights()
    assert model.layers[0].attention.wo.weight.std() > model.layers[1].attention.wo.weight.std()  # depth-scaled
    assert torch.equal(model.norm.weight, torch.ones(TINY.dim))


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = Llama3(TINY)
    model.init_weights()
    tokens = torch.randint(0, TINY.vocab_size, (2, 10))

    def grads():
        model.zero_grad()
        model(tokens).float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.set_activation_checkpointing(True)
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b)


def test_config_model_names_match_model_table():
    from regent.train.config import MODEL_NAMES
    from regent.train.models.llama3 import MODEL_CONFIGS

    assert tuple(MODEL_CONFIGS) == MODEL_NAMES


def test_rope_keeps_fp32_angles_under_fsdp_bf16_mixed_precision(tmp_path):
    # FSDP2's mixed precision casts floating-point block inputs to bf16; the RoPE rotation goes to the
    # blocks as complex64, which it leaves alone (cos/sin as bf16 would be off by ~0.4% at long positions).
    import torch.distributed as dist

    from regent.train.parallel import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = Llama3(TINY)
        model.init_weights()
        seen = []
        model.layers[0].attention.register_forward_pre_hook(lambda mod, args: seen.append(args[1].dtype))
        apply_fsdp(model, 1, "cpu", bf16=True)
        logits = model(torch.randint(0, TINY.vocab_size, (2, 8)))
        logits.float().sum().backward()
        assert seen == [torch.complex64] and logits.dtype == torch.bfloat16
    finally:
        dist.destroy_process_group()


def test_fsdp_units_cover_every_parameter_once_in_forward_order():
    from regent.train.parallel import fsdp_units

    model = Llama3(TINY)
    units = fsdp_units(model)
    modules = [unit if isinstance(unit, list) else [unit] for unit, _ in units]
    owned = [id(p) for group in modules for m in group for p in m.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # none left to the root, none twice
    assert modules[0] == [model.tok_embeddings] and modules[-1] == [model.norm, model.output]
    assert [m[0] for m in modules[1:-1]] == list(model.layers)
    # gathered again first in backward (the head, the last block) stay gathered after forward
    assert [reshard for _, reshard in units] == [True] * TINY.n_layers + [False, False]


def test_rms_norm_is_the_formula_in_the_activations_dtype():
    from regent.train.models.llama3 import RMSNorm

    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64) * 4
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    low = norm(x.bfloat16())  # fp32 weight, bf16 activations: output stays bf16, one rounding off the formula
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, rtol=2e-2, atol=2e-2)


def test_autocast_runs_the_residual_stream_in_bf16():
    model = Llama3(TINY)
    model.init_weights()
    seen = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    assert seen == [torch.bfloat16] * TINY.n_layers and logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    seen.clear()
    assert model(tokens).dtype == torch.float32 and seen == [torch.float32] * TINY.n_layers  # no autocast: fp32
