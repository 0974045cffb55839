"""Constant folding and no-op removal on hand-built graphs: what folds, what must not, same results."""

from __future__ import annotations

import numpy as np
import torch

from tkopt.ir import Node, Value
from tkopt.passes.canonicalize import FOLD_LIMIT, drop_identity, fold_constants, merge_duplicates

from .ir_helpers import Builder, apply, ops


def _i64(v) -> np.ndarray:
    return np.asarray(v, dtype=np.int64)


def test_shape_chain_folds_into_reshape_constant():
    b = Builder()
    x = b.input("x", (2, 3, 8))
    s = b.op("Shape", x)
    d0 = b.op("Gather", s, b.const(_i64(0), dtype=torch.int64), axis=0)
    u = b.op("Unsqueeze", d0, axes=[0])
    shape = b.op("Concat", u, b.const(_i64([-1]), dtype=torch.int64), axis=0)
    g = b.output(b.op("Reshape", x, shape))
    want = b.run()
    r = apply(g, fold_constants)
    assert ops(g) == ["Reshape"] and r.changed == 4
    reshape = g.nodes[0]
    assert reshape.inputs[1] is shape and shape.const.tolist() == [2, -1]
    assert reshape.attrs["shape"] == [2, -1]  # the canonical attribute mirrors the now-constant input
    assert torch.equal(b.run()[0], want[0])


def test_shape_of_symbolic_dims_is_not_folded():
    b = Builder()
    x = b.input("x", (2, 3))
    s = b.op("Shape", x)
    g = b.output(b.op("Reshape", x, s))
    x.shape = ("batch", 3)
    assert apply(g, fold_constants).changed == 0
    assert ops(g) == ["Shape", "Reshape"]


def test_arithmetic_on_constants_folds_and_large_results_do_not():
    b = Builder()
    x = b.input("x", (4, 4))
    half = b.op("Div", b.const(np.float32(1.0)), b.const(np.float32(2.0)))
    big = b.op("Add", b.param(64, 64), b.param(64, 64))  # 4096 elements: a weight, not a shape
    g = b.output(b.op("Mul", x, half), big)
    assert 64 * 64 > FOLD_LIMIT
    apply(g, fold_constants)
    assert ops(g) == ["Add", "Mul"]
    assert float(half.const) == 0.5 and half.dtype == "float32"


def test_float32_power_folds_to_what_onnx_runtime_computes():
    """A float32 power folds to the correctly rounded value, which ORT's powf computes: numpy's float32 power is an
    ulp off at 6 ** -0.5, and a float64 model scaled by that exported constant moved by 7e-8 (fuzz seed 2270)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    bases, exps = np.array([6, 3, 10, 64, 7], np.float32), np.array([-0.5, 0.5, 1.5, -0.5, -1 / 3], np.float32)
    b = Builder()
    x = b.input("x", (5,))
    p = b.op("Pow", b.const(bases), b.const(exps))
    g = b.output(b.op("Mul", x, p))
    apply(g, fold_constants)
    assert ops(g) == ["Mul"] and p.dtype == "float32"
    graph = helper.make_graph([helper.make_node("Pow", ["b", "e"], ["y"])], "pow", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])],
                              [helper.make_tensor("b", TensorProto.FLOAT, [5], bases),
                               helper.make_tensor("e", TensorProto.FLOAT, [5], exps)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT's kernel, not its folding
    [want] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {})
    assert p.const.tolist() == want.tolist()


def test_constant_node_becomes_const_value_but_graph_outputs_stay_produced():
    b = Builder()
    x = b.input("x", (3,))
    c = b.op("Constant", value=np.array([1.0, 2.0, 3.0], np.float32))
    c_out = b.op("Constant", value=np.array([5.0], np.float32))
    g = b.output(b.op("Add", x, c), c_out)
    apply(g, fold_constants)
    assert sorted(ops(g)) == ["Add", "Constant"]
    assert c.const.tolist() == [1.0, 2.0, 3.0]


def test_integer_division_truncates_like_onnx():
    b = Builder()
    x = b.input("x", (2,))
    q = b.op("Cast", b.const(_i64([-7, 7]), dtype=torch.int64), to="int64")
    d = b.op("Div", q, b.const(_i64(2), dtype=torch.int64))
    g = b.output(b.op("Add", x, b.op("Cast", d, to="float32")))
    apply(g, fold_constants)
    assert d.const.tolist() == [-3, 3] and ops(g) == ["Add"]


def test_identity_and_noop_cast_are_dropped_real_casts_kept():
    b = Builder()
    x = b.input("x", (2, 4))
    i = b.op("Identity", x)
    c = b.op("Cast", i, to="float32")  # no-op: already float32
    h = b.op("Cast", c, to="float16")
    y = b.op("Relu", b.op("Cast", h, to="float32"))
    out_id = b.op("Identity", y)  # a graph output: keeps its producer so the output name survives
    g = b.output(out_id)
    want = b.run()
    r = apply(g, drop_identity)
    assert r.changed == 2
    assert ops(g) == ["Cast", "Cast", "Relu", "Identity"]
    assert g.nodes[0].inputs[0] is x
    assert torch.equal(b.run()[0], want[0])


def test_slices_that_keep_every_element_are_dropped_others_kept():
    """From 0 in steps of 1 to the end (the 2**63 - 1 sentinel, or past a static size) is a no-op; a slice that
    starts later, steps, or ends at a symbolic size it cannot be compared with stays."""
    b = Builder()
    x = b.input("x", (2, 5, 4))
    whole = b.op("Slice", x, starts=[0, 0], ends=[2**63 - 1, 9], axes=[1, -1], steps=[1, 1])
    kept = [b.op("Slice", whole, starts=[1], ends=[2**63 - 1], axes=[1], steps=[1]),
            b.op("Slice", whole, starts=[0], ends=[2**63 - 1], axes=[1], steps=[2]),
            b.op("Slice", whole, starts=[0], ends=[4], axes=[1], steps=[1]),
            b.op("Slice", whole, starts=[0], ends=[-1], axes=[2])]
    g = b.output(*(b.op("Relu", y) for y in kept))
    want = b.run()
    assert apply(g, drop_identity).changed == 1
    assert all(g.producer(y).inputs[0] is x for y in kept)  # type: ignore[union-attr]
    assert [torch.equal(got, w) for got, w in zip(b.run(), want, strict=True)] == [True] * 4
    symbolic = b.op("Slice", x, starts=[0], ends=[5], axes=[1], steps=[1])
    x.shape = (2, "seq", 4)
    g = b.output(b.op("Relu", symbolic))
    assert apply(g, drop_identity).changed == 0


def test_duplicate_pure_nodes_merge_through_chains():
    """Cohere's norm: `x - mean` written twice (for the variance and for the output) becomes one Sub,
    and what reads the duplicates then matches too (a chain of duplicates collapses)."""
    b = Builder()
    x = b.input("x", (2, 3, 8))
    mean = b.op("ReduceMean", x, axes=[-1], keepdims=1)
    d1, d2 = b.op("Sub", x, mean), b.op("Sub", x, mean)
    var = b.op("ReduceMean", b.op("Mul", d1, d1), axes=[-1], keepdims=1)
    other = b.op("Sub", mean, x)  # same op, other input order: a different value
    e1, e2 = b.op("Tanh", d1), b.op("Tanh", d2)
    g = b.output(b.op("Add", b.op("Div", e2, var), b.op("Add", e1, other)))
    want = b.run()
    r = apply(g, merge_duplicates)
    assert r.changed == 2 and ops(g).count("Sub") == 2 and ops(g).count("Tanh") == 1
    assert torch.equal(b.run()[0], want[0])


def test_random_unmapped_attribute_distinct_and_output_nodes_do_not_merge():
    b = Builder()
    x = b.input("x", (2, 8))
    casts = [b.op("Cast", x, to="float16"), b.op("Cast", x, to="float64")]  # attributes differ
    outs = [b.op("Relu", x), b.op("Relu", x)]  # both graph outputs: their names stay
    g = b.output(*casts, *outs)
    for op in ("Dropout", "Dropout", "aten::bernoulli", "aten::bernoulli"):  # random: separate draws
        g.add_node(Node(op, [x], [Value(g.fresh_name(op), "float32", (2, 8))], {"p": 0.5}))
    assert apply(g, merge_duplicates).changed == 0
