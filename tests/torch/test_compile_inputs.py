"""What tkopt.compile accepts as example inputs."""

from __future__ import annotations

import torch
from torch import nn

import tkopt


def test_a_bare_tensor_is_the_one_positional_input() -> None:
    """tuple(tensor) would split it along dim 0 into many arguments (issue 8: 'too many positional arguments')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval()
    x = torch.randn(3, 5, 8)
    compiled = tkopt.compile(model, x)
    assert compiled.tkopt_report.fusions["gemm"] == 1
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x[:1]), model(x[:1]))
