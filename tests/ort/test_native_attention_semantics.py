"""The native CPU op library computes what the attention subgraphs it replaces compute: a band mask kept
explicit, a finite fill after which the scores are scaled, a scaled additive mask, a row with every key
masked (NaN under plain softmax, 0 under the dynamo exporter's NaN guard), at lengths not seen at export."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn
from torch.export import Dim

from tests.test_legality import F32_MIN, BufferMask, D, FiniteFillThenScale, IotaMask, SdpaMask, _attend, _qkv
from tkopt.backends.onnx_model import export_onnx as to_onnx
from tkopt.frontends.onnx import import_onnx
from tkopt.ort.library import KernelLibrary
from tkopt.ort.session import InferenceSession
from tkopt.passes.pipeline import run_passes


class Semantics(nn.Module):
    """Five attentions on one input, one output each."""

    def __init__(self) -> None:
        super().__init__()
        self.band, self.fill, self.strict, self.sdpa = BufferMask(32), FiniteFillThenScale(), IotaMask(True), SdpaMask()

    def forward(self, x: torch.Tensor, keep: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = _qkv(x * 0.9)  # each attention reads its own scores (the exporter would share equal ones)
        scaled = _attend((q @ k.transpose(-1, -2) + add[:, None, None, :]) * (0.5 / math.sqrt(D)), v)
        return self.band(x), self.fill(x * 1.5), self.strict(x * 0.7), self.sdpa(x * 1.2, keep), scaled


def _inputs(b: int, s: int) -> tuple[torch.Tensor, ...]:
    keep = torch.rand(b, s) > 0.3
    keep[:, 0] = True
    keep[-1] = False  # every key of the last batch entry masked
    return torch.randn(b, s, 16), keep, torch.where(torch.rand(b, s) > 0.3, 0.0, F32_MIN)


def test_native_library_reproduces_mask_arithmetic(tmp_path) -> None:
    torch.manual_seed(0)
    src = tmp_path / "m.onnx"
    seq, batch = Dim("s", min=1, max=47), Dim("b", min=1, max=8)
    dims = {0: batch, 1: seq}
    torch.onnx.export(Semantics().eval(), _inputs(2, 9), str(src), dynamo=True, input_names=["x", "keep", "add"],
                      dynamic_shapes=(dims, dims, dims))
    graph = import_onnx(src)
    run_passes(graph)
    fused = [n for n in graph.nodes if n.op == "FusedAttention"]
    assert len(fused) == 5
    assert {n.attrs["guard"] for n in fused} == {"none", "nan"}
    assert any(math.isclose(n.attrs["mask_fill"], -2.0, rel_tol=1e-6) for n in fused)
    lib = KernelLibrary("cpu")
    assert lib.prepare(fused) == {}
    lib.link(fused, tmp_path / "m.cpu.so")
    model = to_onnx(graph)
    onnx.helper.set_model_props(model, {"tkopt.op_library": "m.cpu.so", "tkopt.target": "cpu"})
    onnx.save(model, tmp_path / "m.tkopt.onnx")
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    sess = InferenceSession(tmp_path / "m.tkopt.onnx")
    for b, s in [(2, 9), (1, 1), (3, 37), (2, 40)]:
        torch.manual_seed(s)
        feeds = {n: t.numpy() for n, t in zip(("x", "keep", "add"), _inputs(b, s), strict=True)}
        for got, want in zip(sess.run(None, feeds), ref.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=f"b={b} s={s}")
