"""The accuracy check after optimizing runs fused and unfused at several admitted sizes and names them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from rich.console import Console
from torch import nn
from torch.export import Dim

import tkopt
from tkopt.api import compare_onnx, optimize_onnx
from tkopt.differential import DimRange, check_module, trial_sizes
from tkopt.models.blocks import REFERENCE_MODELS
from tkopt.models.export import export_onnx


class Attention(nn.Module):
    """Single-head attention masked by a buffer sliced to the sequence: causal, or a band `window` wide."""

    def __init__(self, window: int | None, max_seq: int = 32, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.max_seq = max_seq
        self.qkv = nn.Linear(d, 3 * d)
        i = torch.arange(max_seq)
        keep = i[:, None] >= i[None, :]
        if window is not None:
            keep &= i[:, None] - i[None, :] < window
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep[:s, :s])


def test_trial_sizes_are_the_example_the_smallest_an_odd_and_a_longer_one_within_range() -> None:
    assert DimRange(8).candidates() == [8, 1, 3, 19]
    assert DimRange(2, lo=2, hi=4).candidates() == [2, 2, 3, 4]
    assert DimRange(3, lo=2).candidates() == [3, 2, 5, 9]
    sizes = trial_sizes({"batch": DimRange(2), "seq": DimRange(8, hi=10)})
    assert sizes == [{"batch": 2, "seq": 8}, {"batch": 1, "seq": 1}, {"batch": 3, "seq": 3}, {"batch": 7, "seq": 10}]
    assert trial_sizes({}) == [{}]


def test_onnx_check_catches_a_fusion_wrong_only_at_other_sizes(tmp_path: Path) -> None:
    """A band mask 8 wide equals a causal one up to length 8, the single size the check used to run."""
    x = (torch.randn(2, 8, 8),)
    band = export_onnx(Attention(window=8).eval(), x, tmp_path / "band.onnx", dynamo=False)
    causal = export_onnx(Attention(window=None).eval(), x, tmp_path / "causal.onnx", dynamo=False)
    acc = compare_onnx(band, causal)
    assert not acc.ok and acc.checked
    assert acc.inputs == {"x": [2, 8, 8]} and {"x": [7, 19, 8]} in acc.runs and {"x": [1, 1, 8]} in acc.runs
    assert acc.outputs[0].shape == [7, 19, 8]  # the worst error is where band and causal differ
    assert compare_onnx(band, band).ok


def _model_with_unknown_op(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Foo", ["r"], ["y"], domain="com.example")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    onnx.save(model, path)
    return path


def test_an_op_ort_cannot_run_skips_the_check_with_one_line(tmp_path: Path) -> None:
    src = _model_with_unknown_op(tmp_path / "custom.onnx")
    _, rep = optimize_onnx(src, tmp_path / "out.onnx", report=False, check_accuracy=True)
    assert rep.passes.total_fused == 1 and rep.output is not None
    acc = rep.accuracy
    assert acc is not None and not acc.checked and acc.ok
    assert acc.skipped == ["the original model does not run in ort at any size tried: "
                           "Fatal error: com.example:Foo(-1) is not a registered function/op"]
    out = io.StringIO()
    rep.render(Console(file=out, width=400))
    lines = [ln for ln in out.getvalue().splitlines() if "accuracy" in ln]
    assert lines == ["accuracy check skipped: " + acc.skipped[0]]
    assert "Traceback" not in out.getvalue()


def test_compile_check_accuracy_runs_sizes_the_export_admits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "reference")  # the graph is under test here, not the kernels
    model, inputs = REFERENCE_MODELS["bert_layer"]()
    compiled = tkopt.compile(model, inputs, dynamic=True, check_accuracy=True)
    acc = compiled.tkopt_accuracy
    assert acc is not None and acc.ok and acc.unfused_runner == "eager"
    shapes = [tuple(r["args[0]"][:2]) for r in acc.runs]
    assert shapes[0] == tuple(inputs[0].shape[:2]) and len(set(shapes)) == len(shapes) >= 3
    assert max(s for _, s in shapes) > inputs[0].shape[1]  # longer than the example
    assert all(r["args[1]"] == r["args[0]"][:2] for r in acc.runs)  # the mask follows hidden_states' dims
    assert tkopt.compile(model, inputs).tkopt_accuracy is None  # opt-in


def test_check_module_catches_a_mismatch_only_at_longer_sizes() -> None:
    band, causal = Attention(window=8).eval(), Attention(window=None).eval()
    x = torch.randn(2, 8, 8)
    ep = torch.export.export(band, (x,), dynamic_shapes=({0: Dim("b", max=16), 1: Dim("s", max=31)},))
    examples = [p.meta["val"] for p in ep.module().graph.find_nodes(op="placeholder")]
    acc = check_module(band, causal, examples, ep.range_constraints, (x,), {})
    assert not acc.ok and acc.runs[0] == {"args[0]": [2, 8, 8]}
    assert all(r["args[0]"][1] <= 31 for r in acc.runs) and acc.outputs[0].shape[1] > 8
    assert check_module(band, band, examples, ep.range_constraints, (x,), {}).ok
