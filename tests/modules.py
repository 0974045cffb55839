"""Small torch modules several test files build."""

from __future__ import annotations

import torch
from torch import nn


class LinearAddNorm(nn.Module):
    """A GEMM (FusedGemm) feeding a residual add + LayerNorm (FusedAddNorm)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.linear(h))
