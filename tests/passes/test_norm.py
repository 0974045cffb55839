"""Residual Add + LayerNorm/RMSNorm -> FusedAddNorm: pre-/post-norm blocks, stand-ins, refusals."""

from __future__ import annotations

import torch

from tkopt.passes.norm import add_norm
from tkopt.passes.recognize import recognize_rms_norm

from .ir_helpers import Builder, apply, ops, reasons

SHAPE = (2, 3, 16)


def _same(b: Builder, want: list[torch.Tensor]) -> None:
    for got, ref in zip(b.run(), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def _block(pre_norm: bool, op: str = "LayerNormalization", shape_r=SHAPE, w_shape=(16,), axis=-1):
    b = Builder()
    x, r = b.input("x", SHAPE), b.input("r", shape_r)
    h = b.op("Add", x, r)
    params = [b.param(*w_shape, name="w")] + ([b.param(16, name="b")] if op == "LayerNormalization" else [])
    y = b.op(op, h, *params, axis=axis, epsilon=1e-5)
    b.output(b.op("Add", y, h) if pre_norm else y)  # pre-norm: the sum feeds the next residual
    return b


def test_pre_norm_block_keeps_the_sum():
    b = _block(pre_norm=True)
    want = b.run()
    r = apply(b.graph, add_norm)
    assert r.fused == 1 and ops(b.graph) == ["FusedAddNorm", "Add"]
    fused = b.graph.nodes[0]
    assert len(fused.outputs) == 2 and fused.attrs == {"kind": "layer", "epsilon": 1e-5}
    assert [v.name for v in fused.inputs] == ["x", "r", "w", "b"]
    _same(b, want)


def test_post_norm_block_has_one_output():
    b = _block(pre_norm=False)
    want = b.run()
    apply(b.graph, add_norm)
    assert ops(b.graph) == ["FusedAddNorm"] and len(b.graph.nodes[0].outputs) == 1
    _same(b, want)


def test_rms_norm_stand_in_with_residual():
    b = Builder()
    x, res = b.input("x", SHAPE), b.input("r", SHAPE)
    h = b.op("Add", res, x)
    var = b.op("ReduceMean", b.op("Pow", h, 2.0), axes=[-1])
    y = b.op("Mul", h, b.op("Rsqrt", b.op("Add", var, 1e-6)))
    b.output(b.op("Mul", y, b.param(16, name="w")))
    want = b.run()
    r = apply(b.graph, recognize_rms_norm, add_norm)
    assert r.fused == 1 and ops(b.graph) == ["FusedAddNorm"]
    fused = b.graph.nodes[0]
    assert fused.attrs == {"kind": "rms", "epsilon": 1e-6} and fused.inputs[3] is None
    assert sorted(n.op for n in fused.replaced) == ["Add", "Add", "Mul", "Mul", "Pow", "ReduceMean", "Rsqrt"]
    _same(b, want)


def test_norm_without_add_and_bias_add_is_not_a_residual():
    b = Builder()
    x = b.input("x", SHAPE)
    h = b.op("Add", x, b.param(16))  # a bias: left for the GEMM epilogue, no complaint
    b.output(b.op("LayerNormalization", h, b.param(16), b.param(16), axis=-1, epsilon=1e-5))
    want = b.run()
    r = apply(b.graph, add_norm)
    assert ops(b.graph) == ["Add", "FusedAddNorm"] and not r.refusals
    assert b.graph.nodes[1].inputs[1] is None
    _same(b, want)


def test_broadcasting_add_is_refused_and_the_norm_fused_alone():
    b = _block(pre_norm=False, shape_r=(1, 3, 16))
    want = b.run()
    r = apply(b.graph, add_norm)
    assert ops(b.graph) == ["Add", "FusedAddNorm"]
    assert "not fused (axis 0 of r (1) is not provably add_0's (2): it may broadcast)" in reasons(r)
    _same(b, want)


def test_non_last_axis_and_bad_weight_shape_are_refused():
    b = _block(pre_norm=False, axis=-2, w_shape=(3, 16))
    r = apply(b.graph, add_norm)
    assert r.fused == 0 and "over axis -2 of a rank-3 input: only the last axis is fused" in reasons(r)
    b = _block(pre_norm=False, w_shape=(1, 16))
    r = apply(b.graph, add_norm)
    assert r.fused == 0 and "weight w has shape (1, 16), expected (16,)" in reasons(r)
