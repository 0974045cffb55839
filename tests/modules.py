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


class SelfAttention(nn.Module):
    """Multi-head self-attention written out: three projections of one input (FusedGemmGroup; three FusedGemm of
    one signature with gemm_group off), SDPA on transposed views (FusedAttention reading BSHD memory) and an output
    projection with the residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, s, d)) + x
