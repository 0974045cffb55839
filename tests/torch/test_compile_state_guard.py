"""Facts tkopt.compile proves from a non-persistent buffer's contents (a causal mask) hold only while the
buffer does: writing it in place, or replacing it, after compiling re-specializes the module."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tkopt


class MaskedAttention(nn.Module):
    """Single-head attention masked by a non-persistent bool buffer (causal when built)."""

    def __init__(self, d: int = 16, n: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("allowed", torch.tril(torch.ones(n, n, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        s = x.shape[1]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~self.allowed[:s, :s], float("-inf"))
        return scores.softmax(-1) @ v


def _causal(fast: tkopt.CompiledModule) -> list[int]:
    return [n.attrs["causal"] for n in fast.specializations[-1].graph.nodes if n.op == "FusedAttention"]


@pytest.mark.parametrize("change", ["in_place", "replaced"])
def test_writing_a_folded_buffer_after_compiling_respecializes(change: str) -> None:
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        fast = tkopt.compile(model, (x,))
        assert _causal(fast) == [1]  # proven causal from the buffer's contents
        torch.testing.assert_close(fast(x), model(x))
        banded = torch.ones(32, 32, dtype=torch.bool).triu(-2) & torch.ones(32, 32, dtype=torch.bool).tril(0)
        if change == "in_place":
            model.allowed.copy_(banded)
        else:
            model.allowed = banded
        assert fast.specializations[0].state.changed() is not None
        for s in (7, 5):
            xs = torch.randn(2, s, 16)
            torch.testing.assert_close(fast(xs), model(xs))
    assert len(fast.specializations) == 2 and _causal(fast) == [0]  # the band is a mask input now
