"""GEMM fusions: MatMul/Gemm/Linear + bias + activation + residual -> FusedGemm; gated MLP -> FusedGatedMLP.

A linear layer's epilogue (bias, activation, residual add) costs a full read and write of the
output per op when run unfused; the fused GEMM applies it in registers. Only 2-D weights are GEMM
targets: batched matmuls (attention's QK^T, PV) are left alone without comment.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tkopt.ir import Graph, Node, Value

from .base import FusionError, PassResult, fuse
from .evaluators import np_dtype
from .patterns import const_scalar, is_op, is_vector_of, other_input
from .pipeline import register
from .shapes import ShapedIndex, shape_mismatch

MATMUL_OPS = ("MatMul", "Gemm", "Linear")
SIMPLE_ACTIVATIONS = {"Relu": "relu", "Silu": "silu", "Sigmoid": "sigmoid"}


def activation_name(node: Node) -> str | None:
    """The FusedGemm activation a canonical node computes, or None if it is not one."""
    if is_op(node, "Gelu"):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(node.attr("approximate", "none"))
    return SIMPLE_ACTIVATIONS.get(node.op) if is_op(node, tuple(SIMPLE_ACTIVATIONS)) else None


@dataclass
class Base:
    """A matmul read as FusedGemm's A @ B (+ bias): its nodes, operands, and current output."""

    nodes: list[Node]
    a: Value
    b: Value
    trans_b: int
    bias: Value | None = None
    residual: Value | None = None
    out: Value = field(init=False)

    def __post_init__(self) -> None:
        self.out = self.nodes[-1].outputs[0]

    @property
    def n(self) -> object:
        """The output's N (last dim), from the weight."""
        return self.b.shape[0] if self.trans_b else self.b.shape[1]  # type: ignore[index]


def _weight(ix: ShapedIndex, b: Value, trans_b: int) -> tuple[Value, int, list[Node]]:
    """(B, trans_b, []), or for B = Transpose(W) of a 2-D W read only here, (W, flipped trans_b, [the
    Transpose]): a linear layer's weight as exporters and decompositions write it. W may be a constant or a
    runtime input (Dynamo's graphs take parameters as inputs): left as B, the transposed view would reach the
    kernel as a strided weight, copied on every call, and its GEMM keys would miss the shipped tuning winners."""
    t = ix.producer(b, "Transpose")
    if t is not None and ix.single_use(b) and t.inputs[0] is not None:
        w = t.inputs[0]
        if w.rank == 2 and list(t.attr("perm", [1, 0])) == [1, 0]:
            return w, 1 - trans_b, [t]
    return b, trans_b, []


def match_base(ix: ShapedIndex, node: Node, result: PassResult | None) -> Base | None:
    """`node` as a GEMM with a 2-D weight, or None (refusing near misses when `result` is given).

    A 2-D GEMM between Reshapes that flatten x's leading dims and restore them (how decomposed
    FX graphs spell a linear layer on a 3-D input) is read as a GEMM on x itself, so that the
    epilogue after the restoring Reshape can join it (FusedGemm takes leading batch dims).
    """
    base = _match_node(ix, node, result)
    return base and _unflatten(ix, base)


def _unflatten(ix: ShapedIndex, base: Base) -> Base:
    flat = ix.producer(base.a, "Reshape")
    x = flat and flat.inputs[0]
    back = ix.sole_user(base.out, "Reshape")
    if x is None or back is None or base.residual is not None or x.shape is None or base.a.shape is None:
        return base
    out = back.outputs[0].shape
    lead = tuple(x.shape[:-1])
    if len(lead) < 2 or None in lead or base.a.shape[-1] != x.shape[-1] or out != (*lead, base.n):
        return base
    base.a = x
    base.nodes = [*([flat] if ix.single_use(flat.outputs[0]) else []), *base.nodes, back]
    base.out = back.outputs[0]
    return base


def _match_node(ix: ShapedIndex, node: Node, result: PassResult | None) -> Base | None:
    a, b = node.inputs[0], node.inputs[1]
    if a is None or b is None or b.rank != 2 or a.rank is None or a.rank < 2:
        return None  # batched (attention) matmuls and vector products are not GEMM targets
    if node.op == "MatMul":
        w, trans_b, pre = _weight(ix, b, 0)
        return Base([*pre, node], a, w, trans_b)
    if node.op == "Linear":
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        return Base([node], a, b, 1, bias=bias)
    # Gemm: Y = alpha * A' @ B' + beta * C (2-D A).
    c = node.inputs[2] if len(node.inputs) > 2 else None
    problem = None
    if node.attr("transA", 0):
        problem = "transA=1 (A transposed) is not supported"
    elif float(node.attr("alpha", 1.0)) != 1.0:
        problem = f"alpha={node.attr('alpha')} (must be 1)"
    elif c is not None and float(node.attr("beta", 1.0)) != 1.0:
        problem = f"beta={node.attr('beta')} (must be 1)"
    if problem:
        if result is not None:
            result.refuse(node, f"Gemm not fused: {problem}")
        return None
    w, trans_b, pre = _weight(ix, b, int(node.attr("transB", 0)))
    base = Base([*pre, node], a, w, trans_b)
    if c is not None:
        if is_vector_of(c, base.n):
            base.bias = c
        elif shape_mismatch(ix.shapes, c, base.out) is None:
            base.residual = c
        else:
            if result is not None:
                result.refuse(node, f"Gemm not fused: C of shape {c.shape} is neither a bias of N={base.n} "
                              f"nor of the output's shape {base.out.shape}")
            return None
    return base


def _take_bias(ix: ShapedIndex, base: Base) -> None:
    if base.bias is not None or base.residual is not None:
        return
    add = ix.sole_user(base.out, "Add")
    c = add and other_input(add, base.out)
    if c is not None and is_vector_of(c, base.n) and c.rank is not None and c.rank <= (base.out.rank or 0):
        base.nodes.append(add)
        base.bias, base.out = c, add.outputs[0]


def _take_activation(ix: ShapedIndex, base: Base, result: PassResult) -> str:
    if base.residual is not None:
        return "none"
    users = ix.users(base.out)
    acts = [u for u in users if activation_name(u) is not None]
    if not acts:
        return "none"
    if not ix.single_use(base.out):
        result.refuse(acts[0], f"{acts[0].op} not fused into the GEMM: its input {base.out.name} is also "
                      "used elsewhere (FusedGemm has one output)")
        return "none"
    act = acts[0]
    base.nodes.append(act)
    base.out = act.outputs[0]
    return activation_name(act)  # type: ignore[return-value]


def _residual_add(ix: ShapedIndex, base: Base) -> tuple[Node, Value] | None:
    """(the Add, the residual) where the GEMM's output is read only by an Add of another value of the sum's shape,
    to which the output provably broadcasts nothing: the residual epilogue FusedGemm takes."""
    add = ix.sole_user(base.out, "Add")
    r = add and other_input(add, base.out)
    shapes = ix.shapes
    if r is not None and r is not base.out and shape_mismatch(shapes, r, add.outputs[0]) is None and shape_mismatch(
        shapes, base.out, add.outputs[0]
    ) is None:
        return add, r
    return None


def _take_residual(ix: ShapedIndex, base: Base) -> None:
    found = None if base.residual is not None else _residual_add(ix, base)
    if found is not None:
        add, r = found
        base.nodes.append(add)
        base.residual, base.out = r, add.outputs[0]


# ---- gated MLP (registered first: it claims the gate projection before the plain GEMM rule) ---

def _projection(ix: ShapedIndex, value: Value | None) -> Base | None:
    """`value` = x @ W (+ bias) from a MatMul/Linear/Gemm with a 2-D weight, read only once."""
    if value is None or not ix.single_use(value):
        return None
    node = ix.producer(value)
    heads = [node] if is_op(node, ("Reshape", *MATMUL_OPS)) else node.inputs if is_op(node, "Add") else []
    for head in heads:  # the matmul, or a Reshape restoring its leading dims, possibly under a bias Add
        if isinstance(head, Value):
            head = ix.producer(head, ("Reshape", *MATMUL_OPS))
        if is_op(head, "Reshape"):
            head = ix.producer(head.inputs[0], MATMUL_OPS)
        base = match_base(ix, head, None) if head is not None else None
        if base is None or base.residual is not None:
            continue
        _take_bias(ix, base)
        if base.out is value:
            return base
    return None


def _halves(ix: ShapedIndex, gate: Value | None, up: Value | None) -> Node | None:
    """The node splitting one value into `gate` (first half) and `up` (second) along the last axis:
    chunk(2, -1), or a Split into two outputs of equal (or unstated, hence equal) sizes; each half read once."""
    node = ix.producer(gate)
    if node is None or len(node.outputs) != 2 or node.outputs[0] is not gate or node.outputs[1] is not up:
        return None
    x = node.inputs[0]
    if x is None or x.rank is None or not ix.single_use(gate) or not ix.single_use(up):
        return None
    if node.op == "aten::chunk":
        ok = node.attr("chunks") == 2 and node.attr("dim", 0) in (-1, x.rank - 1)
    elif node.op == "Split":
        sizes = node.attr("split")
        ok = node.attr("axis", 0) in (-1, x.rank - 1) and (sizes is None or (len(sizes) == 2 and sizes[0] == sizes[1]))
    else:
        ok = False
    return node if ok else None


def _activated_operand(ix: ShapedIndex, mul: Node) -> Iterator[tuple[Node, str, Value | None]]:
    """(activation node, its name, the other operand) for each operand order of `mul` whose one side is an
    activation read only by `mul`: the gate of a gated MLP."""
    for g, u in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        if g is None or not ix.single_use(g):
            continue
        act = ix.producer(g)
        if act is not None and (name := activation_name(act)) is not None:
            yield act, name, u


def _packed(ix: ShapedIndex, mul: Node, result: PassResult) -> tuple[Base, Node, Node, str] | None:
    """mul = act(h[..., :N]) * h[..., N:] with h = x @ [Wg | Wu] (+ b): a packed gate/up projection."""
    for act, name, u in _activated_operand(ix, mul):
        split = _halves(ix, act.inputs[0], u)
        proj = split and _projection(ix, split.inputs[0])
        if proj is None:
            continue
        n = proj.n
        if not isinstance(n, int) or n % 2:
            result.refuse(mul, f"gated MLP not fused: the packed gate/up weight {proj.b.name} has N={n}, not a "
                          "static even size that halves into equal gate and up weights")
            return None
        return proj, split, act, name
    return None


def _gated(ix: ShapedIndex, mul: Node, result: PassResult) -> tuple[Base, Base, Node, str] | None:
    """mul = act(x @ Wg + bg) * (x @ Wu + bu) in either operand order."""
    for act, name, u in _activated_operand(ix, mul):
        gate, up = _projection(ix, act.inputs[0]), _projection(ix, u)
        if gate is None or up is None or gate.a is not up.a:
            continue
        problem = None
        if gate.trans_b != up.trans_b:
            problem = "gate and up weights differ in layout (one transposed)"
        elif gate.b.shape != up.b.shape:
            problem = f"gate weight {gate.b.shape} and up weight {up.b.shape} differ in shape"
        if problem:
            result.refuse(mul, f"gated MLP not fused: {problem}")
            return None
        return gate, up, act, name
    return None


@register("gated_mlp", fusion=True)
def gated_mlp(graph: Graph, result: PassResult) -> None:
    """act(x @ Wg [+ bg]) * (x @ Wu [+ bu]) -> FusedGatedMLP (SwiGLU with silu, GeGLU with gelu); also from one
    packed projection split in two halves (packed=1)."""
    ix = ShapedIndex(graph)
    for mul in [n for n in graph.nodes if is_op(n, "Mul")]:
        if not any(m is mul for m in graph.nodes) or const_scalar(mul.inputs[1], ix) is not None:
            continue
        m = _gated(ix, mul, result)
        packed = None if m is not None else _packed(ix, mul, result)
        if m is not None:
            gate, up, act, name = m
            nodes = [*gate.nodes, act, *up.nodes, mul]
            inputs = [gate.a, gate.b, up.b, gate.bias, up.bias]
        elif packed is not None:
            gate, split, act, name = packed
            nodes = [*gate.nodes, split, act, mul]
            inputs = [gate.a, gate.b, None, gate.bias, None]
        else:
            continue
        try:
            fuse(graph, nodes, "FusedGatedMLP", inputs, [mul.outputs[0]],
                 {"trans_b": gate.trans_b, "activation": name, "packed": int(m is None)}, ix)
        except FusionError as e:
            result.refuse(mul, f"gated MLP not fused: {e}")
            continue
        result.fused += 1


def _has_epilogue(ix: ShapedIndex, base: Base) -> bool:
    """Whether the GEMM rule would fuse an activation or a residual add into this projection."""
    return any(activation_name(u) is not None for u in ix.users(base.out)) or _residual_add(ix, base) is not None


def _projections(ix: ShapedIndex, graph: Graph) -> dict[int, list[Base]]:
    """The plain projections (a 2-D weight, a bias at most) by the input they read, in graph order."""
    by_input: dict[int, list[Base]] = {}
    for node in [n for n in graph.nodes if is_op(n, MATMUL_OPS)]:
        base = match_base(ix, node, None)
        if base is None or base.residual is not None:
            continue
        _take_bias(ix, base)
        if not _has_epilogue(ix, base):
            by_input.setdefault(id(base.a), []).append(base)
    return by_input


def _zero_bias(graph: Graph, base: Base) -> Value | None:
    """A zero bias for a projection without one that groups with projections that have one (Whisper's k_proj
    beside q_proj and v_proj): adding zero leaves every product as it is. None for a dynamic width."""
    n, dtype = base.n, base.out.dtype
    if not isinstance(n, int) or dtype is None:
        return None
    return Value(graph.fresh_name(f"{base.b.name}_zero_bias"), dtype, (n,), const=np.zeros(n, np_dtype(dtype)))


@register("gemm_group", fusion=True)
def gemm_group(graph: Graph, result: PassResult) -> None:
    """Two or three projections of one input (a layer's Q, K and V) -> FusedGemmGroup, one launch for all. Only
    projections whose epilogue is a bias at most: one that takes an activation or a residual is the GEMM rule's,
    which fuses that epilogue. Projections group with those of the same weight layout; where some have a bias and
    others none, those get a zero bias (`_zero_bias`)."""
    ix = ShapedIndex(graph)
    for members in _projections(ix, graph).values():
        kinds: dict[int, list[Base]] = {}
        for base in members:
            kinds.setdefault(base.trans_b, []).append(base)
        for trans_b, same in kinds.items():
            if len(same) == 1 and len(members) > 1:
                result.refuse(same[0].nodes[-1], f"FusedGemmGroup not formed for {same[0].b.name}: the other "
                              f"projections of {same[0].a.name} differ in weight layout")
            for chunk in (same[i:i + 3] for i in range(0, len(same), 3)):
                if len(chunk) < 2:
                    continue
                weights = [b.b for b in chunk] + [None] * (3 - len(chunk))
                biased = any(b.bias is not None for b in chunk)
                biases = [b.bias if b.bias is not None or not biased else _zero_bias(graph, b) for b in chunk]
                biases += [None] * (3 - len(chunk))
                if biased and any(v is None for v in biases[:len(chunk)]):
                    result.refuse(chunk[0].nodes[-1], "FusedGemmGroup not formed: a projection without a bias has a "
                                  "dynamic width, so no zero bias can stand in for one")
                    continue
                nodes = [n for b in chunk for n in b.nodes]
                try:
                    fuse(graph, nodes, "FusedGemmGroup", [chunk[0].a, *weights, *biases], [b.out for b in chunk],
                         {"trans_b": trans_b}, ix)
                except FusionError as e:
                    result.refuse(chunk[0].nodes[-1], f"FusedGemmGroup not formed: {e}")
                    continue
                result.fused += 1


@register("gemm", fusion=True)
def gemm(graph: Graph, result: PassResult) -> None:
    """MatMul/Gemm/Linear [+ bias] [+ activation] [+ residual Add] -> FusedGemm(A, B, bias, residual)."""
    ix = ShapedIndex(graph)
    for node in [n for n in graph.nodes if is_op(n, MATMUL_OPS)]:
        base = match_base(ix, node, result)
        if base is None:
            continue
        _take_bias(ix, base)
        act = _take_activation(ix, base, result)
        _take_residual(ix, base)
        attrs = {"trans_b": base.trans_b, "activation": act}
        try:
            fuse(graph, base.nodes, "FusedGemm", [base.a, base.b, base.bias, base.residual], [base.out], attrs, ix)
        except FusionError as e:
            result.refuse(node, f"FusedGemm not formed: {e}")
            continue
        result.fused += 1
