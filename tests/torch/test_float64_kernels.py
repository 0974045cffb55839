"""float64 through tkopt.compile on the real CPU kernels: fused equals eager to float64 precision.

The GEMM epilogue's activation constants once entered the C kernel with 7 digits (1/sqrt(2) as
7.071068e-01), and float64 Linear+GELU was 5e-9 off (the fuzzer's seed 180); tkopt/kernels/constants.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tkopt


class GeluMLP(nn.Module):
    """Linear + GELU (erf: 1/sqrt(2)) and Linear + GELU (tanh: sqrt(2/pi), 0.044715), both fused GEMMs."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(x))
        return nn.functional.gelu(self.down(h), approximate="tanh")


@pytest.fixture(scope="module")
def compiled() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = GeluMLP().double()
    with torch.no_grad():
        opt = tkopt.compile(model, (torch.randn(5, 16, dtype=torch.float64) * 3,), select="all")
    assert opt.tkopt_report.fusions["gemm"] == 2, opt.tkopt_report.fusions
    return model, opt


@pytest.mark.parametrize("rows", [1, 5, 37])  # size 1, the example, odd and longer
def test_float64_gelu_epilogues_match_eager(compiled, rows, monkeypatch):
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, opt = compiled
    x = torch.randn(rows, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(rows)) * 3
    with torch.no_grad():
        want, got = model(x), opt(x)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
