"""Attention written with torch.einsum (CvT, and model code that spells Q·K^T and ·V as einsums) fuses where
each einsum is a 4-D batched matmul, and only there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tkopt
from tkopt.ir import Node
from tkopt.passes.attention import IDENT, SWAP, einsum_matmul


class EinsumAttention(nn.Module):
    def __init__(self, qk: str = "bhqd,bhkd->bhqk", pv: str = "bhqk,bhkd->bhqd", k_transposed: bool = False,
                 heads: int = 4) -> None:
        super().__init__()
        self.qk, self.pv, self.k_transposed, self.heads = qk, pv, k_transposed, heads
        self.proj = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.einsum(self.qk, q, k.transpose(-1, -2) if self.k_transposed else k) * 0.125
        probs = (scores + mask[:, None, None, :]).softmax(-1)
        return torch.einsum(self.pv, probs, v).transpose(1, 2).reshape(b, s, -1)


def _inputs(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    mask = torch.zeros(batch, seq)
    mask[-1, seq // 2:] = torch.finfo(torch.float32).min  # padding in the last row
    return torch.randn(batch, seq, 32, generator=g), mask


@pytest.mark.parametrize(("qk", "k_transposed"), [("bhqd,bhkd->bhqk", False), ("zyab,zybc->zyac", True)])
def test_einsum_attention_fuses_and_matches_eager(qk: str, k_transposed: bool) -> None:
    torch.manual_seed(0)
    model = EinsumAttention(qk=qk, k_transposed=k_transposed).eval()
    compiled = tkopt.compile(model, _inputs(2, 13), select="all", dynamic=True)
    assert compiled.tkopt_report.fusions["attention"] == 1
    with torch.no_grad():
        for batch, seq in ((2, 13), (1, 1), (3, 40)):  # not a multiple of a tile, a single query, longer
            inputs = _inputs(batch, seq)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("qk", "pv"), [
    ("bhqd,bhkd->bhkq", "bhkq,bhkd->bhqd"),  # scores transposed: the softmax runs over the queries
    ("bhqd,bhkd->bhqk", "bhqk,bhqd->bhkd"),  # ·V contracts the query axis
])
def test_einsums_that_are_not_attention_stay_unfused(qk: str, pv: str) -> None:
    torch.manual_seed(0)
    model = EinsumAttention(qk=qk, pv=pv).eval()
    inputs = _inputs(2, 13)
    compiled = tkopt.compile(model, inputs, select="all")
    assert compiled.tkopt_report.fusions["attention"] == 0
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_an_ellipsis_einsum_is_refused_with_its_equation() -> None:
    torch.manual_seed(0)
    model = EinsumAttention(qk="...qd,...kd->...qk").eval()
    inputs = _inputs(2, 13)
    compiled = tkopt.compile(model, inputs, select="all")
    assert compiled.tkopt_report.fusions["attention"] == 0
    reasons = [r.reason for r in compiled.tkopt_report.passes.refusals]
    assert any("'...qd,...kd->...qk'), not a 4-D batched matmul" in r for r in reasons), reasons
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("equation", "net"), [
    ("bhqd,bhdk->bhqk", IDENT), ("bhqd,bhkd->bhqk", SWAP), ("b h q d, b h k d -> b h q k", SWAP),
    ("bhqd,bhkd->bhkq", None), ("bhqd,hbkd->bhqk", None), ("bhqd,bhqd->bhqq", None), ("bqd,bkd->bqk", None),
    ("bhqd,bhkd", None), ("bhqd,bhke->bhqk", None),
])
def test_einsum_matmul_reads_only_batched_matmuls(equation: str, net: tuple[int, ...] | None) -> None:
    node = Node("aten::einsum", [None, None], [], {"equation": equation}, name="e")
    assert einsum_matmul(node) == net


@pytest.mark.parametrize("dynamo", [False, True])
def test_einsum_attention_fuses_in_both_onnx_exports(tmp_path, dynamo: bool) -> None:
    """The TorchScript exporter keeps the einsums as ONNX Einsum nodes, whose symbolic output shapes ONNX shape
    inference leaves unknown: tkopt infers them (tkopt/passes/shapes.py), or the head dims could not be proven."""
    from tkopt.ort import InferenceSession

    torch.manual_seed(0)
    model = EinsumAttention().eval()
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    axes = {"x": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}}
    if dynamo:
        seq = torch.export.Dim("s", min=2, max=64)
        torch.onnx.export(model, _inputs(2, 13), str(src), dynamo=True, input_names=["x", "mask"],
                          dynamic_shapes=({1: seq}, {1: seq}), verbose=False)
    else:
        torch.onnx.export(model, _inputs(2, 13), str(src), dynamo=False, input_names=["x", "mask"],
                          dynamic_axes=axes)
    _, report = tkopt.optimize_onnx(src, out, target="cpu", select="all")
    assert report.fusions["attention"] == 1
    session = InferenceSession(str(out))
    for seq in (13, 40):
        x, mask = _inputs(2, seq)
        got = session.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0]
        torch.testing.assert_close(torch.from_numpy(got), model(x, mask).detach(), rtol=1e-5, atol=1e-5)
