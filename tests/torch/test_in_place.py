"""In-place ops on intermediates that are read again (XLM's and FlauBERT's `scores.masked_fill_(mask, -inf)` before
`softmax(scores.float()).type_as(scores)`): the export is functionalized by torch (tkopt.frontends.fx.functional),
so the mask reaches the attention as dataflow and the attention fuses; wherever the mutation lands (before or after
a read, through a view), the compiled module computes what eager does."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tkopt
from tkopt.frontends.fx import functional

D, H = 32, 4


class MaskedInPlace(nn.Module):
    """Self-attention as XLM writes it; `where` moves the mutation: "scores" (XLM), "after_softmax" (the weights
    are read before the scores are masked: the mask must not reach them), "view" (masked through a view)."""

    def __init__(self, where: str = "scores") -> None:
        super().__init__()
        self.where = where
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        dropped = (keep == 0).view(b, 1, 1, s).expand_as(scores)
        if self.where == "scores":
            scores.masked_fill_(dropped, -math.inf)
            weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        elif self.where == "after_softmax":
            weights = F.softmax(scores.float(), dim=-1).type_as(scores)
            scores.masked_fill_(dropped, -math.inf)
            weights = weights + scores.clamp(min=-1.0).sum() * 0
        else:
            scores.view(b * H, s, s).masked_fill_(dropped.reshape(b * H, s, s), -math.inf)
            weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        return (weights @ v).transpose(1, 2).reshape(b, s, D)


def _inputs(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.ones(b, s, dtype=torch.long)
    keep[-1, -(s // 3 or 1):] = 0  # the last row right-padded
    return torch.randn(b, s, D), keep


def test_a_mutated_score_matrix_is_functionalized_and_the_attention_fuses() -> None:
    torch.manual_seed(0)
    model = MaskedInPlace().eval()
    example = _inputs(2, 7)
    with torch.no_grad():
        fast = tkopt.compile(model, example, select="all")
        assert fast.tkopt_report.fusions["attention"] == 1, fast.tkopt_report.passes.refusals
        for b, s in ((2, 7), (3, 16), (1, 5)):
            x = _inputs(b, s)
            torch.testing.assert_close(fast(*x), model(*x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["after_softmax", "view"])
def test_wherever_the_mutation_lands_the_result_is_eagers(where: str) -> None:
    torch.manual_seed(0)
    model = MaskedInPlace(where).eval()
    with torch.no_grad():
        fast = tkopt.compile(model, _inputs(2, 7), select="all")
        for b, s in ((2, 7), (3, 16)):
            x = _inputs(b, s)
            torch.testing.assert_close(fast(*x), model(*x), rtol=1e-5, atol=1e-5)


def test_only_an_observed_mutation_costs_a_functionalization() -> None:
    """A graph whose in-place ops nothing else observes (a buffer's, a temporary's only use) is imported as it is."""

    class Unobserved(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 2).add_(1).relu()

    with torch.no_grad():
        plain = torch.export.export(Unobserved(), (torch.randn(3, 4),))
        xlm = torch.export.export(MaskedInPlace(), _inputs(2, 7))
    assert functional(plain) is plain
    assert functional(xlm) is not xlm
    assert not any(str(n.target).endswith("_.Scalar") for n in functional(xlm).graph.nodes)
