"""Recognition of decomposed GELU/SiLU/LayerNorm/RMSNorm: every spelling fires, near misses are
refused with a reason, the stand-in computes the same, and finalize restores the original nodes."""

from __future__ import annotations

import math

import pytest
import torch

from tkopt.ir import Node
from tkopt.passes.finalize import expand_standins, finalize
from tkopt.passes.pipeline import run_passes
from tkopt.passes.recognize import recognize_gelu, recognize_layer_norm, recognize_rms_norm, recognize_silu

from .ir_helpers import Builder, apply, ops, reasons

ALL = (recognize_gelu, recognize_silu, recognize_layer_norm, recognize_rms_norm)
SHAPE = (2, 3, 16)


def _check(b: Builder, op: str, attrs: dict | None = None, atol: float = 1e-5):
    """Recognition gives exactly one `op` stand-in, same numbers; finalize gives the original ops back."""
    g = b.graph
    before, want = ops(g), b.run()
    r = apply(g, *ALL)
    assert ops(g) == [op], (ops(g), reasons(r))
    node = g.nodes[0]
    assert node.replaced and node.origin is None and not node.domain
    for k, v in (attrs or {}).items():
        assert node.attrs[k] == pytest.approx(v), (k, node.attrs)
    got = b.run()
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=1e-3)
    expand_standins(g)
    assert sorted(ops(g)) == sorted(before)
    return node


# ---- GELU --------------------------------------------------------------------------------------

def _gelu_erf(form: str, scale: float | None = None, half: float = 0.5) -> Builder:
    b = Builder()
    x = b.input("x", SHAPE)
    if form in ("div", "div4"):
        arg = b.op("Div", x, scale or (1.4142 if form == "div4" else math.sqrt(2)))
    else:
        arg = b.op("Mul", b.const(scale or 0.70710678), x)
    one_plus = b.op("Add", b.op("Erf", arg), 1.0) if form != "mul" else b.op("Add", 1.0, b.op("Erf", arg))
    if form == "div":  # x * 0.5 * (1 + erf)  (HF)
        y = b.op("Mul", b.op("Mul", x, half), one_plus)
    elif form == "div4":  # (x * (1 + erf)) / 2
        y = b.op("Div", b.op("Mul", x, one_plus), 1 / half)
    else:  # x * (0.5 * (1 + erf))
        y = b.op("Mul", x, b.op("Mul", half, one_plus))
    b.output(y)
    return b


@pytest.mark.parametrize("form", ["div", "div4", "mul"])
def test_gelu_erf_forms(form):
    _check(_gelu_erf(form), "Gelu", {"approximate": "none"})


def _gelu_tanh(cube: str, kappa: float = 0.044715, dtype: torch.dtype = torch.float32,
               digits: torch.dtype | None = None) -> Builder:
    """`digits`: the dtype the constants' values are rounded to before they are stored in x's."""
    b = Builder()
    x = b.input("x", SHAPE, dtype)
    rounded = (lambda v: torch.tensor(v, dtype=digits).item()) if digits else float
    c = lambda v: b.const(rounded(v), dtype=dtype)  # noqa: E731 - constants of x's dtype, as exporters write them
    x3 = b.op("Pow", x, c(3.0)) if cube == "pow" else b.op("Mul", b.op("Mul", x, x), x)
    inner = b.op("Mul", c(math.sqrt(2 / math.pi)), b.op("Add", x, b.op("Mul", c(kappa), x3)))
    y = b.op("Mul", b.op("Mul", c(0.5), x), b.op("Add", c(1.0), b.op("Tanh", inner)))
    b.output(y)
    return b


@pytest.mark.parametrize("cube", ["pow", "mul"])
def test_gelu_tanh_forms(cube):
    _check(_gelu_tanh(cube), "Gelu", {"approximate": "tanh"})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_in_16_bit_constants(dtype):
    """A 16-bit model's constants are the coefficients rounded to its dtype (fp16's sqrt(2/pi) reads 0.798, 1.4e-4
    off, beyond the fp32 tolerance): both forms are recognized; a coefficient off by more is still refused."""
    atol = 1e-2 if dtype == torch.float16 else 4e-2  # the chain rounds each step to the dtype: ~an ulp at |y| ~ 3
    _check(_gelu_tanh("pow", dtype=dtype), "Gelu", {"approximate": "tanh"}, atol=atol)
    b = Builder()
    x = b.input("x", SHAPE, dtype)
    erf = b.op("Erf", b.op("Div", x, b.const(math.sqrt(2), dtype=dtype)))
    b.output(b.op("Mul", b.op("Mul", x, b.const(0.5, dtype=dtype)), b.op("Add", erf, b.const(1.0, dtype=dtype))))
    _check(b, "Gelu", {"approximate": "none"}, atol=atol)
    off = _gelu_tanh("pow", kappa=0.0455, dtype=dtype)  # 1.8% off: more than two bfloat16 roundings
    r = apply(off.graph, recognize_gelu)
    assert "Gelu" not in ops(off.graph) and "cubic coefficient is 0.04" in reasons(r)


def test_gelu_in_float64_needs_its_exact_constants():
    """A float64 model computes to ~1e-16: its GELU is recognized with exact coefficients, and refused with the
    coefficients rounded to float32 (torch's dynamo exporter stores Python scalars so, as float64 tensors), which
    move its results by ~1e-8: the fused op computes the exact function and would not reproduce them."""
    node = _check(_gelu_tanh("pow", dtype=torch.float64), "Gelu", {"approximate": "tanh"}, atol=1e-12)
    assert node.inputs[0].dtype == "float64"
    off = _gelu_tanh("pow", dtype=torch.float64, digits=torch.float32)
    r = apply(off.graph, recognize_gelu)
    assert "Gelu" not in ops(off.graph)
    assert "tanh argument scale is 0.7978845834732056, expected 0.7978845608028654" in reasons(r)
    assert "in a float64 model" in reasons(r)
    r = apply(_gelu_tanh("pow", digits=torch.float32).graph, recognize_gelu)  # float32: its own digits
    assert r.changed == 1


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda: _gelu_erf("mul", scale=0.75), "erf argument scale is 0.75"),
        (lambda: _gelu_erf("div", half=0.4), "outer coefficient is 0.4"),
        (lambda: _gelu_tanh("pow", kappa=0.05), "cubic coefficient is 0.05"),
    ],
)
def test_gelu_near_misses_are_refused(build, reason):
    b = build()
    n = len(b.graph.nodes)
    r = apply(b.graph, recognize_gelu)
    assert len(b.graph.nodes) == n and reason in reasons(r)


def test_gelu_with_shared_intermediate_is_left_alone():
    b = _gelu_erf("div")
    erf = next(n for n in b.graph.nodes if n.op == "Erf")
    b.output(erf.outputs[0])  # erf(x/sqrt2) is also a graph output
    r = apply(b.graph, recognize_gelu)
    assert "Gelu" not in ops(b.graph) and r.changed == 0


# ---- SiLU --------------------------------------------------------------------------------------

@pytest.mark.parametrize("swap", [False, True])
def test_silu(swap):
    b = Builder()
    x = b.input("x", SHAPE)
    s = b.op("Sigmoid", x)
    b.output(b.op("Mul", *((s, x) if swap else (x, s))))
    _check(b, "Silu")


def test_sigmoid_gate_of_another_value_is_not_silu():
    b = Builder()
    x, z = b.input("x", SHAPE), b.input("z", SHAPE)
    b.output(b.op("Mul", z, b.op("Sigmoid", x)))
    apply(b.graph, recognize_silu)
    assert ops(b.graph) == ["Sigmoid", "Mul"]


# ---- LayerNorm ---------------------------------------------------------------------------------

def _layer_norm(den: str = "div", axes=(-1,), affine: bool = True, eps: object = 1e-5, square: str = "pow"):
    b = Builder()
    x = b.input("x", SHAPE)
    mean = b.op("ReduceMean", x, axes=list(axes), keepdims=1)
    d = b.op("Sub", x, mean)
    sq = b.op("Pow", d, 2.0) if square == "pow" else b.op("Mul", d, d)
    var = b.op("ReduceMean", sq, axes=list(axes), keepdims=1)
    v = b.op("Add", var, eps if isinstance(eps, float) else b.input("eps", ()))
    if den == "div":
        y = b.op("Div", d, b.op("Sqrt", v))
    elif den == "rsqrt":
        y = b.op("Mul", d, b.op("Rsqrt", v))
    else:
        y = b.op("Mul", b.op("Reciprocal", b.op("Sqrt", v)), d)
    if affine:
        y = b.op("Add", b.op("Mul", b.param(16, name="w"), y), b.param(16, name="b"))
    b.output(y)
    return b


@pytest.mark.parametrize("den", ["div", "rsqrt", "reciprocal"])
@pytest.mark.parametrize("square", ["pow", "mul"])
def test_layer_norm_forms(den, square):
    node = _check(_layer_norm(den, square=square), "LayerNormalization", {"axis": -1, "epsilon": 1e-5})
    assert [v.name for v in node.inputs[1:]] == ["w", "b"]


def test_layer_norm_without_affine_and_over_two_axes():
    node = _check(_layer_norm(affine=False, axes=(-2, -1)), "LayerNormalization", {"axis": -2})
    assert node.inputs[1:] == [None, None]


def test_layer_norm_near_misses():
    b = _layer_norm(axes=(1,), affine=False)  # rank 3, axis 1 is not trailing
    r = apply(b.graph, recognize_layer_norm)
    assert "LayerNormalization" not in ops(b.graph)
    assert "mean over axes [1]" in reasons(r) and "not over the trailing axes" in reasons(r)
    b = _layer_norm(eps=None)
    r = apply(b.graph, recognize_layer_norm)
    assert "epsilon is not a non-negative constant scalar" in reasons(r)


# ---- RMSNorm -----------------------------------------------------------------------------------

def _rms(den: str = "rsqrt", cast: str = "none", dtype=torch.float32, weight: bool = True) -> Builder:
    """HF Llama-style RMSNorm; cast: none | back (w * y.to(dtype)) | back_after_w ((w * y).to(dtype))."""
    b = Builder()
    x = b.input("x", SHAPE, dtype)
    xf = b.op("Cast", x, to="float32") if cast != "none" else x
    var = b.op("ReduceMean", b.op("Pow", xf, 2.0) if den != "sqrt_div" else b.op("Mul", xf, xf), axes=[-1])
    v = b.op("Add", var, 1e-6)
    if den == "rsqrt":
        y = b.op("Mul", xf, b.op("Rsqrt", v))
    elif den == "reciprocal":
        y = b.op("Mul", xf, b.op("Reciprocal", b.op("Sqrt", v)))
    elif den == "one_div":
        y = b.op("Mul", b.op("Div", 1.0, b.op("Sqrt", v)), xf)
    else:
        y = b.op("Div", xf, b.op("Sqrt", v))
    w = b.param(16, name="w")
    if cast == "back":
        y = b.op("Cast", y, to="float16")
        w = b.const(w.const, "w16", dtype=torch.float16)
    if weight:
        y = b.op("Mul", w, y)
    if cast == "back_after_w":
        y = b.op("Cast", y, to="float16")
    b.output(y)
    return b


@pytest.mark.parametrize("den", ["rsqrt", "reciprocal", "one_div", "sqrt_div"])
def test_rms_norm_forms(den):
    node = _check(_rms(den), "RMSNormalization", {"axis": -1, "epsilon": 1e-6})
    assert node.inputs[1].name == "w"


@pytest.mark.parametrize("cast", ["back", "back_after_w"])
def test_rms_norm_in_float32_between_casts(cast):
    node = _check(_rms(cast=cast, dtype=torch.float16), "RMSNormalization", atol=2e-3)
    assert node.inputs[0].dtype == "float16" and node.outputs[0].dtype == "float16"
    assert node.inputs[1] is not None


def test_rms_norm_upcast_without_cast_back_keeps_the_cast_outside():
    """fp16 in, float32 out: the stand-in must read the float32 value, so the Cast stays outside."""
    b = Builder()
    h = b.input("h", SHAPE, torch.float16)
    hf = b.op("Cast", h, to="float32")
    var = b.op("ReduceMean", b.op("Pow", hf, 2.0), axes=[-1])
    b.output(b.op("Mul", hf, b.op("Rsqrt", b.op("Add", var, 1e-6))))
    r = apply(b.graph, recognize_rms_norm)
    assert ops(b.graph) == ["Cast", "RMSNormalization"] and r.changed == 1
    assert b.graph.nodes[1].inputs[0] is hf


def test_rms_norm_over_non_trailing_axis_is_refused():
    b = Builder()
    x = b.input("x", SHAPE)
    var = b.op("ReduceMean", b.op("Pow", x, 2.0), axes=[1])
    b.output(b.op("Mul", x, b.op("Rsqrt", b.op("Add", var, 1e-6))))
    r = apply(b.graph, recognize_rms_norm)
    assert "RMSNormalization" not in ops(b.graph) and "RMSNorm near match: mean over axes [1]" in reasons(r)


# ---- finalize ----------------------------------------------------------------------------------

def test_pipeline_expands_stand_ins_no_fusion_consumed():
    b = _gelu_erf("div")
    before, want = ops(b.graph), b.run()
    report = run_passes(b.graph)
    assert ops(b.graph) == before and not any(n.replaced for n in b.graph.nodes)
    assert report.edits["recognize_gelu"] == 1 and report.edits["finalize"] == 1
    torch.testing.assert_close(b.run()[0], want[0])


def test_finalize_drops_dead_canonical_nodes_only():
    b = Builder()
    x = b.input("x", SHAPE)
    dead = b.op("Relu", x)
    b.graph.add_node(Node("aten::_assert_async", [dead], []))  # reads `dead`, so both stay
    b.op("Sigmoid", x)  # dead, canonical: dropped
    b.output(b.op("Neg", x))
    r = apply(b.graph, finalize)
    assert ops(b.graph) == ["Relu", "aten::_assert_async", "Neg"] and r.changed == 1
