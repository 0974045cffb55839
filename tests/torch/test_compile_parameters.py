"""Parameters and persistent buffers stay live in tkopt.compile'd modules: they take gradients and later
changes (an optimizer step, load_state_dict) are seen, even where a pass could have folded them (Gemma's
(1 + w) norm weight, a stored scale)."""

from __future__ import annotations

import torch
from torch import nn

import tkopt

D = 16


class OnePlusWeightNorm(nn.Module):
    """Gemma's RMSNorm: weight stored as w, applied as (1 + w); then a linear scaled by a stored factor."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(D))
        self.out = nn.Linear(D, D)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.w)
        return self.out(h) * self.scale


def test_parameters_take_gradients_and_later_updates_are_seen() -> None:
    torch.manual_seed(0)
    model = OnePlusWeightNorm()
    x = torch.randn(2, 5, D)
    fast = tkopt.compile(model, (x,))
    assert fast.tkopt_report.fusions["add_norm"] == 1
    r = torch.randn(2, 5, D)
    grads = []
    for fn in (fast, model):
        model.zero_grad()
        (fn(x) * r).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        model.w.add_(0.5)
        model.load_state_dict({**model.state_dict(), "scale": torch.tensor(-3.0)})
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
