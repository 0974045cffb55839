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


class PackedGateUp(nn.Module):
    """Phi-3's MLP: one projection to the gate and up halves, chunk(2, -1), silu(gate) * up, down."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(D, 2 * 24, bias=False)
        self.down = nn.Linear(24, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(up * torch.nn.functional.silu(gate))


def test_packed_gate_up_weight_is_sliced_at_every_call() -> None:
    """The packed weight is a parameter: the fused node halves it when it runs, so a later update is seen."""
    torch.manual_seed(0)
    model = PackedGateUp()
    x = torch.randn(2, 5, D)
    fast = tkopt.compile(model, (x,))
    fused = [n for n in fast.specializations[0].graph.nodes if n.op == "FusedGatedMLP"]
    assert len(fused) == 1 and fused[0].attrs["packed"] == 1
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
        model.gate_up.weight.mul_(-2.0).add_(0.1)
        for s in (5, 1, 9):
            xs = torch.randn(3, s, D)
            torch.testing.assert_close(fast(xs), model(xs), rtol=1e-5, atol=1e-6)
