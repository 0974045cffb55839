"""GEMM epilogue and gated-MLP fusion on hand-built graphs: forms, refusals, numerics, disabling."""

from __future__ import annotations

import pytest
import torch

from tkopt.passes.gemm import gated_mlp, gemm, gemm_group
from tkopt.passes.pipeline import run_passes
from tkopt.passes.recognize import recognize_gelu, recognize_silu

from .ir_helpers import Builder, apply, exported, ops, reasons

X = (2, 3, 8)  # (batch, seq, K)


def _fused_same(b: Builder, *passes, want_ops: list[str]):
    want = b.run()
    r = apply(b.graph, recognize_gelu, recognize_silu, *passes)
    assert ops(b.graph) == want_ops, (ops(b.graph), reasons(r))
    for got, ref in zip(b.run(), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    return r


def _act(b: Builder, name: str, y):
    if name == "relu":
        return b.op("Relu", y)
    if name == "sigmoid":
        return b.op("Sigmoid", y)
    if name == "silu":
        return b.op("Mul", y, b.op("Sigmoid", y))
    if name == "gelu":  # decomposed erf form, as the ONNX exporters write it
        e = b.op("Erf", b.op("Div", y, 1.4142135))
        return b.op("Mul", y, b.op("Mul", 0.5, b.op("Add", e, 1.0)))
    return b.op("Gelu", y, approximate="tanh")


@pytest.mark.parametrize("act", ["relu", "sigmoid", "silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_bias_activation_residual(act, bias_first):
    b = Builder()
    x, res = b.input("x", X), b.input("res", (2, 3, 16))
    y = b.op("MatMul", x, b.param(8, 16, name="w"))
    y = b.op("Add", b.param(16, name="bias"), y) if bias_first else b.op("Add", y, b.param(16, name="bias"))
    b.output(b.op("Add", res, _act(b, act, y)))
    _fused_same(b, gemm, want_ops=["FusedGemm"])
    node = b.graph.nodes[0]
    assert node.attrs == {"trans_b": 0, "activation": act}
    assert [v.name for v in node.inputs] == ["x", "w", "bias", "res"]


def test_transposed_constant_weight_and_linear_use_trans_b():
    b = Builder()
    x = b.input("x", X)
    y = b.op("MatMul", x, b.op("Transpose", b.param(16, 8, name="w1"), perm=[1, 0]))
    z = b.op("Linear", y, b.param(4, 16, name="w2"), b.param(4, name="b2"))
    b.output(z)
    _fused_same(b, gemm, want_ops=["FusedGemm", "FusedGemm"])
    first, second = b.graph.nodes
    assert first.attrs["trans_b"] == 1 and first.inputs[1].name == "w1" and first.inputs[2] is None
    assert second.attrs["trans_b"] == 1 and second.inputs[2].name == "b2"


def test_a_transposed_runtime_weight_is_read_in_place():
    """Dynamo's graphs take a linear's weight as an input and decompose the linear into t(w) + addmm: the
    transpose becomes trans_b on w itself, so the kernel reads the weight as stored. A transpose whose result
    has another reader stays, and the GEMM reads it as B."""
    b = Builder()
    x, w = b.input("x", (6, 8)), b.input("w", (16, 8))
    b.output(b.op("Gemm", x, b.op("Transpose", w, perm=[1, 0]), b.param(16, name="bias")))
    _fused_same(b, gemm, want_ops=["FusedGemm"])
    (node,) = b.graph.nodes
    assert node.attrs["trans_b"] == 1 and node.inputs[1] is w
    b = Builder()
    x, w = b.input("x", (6, 8)), b.input("w", (16, 8))
    wt = b.op("Transpose", w, perm=[1, 0])
    b.output(b.op("MatMul", x, wt), b.op("Relu", wt))
    _fused_same(b, gemm, want_ops=["Transpose", "FusedGemm", "Relu"])
    fused = next(n for n in b.graph.nodes if n.op == "FusedGemm")
    assert fused.attrs["trans_b"] == 0 and fused.inputs[1] is wt


def test_gemm_op_bias_and_full_shape_c_as_residual():
    b = Builder()
    a, c = b.input("a", (6, 8)), b.input("c", (6, 16))
    y = b.op("Gemm", a, b.param(16, 8, name="w"), b.param(16), transB=1)
    b.output(b.op("Gemm", y, b.param(16, 16), c))
    _fused_same(b, gemm, want_ops=["FusedGemm", "FusedGemm"])
    first, second = b.graph.nodes
    assert first.attrs["trans_b"] == 1 and first.inputs[2] is not None and first.inputs[3] is None
    assert second.inputs[2] is None and second.inputs[3] is c


def test_gemm_near_misses_are_refused_with_reasons():
    b = Builder()
    a = b.input("a", (6, 8))
    y = b.op("Gemm", a, b.param(8, 8), b.param(8), alpha=2.0)
    y = b.op("Gemm", y, b.param(8, 8), b.param(8), beta=0.5)
    b.output(b.op("Gemm", b.op("Transpose", y, perm=[1, 0]), b.param(8, 8), transA=1))
    r = apply(b.graph, gemm)
    assert r.fused == 0
    for reason in ("alpha=2.0 (must be 1)", "beta=0.5 (must be 1)", "transA=1 (A transposed) is not supported"):
        assert reason in reasons(r)


def test_batched_matmul_is_not_a_target_and_not_reported():
    b = Builder()
    q, k = b.input("q", (2, 4, 3, 8)), b.input("k", (2, 4, 8, 3))
    b.output(b.op("Add", b.op("MatMul", q, k), b.param(3)))
    r = apply(b.graph, gemm)
    assert ops(b.graph) == ["MatMul", "Add"] and not r.refusals


def test_activation_input_used_elsewhere_is_refused_and_bias_still_fused():
    b = Builder()
    x = b.input("x", X)
    y = b.op("Add", b.op("MatMul", x, b.param(8, 16)), b.param(16))
    b.output(b.op("Relu", y), y)
    r = _fused_same(b, gemm, want_ops=["FusedGemm", "Relu"])
    assert b.graph.nodes[0].attrs["activation"] == "none"
    assert "its input" in reasons(r) and "also used elsewhere" in reasons(r)


def test_broadcasting_add_after_bias_is_not_a_residual():
    b = Builder()
    x, r = b.input("x", X), b.input("r", (1, 3, 16))
    y = b.op("Add", b.op("MatMul", x, b.param(8, 16)), b.param(16))
    b.output(b.op("Add", y, r))
    _fused_same(b, gemm, want_ops=["FusedGemm", "Add"])
    assert b.graph.nodes[0].inputs[3] is None


# ---- gated MLP ---------------------------------------------------------------------------------

def _mlp(form: str, act: str = "silu", up_n: int = 16, swap: bool = False) -> Builder:
    """down(act(x @ Wg) * (x @ Wu)) with MatMul (form 'matmul') or Linear (form 'linear') projections;
    form 'mixed': the gate is a Linear, the up projection a MatMul."""
    b = Builder()
    x = b.input("x", X)
    if form == "linear":
        g, u = b.op("Linear", x, b.param(16, 8)), b.op("Linear", x, b.param(up_n, 8))
    elif form == "mixed":
        g, u = b.op("Linear", x, b.param(16, 8)), b.op("MatMul", x, b.param(8, up_n))
    else:
        g = b.op("Add", b.op("MatMul", x, b.param(8, 16)), b.param(16))
        u = b.op("Add", b.op("MatMul", x, b.param(8, up_n)), b.param(up_n))
    h = _act(b, act, g)
    h = b.op("Mul", u, h) if swap else b.op("Mul", h, u)
    b.output(b.op("MatMul", h, b.param(16, 8)))
    return b


@pytest.mark.parametrize("form, act, swap", [("matmul", "silu", False), ("linear", "silu", True),
                                             ("matmul", "gelu", True), ("linear", "gelu_tanh", False)])
def test_gated_mlp(form, act, swap):
    b = _mlp(form, act, swap=swap)
    _fused_same(b, gated_mlp, gemm, want_ops=["FusedGatedMLP", "FusedGemm"])
    node = b.graph.nodes[0]
    assert node.attrs == {"trans_b": int(form == "linear"), "activation": act, "packed": 0}
    assert (node.inputs[3] is None) == (form == "linear")


@pytest.mark.parametrize("form, up_n, reason", [
    ("linear", 1, "gate weight (16, 8) and up weight (1, 8) differ in shape"),  # a broadcasting Mul
    ("mixed", 16, "gate and up weights differ in layout (one transposed)"),
])
def test_gated_mlp_near_misses_are_refused(form, up_n, reason):
    b = _mlp(form, up_n=up_n)
    r = apply(b.graph, recognize_silu, gated_mlp)
    assert "FusedGatedMLP" not in ops(b.graph) and reason in reasons(r)


def _packed_mlp(n2: int, form: str = "linear", bias: bool = False) -> Builder:
    """Phi-3's MLP: one projection to both halves, chunk(2, -1), act(gate) * up, then down."""
    b = Builder()
    x = b.input("x", X)
    if form == "linear":
        h = b.op("Linear", x, b.param(n2, 8), b.param(n2) if bias else None)
    else:
        h = b.op("MatMul", x, b.param(8, n2))
    gate, up = b.op("aten::chunk", h, n_out=2, chunks=2, dim=-1)
    y = b.op("Mul", up, b.op("Silu", gate))
    b.output(b.op("Linear", y, b.param(8, n2 // 2)))
    return b


@pytest.mark.parametrize("form, bias", [("linear", False), ("linear", True), ("matmul", False)])
def test_packed_gate_up_projection(form, bias):
    b = _packed_mlp(32, form, bias)
    _fused_same(b, gated_mlp, want_ops=["FusedGatedMLP", "Linear"])
    node = b.graph.nodes[0]
    assert node.attrs["packed"] == 1 and node.inputs[2] is None and node.inputs[4] is None
    assert (node.inputs[3] is not None) == bias


def test_packed_gate_up_of_odd_size_is_refused():
    """chunk(2) of 3 columns gives 2 and 1, which the Mul broadcasts: not a gate and an up weight of one shape."""
    b = Builder()
    x = b.input("x", X)
    gate, up = b.op("aten::chunk", b.op("Linear", x, b.param(3, 8)), n_out=2, chunks=2, dim=-1)
    b.output(b.op("Mul", b.op("Silu", gate), up))
    r = apply(b.graph, gated_mlp)
    assert "FusedGatedMLP" not in ops(b.graph)
    assert "the packed gate/up weight" in reasons(r) and "has N=3, not a static even size" in reasons(r)


@pytest.mark.parametrize("disable, want", [
    ((), ["FusedGatedMLP", "FusedGemm"]),
    (("gated_mlp",), ["FusedGemm", "FusedGemm", "Mul", "FusedGemm"]),
    (("gemm",), ["FusedGatedMLP", "MatMul"]),
    (("gated_mlp", "gemm"), ["MatMul", "Add", "Sigmoid", "Mul", "MatMul", "Add", "Mul", "MatMul"]),
    (("gated_mlp", "gemm", "recognize_silu"), ["MatMul", "Add", "Sigmoid", "Mul", "MatMul", "Add", "Mul", "MatMul"]),
])
def test_disabling_passes_by_name(disable, want):
    b = _mlp("matmul")
    ref = b.run()
    report = run_passes(b.graph, disable=disable)
    assert sorted(ops(b.graph)) == sorted(want)
    assert report.fusions.get("gemm", 0) == (0 if "gemm" in disable else want.count("FusedGemm"))
    torch.testing.assert_close(b.run()[0], ref[0], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot be disabled"):
        run_passes(b.graph, disable=["finalize"])


def test_decomposed_linear_between_reshapes_takes_its_epilogue():
    """view(addmm(b, view(x), permute(W))) then gelu, as run_decompositions() writes a 3-D linear."""
    b = Builder()
    x = b.input("x", X)
    flat = b.op("Reshape", x, shape=[6, 8])
    y = b.op("Gemm", flat, b.op("Transpose", b.param(16, 8, name="w"), perm=[1, 0]), b.param(16, name="bias"))
    y = b.op("Gelu", b.op("Reshape", y, shape=[2, 3, 16]), approximate="tanh")
    b.output(y)
    _fused_same(b, gemm, want_ops=["FusedGemm"])
    node = b.graph.nodes[0]
    assert node.inputs[0] is x and node.inputs[1].name == "w"
    assert node.attrs == {"trans_b": 1, "activation": "gelu_tanh"}


# ---- grouped projections -------------------------------------------------------------------------

def _linear(b: Builder, x, n: int, name: str, bias: bool = True):
    y = b.op("MatMul", x, b.op("Transpose", b.param(n, X[-1], name=f"w{name}"), perm=[1, 0]))
    return b.op("Add", y, b.param(n, name=f"b{name}")) if bias else y


def test_projections_of_one_input_become_one_group():
    """A layer's Q, K and V (GQA widths) of one input: one FusedGemmGroup reading the three weights in place, its
    outputs the projections' own values."""
    b = Builder()
    x = b.input("x", X)
    outs = [_linear(b, x, n, name) for n, name in ((16, "q"), (4, "k"), (4, "v"))]
    for y in outs:
        b.output(b.op("Relu", b.op("Reshape", y, shape=[2, 3, 2, -1])))
    _fused_same(b, gemm_group, gemm, want_ops=["FusedGemmGroup", "Reshape", "Relu", "Reshape", "Relu", "Reshape",
                                              "Relu"])
    node = b.graph.nodes[0]
    assert [v.name for v in node.inputs] == ["x", "wq", "wk", "wv", "bq", "bk", "bv"]
    assert node.outputs == outs and node.attrs == {"trans_b": 1}


def test_two_projections_group_and_a_fourth_is_a_gemm():
    """Four projections of one input: the first three group, the fourth is a plain GEMM; K and V alone group in
    two (the third weight absent)."""
    b = Builder()
    x = b.input("x", X)
    for name in "qkvo":
        b.output(_linear(b, x, 8, name))
    _fused_same(b, gemm_group, gemm, want_ops=["FusedGemmGroup", "FusedGemm"])
    b = Builder()
    x = b.input("x", X)
    for name in "kv":
        b.output(_linear(b, x, 8, name, bias=False))
    _fused_same(b, gemm_group, gemm, want_ops=["FusedGemmGroup"])
    assert b.graph.nodes[0].inputs[3:] == [None] * 4 and len(b.graph.nodes[0].outputs) == 2


def test_a_projection_with_an_activation_or_residual_stays_a_gemm():
    """The GEMM rule fuses an activation or a residual into its projection: those are not grouped."""
    b = Builder()
    x, res = b.input("x", X), b.input("res", (2, 3, 8))
    b.output(_linear(b, x, 8, "q"))
    b.output(_linear(b, x, 8, "k"))
    b.output(b.op("Relu", _linear(b, x, 8, "u")))
    b.output(b.op("Add", _linear(b, x, 8, "r"), res))
    _fused_same(b, gemm_group, gemm, want_ops=["FusedGemmGroup", "FusedGemm", "FusedGemm"])
    assert [n.attrs.get("activation") for n in b.graph.nodes[1:]] == ["relu", "none"]
    assert b.graph.nodes[2].inputs[3].name == "res"


def test_a_projection_without_a_bias_groups_with_a_zero_one():
    """Whisper's k_proj has no bias beside q_proj's and v_proj's: the three group, k reading a zero bias of its
    width (a constant the pass makes), and the group computes what the three projections did."""
    b = Builder()
    x = b.input("x", X)
    b.output(_linear(b, x, 8, "q"))
    b.output(_linear(b, x, 4, "k", bias=False))
    b.output(_linear(b, x, 8, "v"))
    _fused_same(b, gemm_group, gemm, want_ops=["FusedGemmGroup"])
    node = b.graph.nodes[0]
    zero = node.inputs[5]
    assert [v.name for v in node.inputs[1:4]] == ["wq", "wk", "wv"] and node.inputs[4].name == "bq"
    assert zero.shape == (4,) and zero.dtype == "float32" and zero.const is not None and not zero.const.any()


def test_projections_differing_in_layout_or_input_are_not_grouped():
    """A weight of another layout beside two alike is refused from the group by name; projections of different
    inputs never group."""
    b = Builder()
    x = b.input("x", X)
    b.output(_linear(b, x, 8, "q"))
    b.output(b.op("Add", b.op("MatMul", x, b.param(X[-1], 8, name="wk")), b.param(8, name="bk")))
    b.output(_linear(b, x, 8, "v"))
    r = _fused_same(b, gemm_group, gemm, want_ops=["FusedGemm", "FusedGemmGroup"])
    assert [n.name for n in b.graph.nodes[1].inputs[1:3]] == ["wq", "wv"]
    assert "FusedGemmGroup not formed for wk: the other projections of x differ in weight layout" in reasons(r)
    b = Builder()
    x, z = b.input("x", X), b.input("z", X)
    b.output(_linear(b, x, 8, "q"))
    b.output(_linear(b, z, 8, "k"))
    _fused_same(b, gemm_group, gemm, want_ops=["FusedGemm", "FusedGemm"])


# ---- real exports ------------------------------------------------------------------------------

MINE = ("add_norm", "gemm", "gemm_group", "gated_mlp")
REAL = [("mlp", "torchscript"), ("bert_layer", "torchscript"), ("gpt2_block", "torchscript"),
        ("llama_block", "torchscript"), ("gpt2_block", "fx"), ("llama_block", "fx"),
        pytest.param("gpt2_block", "fx_decomposed", marks=pytest.mark.slow), ("llama_block", "fx_decomposed"),
        pytest.param("mlp", "dynamo", marks=pytest.mark.slow),
        pytest.param("llama_block", "dynamo", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name, how", REAL)
def test_reference_models_fuse_as_expected(name, how):
    """GEMM, gated-MLP and norm fusions fire on real exports as many times as the model calls for;
    ONNX results are checked against onnxruntime on the original model."""
    from tkopt.api import optimize_onnx
    from tkopt.frontends.fx import import_fx
    from tkopt.models.blocks import EXPECTED_FUSIONS

    model = exported(name, how)
    if how.startswith("fx"):
        graph = import_fx(model)
        report = run_passes(graph)
        assert not [n for n in graph.nodes if n.replaced and not n.domain]  # no stand-in left over
    else:
        _, rep = optimize_onnx(model, report=False, check_accuracy=True)
        report = rep.passes
        assert rep.accuracy.ok, rep.accuracy
    want = {k: EXPECTED_FUSIONS[name][k] for k in MINE}
    assert {k: report.fusions.get(k, 0) for k in MINE} == want, [str(r) for r in report.refusals]
    assert not [r for r in report.refusals if r.rule in MINE], [str(r) for r in report.refusals]


def test_disabling_passes_on_a_real_model():
    from tkopt.api import optimize_onnx

    _, rep = optimize_onnx(exported("llama_block", "torchscript"), disable=["add_norm", "gated_mlp"],
                           report=False, check_accuracy=True)
    assert rep.accuracy.ok and "add_norm" not in rep.passes.fusions and "gated_mlp" not in rep.passes.fusions
    # gate (+ silu) and up become plain GEMMs beside o and down; q, k and v one group
    assert rep.passes.fusions["gemm"] == 4 and rep.passes.fusions["gemm_group"] == 1
    assert rep.passes.edits.get("finalize", 0) >= 2  # the unused RMSNorm stand-ins were expanded back
