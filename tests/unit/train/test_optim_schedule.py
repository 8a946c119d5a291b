"""Warmup + cosine schedule, eager AdamW state, global grad-norm clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from regent.train.optim import WarmupCosineSchedule, build_optimizer, clip_grad_norm, lr_multiplier


def test_schedule_shape():
    values = [lr_multiplier(s, warmup_steps=10, max_steps=110, min_ratio=0.1) for s in range(130)]
    assert values[0] < values[5] < values[9] < 1.0  # warming up
    assert math.isclose(values[10], 1.0)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))  # non-increasing after warmup
    assert math.isclose(values[60], 0.55, rel_tol=1e-9)  # half way through the cosine
    assert math.isclose(values[110], 0.1) and math.isclose(values[129], 0.1)


def test_scheduler_state_round_trip():
    model = nn.Linear(4, 4)
    opt = build_optimizer(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    sched = WarmupCosineSchedule(opt, 1e-3, 5, 50, 0.1)
    for _ in range(7):
        sched.step()
    other = WarmupCosineSchedule(build_optimizer(model, 1e-3, (0.9, 0.95), 1e-8, 0.1), 1e-3, 5, 50, 0.1)
    other.load_state_dict(sched.state_dict())
    assert other.current_lr() == sched.current_lr() == opt.param_groups[0]["lr"]


def test_optimizer_state_exists_before_first_step_and_matches_lazy_adamw():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    eager = build_optimizer(a, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    assert set(eager.state[a.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    lazy = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randn(8, 4)
    for _ in range(3):
        for model, opt in ((a, eager), (b, lazy)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(a.weight, b.weight)


def test_clip_grad_norm():
    p = nn.Parameter(torch.zeros(4))
    q = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 0.0, 0.0, 0.0])
    q.grad = torch.tensor([0.0, 4.0, 0.0])
    norm = float(clip_grad_norm([p, q], max_norm=1.0))
    assert math.isclose(norm, 5.0, rel_tol=1e-6)
    assert math.isclose(float(torch.cat([p.grad, q.grad]).norm()), 1.0, rel_tol=1e-4)
    p.grad = torch.tensor([0.3, 0.0, 0.0, 0.0])
    q.grad = None
    assert math.isclose(float(clip_grad_norm([p, q], max_norm=1.0)), 0.3, rel_tol=1e-6)
    assert math.isclose(float(p.grad[0]), 0.3, rel_tol=1e-6)  # below the limit: untouched
