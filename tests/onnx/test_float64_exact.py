"""float64 models through ONNX: the optimized model equals the unfused one to float64 rounding.

Fused ops' float attributes were ONNX FLOAT attributes (32-bit): a scale and an epsilon of 1/3 lost
~1e-8 relative (fused_ops/onnx_schema.py now writes 0-d double tensors). And a float32 softmax inside a
float64 attention was fused into float64 arithmetic, 1e-8 off (the attention pass now refuses it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from tkopt.api import optimize_onnx
from tkopt.frontends.onnx import import_onnx
from tkopt.fused_ops.onnx_schema import attribute_values
from tkopt.models.export import export_onnx
from tkopt.onnx_runtime_ref import run_model

SIZES = [(1, 1), (2, 7), (3, 19)]  # (batch, sequence): size 1, odd, longer than exported


class AttentionNorm(nn.Module):
    """Causal self-attention by hand and a residual RMS norm by hand, their scale and epsilon (1/3, which
    float32 rounds) held in float64 buffers: the dynamo exporter writes a Python scalar as float32 itself,
    and ONNX's LayerNormalization takes a 32-bit epsilon."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.weight = nn.Parameter(torch.randn(16))
        self.register_buffer("third", torch.tensor(1 / 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = (q @ k.transpose(-1, -2) * self.third).masked_fill(~causal, float("-inf"))
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, 16) + x
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.third) * self.weight


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    m = AttentionNorm().double()
    with torch.no_grad():  # a small weight spread keeps the variance near epsilon, where epsilon counts
        m.qkv.weight.mul_(0.1)
    return m


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_float64_attention_and_norm_exact_through_onnx(model, dynamo, tmp_path):
    src = export_onnx(model, (torch.randn(2, 5, 16, dtype=torch.float64) * 0.1,), tmp_path / "m.onnx", dynamo=dynamo)
    optimized, report = optimize_onnx(src, tmp_path / "out.onnx", report=False, select="all")
    fused = dict(report.passes.fusions)
    assert fused["attention"] and fused["add_norm"], fused
    original = onnx.load(str(src))
    reloaded = onnx.load(str(tmp_path / "out.onnx"))
    for b, t in SIZES:
        feeds = {"x": np.random.default_rng(b * t).standard_normal((b, t, 16)) * 0.1}
        want = run_model(original, feeds, provider="ort")["output"]
        for m in (optimized, reloaded):
            got = run_model(m, feeds, provider="hybrid")["output"]
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=f"size {(b, t)}")


def test_float_attributes_are_double_tensors_and_read_back_exactly():
    """The IR's value goes out as a 0-d double tensor and comes back bit for bit through the frontend."""
    from tkopt.backends.onnx_model import _fused_node
    from tkopt.ir import Node, Value

    x = Value("x", "float64", (2, 16))
    node = Node("FusedAddNorm", [x, x, None, None], [Value("y", "float64", (2, 16))],
                {"kind": "rms", "epsilon": 1 / 3 * 1e-5}, name="n", domain="tkopt")
    proto = _fused_node(node)
    (eps,) = [a for a in proto.attribute if a.name == "epsilon"]
    assert eps.type == onnx.AttributeProto.TENSOR and eps.t.data_type == onnx.TensorProto.DOUBLE
    assert attribute_values(proto) == {"kind": "rms", "epsilon": 1 / 3 * 1e-5}
    graph = helper.make_graph([proto], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [2, 16])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, [2, 16])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("tkopt", 1)])
    (n,) = import_onnx(m).nodes
    assert n.attrs["epsilon"] == 1 / 3 * 1e-5


def test_float32_attribute_on_a_fused_node_is_refused_by_name(tmp_path: Path):
    """A tkopt node written with an ONNX FLOAT attribute (by hand, or by an older tkopt) is refused with
    the node and the attribute named, not read at 32 bits."""
    proto = helper.make_node("FusedAttention", ["q", "q", "q"], ["o"], name="attn", domain="tkopt", scale=0.125)
    with pytest.raises(ValueError, match=r"FusedAttention node 'attn': attribute 'scale' must be a 0-d double "
                                         r"tensor \(float attributes are exact\), got FLOAT$"):
        attribute_values(proto)
    proto.attribute[0].CopyFrom(helper.make_attribute("scale", onnx.numpy_helper.from_array(np.ones(2, np.float32))))
    with pytest.raises(ValueError, match=r"'scale' must be a 0-d double tensor .*got a FLOAT tensor of shape \[2\]"):
        attribute_values(proto)


class Float32Softmax(nn.Module):
    """A float64 attention whose softmax runs in float32 (F.softmax(dtype=float32), as HF writes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        p = nn.functional.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1, dtype=torch.float32).to(q.dtype)
        return (p @ v).transpose(1, 2).reshape(b, t, 16)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_float32_softmax_in_float64_attention_is_refused(dynamo, tmp_path):
    torch.manual_seed(0)
    src = export_onnx(Float32Softmax().double(), (torch.randn(2, 5, 16, dtype=torch.float64),), tmp_path / "m.onnx",
                      dynamo=dynamo)
    optimized, report = optimize_onnx(src, None, report=False, select="all")
    assert report.passes.fusions["attention"] == 0
    reasons = [r.reason for r in report.passes.refusals]
    assert any("casts to float32, rounding the float64 attention scores" in r for r in reasons), reasons
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 7, 16))}
    np.testing.assert_allclose(run_model(optimized, feeds, provider="hybrid")["output"],
                               run_model(onnx.load(str(src)), feeds, provider="ort")["output"], rtol=1e-12, atol=1e-13)


def test_float64_native_cpu_library_is_exact(model, tmp_path):
    """The native op library (its kernels built from the nodes' attributes, 1/3 in the norm's epsilon and
    the attention's scale) equals the unfused model in ORT to float64 rounding."""
    from tkopt.ort import InferenceSession

    src = export_onnx(model, (torch.randn(2, 5, 16, dtype=torch.float64) * 0.1,), tmp_path / "m.onnx", dynamo=False)
    _, report = optimize_onnx(src, tmp_path / "out.onnx", report=False, select="all", target="cpu")
    assert report.passes.fusions["attention"] and report.passes.fusions["add_norm"], report.passes.fusions
    session = InferenceSession(str(tmp_path / "out.onnx"))
    original = onnx.load(str(src))
    for b, t in SIZES:
        feeds = {"x": np.random.default_rng(b * t).standard_normal((b, t, 16)) * 0.1}
        want = run_model(original, feeds, provider="ort")["output"]
        np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-12, atol=1e-13, err_msg=f"{(b, t)}")
