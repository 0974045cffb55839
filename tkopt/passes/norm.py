"""Norm fusion: [residual Add +] LayerNormalization / RMSNormalization -> FusedAddNorm.

Transformer blocks add a residual and normalize it right away; one kernel reads both tensors
once, writes the normalized result and, where later layers need it (pre-norm blocks), the sum.
Fusion covers the last axis only (what the kernel does); other norms are refused with a reason.
"""

from __future__ import annotations

import numpy as np

from tkopt.ir import Graph, Node, Value

from .base import FusionError, PassResult, fuse
from .patterns import is_last_axis, is_op, last_dim
from .pipeline import register
from .shapes import ShapedIndex, shape_mismatch

KINDS = {"LayerNormalization": "layer", "RMSNormalization": "rms"}


def _param_problem(what: str, p: Value | None, x: Value) -> str | None:
    """Why `p` is not a 1-D parameter matching x's last dim (None if it is, or is absent)."""
    if p is None:
        return None
    d = last_dim(x)
    if p.shape is None or len(p.shape) != 1 or d is None or p.shape[0] != d:
        return f"{what} {p.name} has shape {p.shape}, expected ({d},) for the last axis"
    return None


def _ones(ix: ShapedIndex, p: Value | None, norm: Node) -> bool:
    """Whether weight `p` is ConstantOfShape(shape, 1) leaving the norm's output shape alone: the dynamo
    exporter's scale for a weightless RMSNorm at opset 23 (ONNX requires one). A parameter that happens
    to hold ones is a weight (it may be trained or loaded later), not its absence."""
    if p is None or norm.inputs[0] is None or norm.outputs[0].shape != norm.inputs[0].shape:
        return False
    node = ix.producer(p, "ConstantOfShape")
    return node is not None and bool(np.all(np.asarray(node.attr("value", 0.0)) == 1))


def _residual(ix: ShapedIndex, x: Value, result: PassResult, norm: Node) -> Node | None:
    """The residual Add producing x, if it provably adds two same-shaped activations (refused if it may
    broadcast: the kernel adds row by row)."""
    add = ix.producer(x, "Add")
    if add is None:
        return None
    a, b = add.inputs[0], add.inputs[1]
    if a is None or b is None or a.const is not None or b.const is not None:
        return None  # a bias or constant shift: not a residual; the GEMM pass takes a bias
    shapes = ix.shapes
    problem = shape_mismatch(shapes, a, x) or shape_mismatch(shapes, b, x)
    if problem:
        result.refuse(norm, f"residual Add {add.name} not fused ({problem}): normalized without the add")
        return None
    return add


def _fuse_norm(graph: Graph, ix: ShapedIndex, norm: Node, result: PassResult) -> bool:
    kind = KINDS[norm.op]
    x = norm.inputs[0]
    weight = norm.inputs[1] if len(norm.inputs) > 1 else None
    bias = norm.inputs[2] if len(norm.inputs) > 2 else None
    if _ones(ix, weight, norm):
        weight = None
    if x is None:
        return False
    axis = norm.attr("axis", -1)
    if not is_last_axis(axis, x.rank):
        result.refuse(norm, f"{norm.op} over axis {axis} of a rank-{x.rank} input: only the last axis is fused")
        return False
    problem = _param_problem("weight", weight, x) or _param_problem("bias", bias, x)
    if problem:
        result.refuse(norm, f"{norm.op}: {problem}")
        return False
    # native_layer_norm's mean/rstd outputs: only fusable when nothing reads them.
    if any(ix.users(o) or ix.is_output(o) for o in norm.outputs[1:]):
        result.refuse(norm, f"{norm.op}: its mean/inv-std outputs are used")
        return False
    eps = float(norm.attr("epsilon", 1e-5))
    attrs = {"kind": kind, "epsilon": eps}
    add = _residual(ix, x, result, norm)
    if add is not None:
        s = add.outputs[0]
        used_later = ix.is_output(s) or any(u is not norm for u in ix.users(s))
        try:
            fuse(graph, [add, norm], "FusedAddNorm", [add.inputs[0], add.inputs[1], weight, bias],
                 [norm.outputs[0], s if used_later else None], attrs, ix)
            return True
        except FusionError as e:
            result.refuse(norm, f"residual Add {add.name} not fused: {e}")
    try:
        fuse(graph, [norm], "FusedAddNorm", [x, None, weight, bias], [norm.outputs[0]], attrs, ix)
    except FusionError as e:
        result.refuse(norm, f"{norm.op} not fused: {e}")
        return False
    return True


@register("add_norm", fusion=True)
def add_norm(graph: Graph, result: PassResult) -> None:
    """Residual Add + LayerNorm/RMSNorm (or a norm alone) -> FusedAddNorm(X, residual, weight, bias)."""
    ix = ShapedIndex(graph)
    for node in [n for n in graph.nodes if is_op(n, tuple(KINDS))]:
        if _fuse_norm(graph, ix, node, result):
            result.fused += 1
