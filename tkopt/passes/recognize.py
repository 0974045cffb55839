"""Recognition: replace decomposed activations and norms by one canonical stand-in node each.

Exporters and model code spell GELU, SiLU, LayerNorm and RMSNorm as chains of elementwise ops;
the fusions downstream (norm, gemm epilogues, gated MLP) match the canonical op instead, whatever
the spelling. A stand-in keeps the original nodes in `replaced` (no origin); finalize expands any
stand-in no fusion consumed, so unfused graphs run exactly the exported ops. Constants are checked
with a tolerance; a match whose structure fits but whose constant does not is refused with a reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tkopt.ir import Graph, Node, Value

from .base import FusionError, PassResult
from .patterns import (
    GraphIndex,
    const_problem,
    const_scalar,
    make_standin,
    operand_orders,
    other_input,
    trailing_axes,
)
from .pipeline import register

SQRT1_2 = 1 / math.sqrt(2)
SQRT_2_PI = math.sqrt(2 / math.pi)
GELU_CUBIC = 0.044715
RSQRT_OPS = ("Rsqrt", "aten::rsqrt")  # ONNX has no Rsqrt; FX graphs spell it so


@dataclass
class Product:
    """A Mul/Div tree flattened: its non-constant factors, their constant coefficient, its nodes."""

    terms: list[Value] = field(default_factory=list)
    coeff: float = 1.0
    nodes: list[Node] = field(default_factory=list)


def product(ix: GraphIndex, value: Value, keep: tuple[Value, ...] = ()) -> Product:
    """Flatten the Mul/Div-by-constant/Pow-by-integer tree producing `value`.

    Inner nodes are expanded only when their output is read once (else they are shared and stay
    terms); values in `keep` are never expanded. `value`'s own producer is always expanded.
    """
    out = Product()

    def walk(v: Value, top: bool) -> None:
        c = const_scalar(v, ix)
        if c is not None:
            out.coeff *= c
            return
        node = ix.producer(v, ("Mul", "Div", "Pow"))
        if node is None or any(v is k for k in keep) or not (top or ix.single_use(v)):
            out.terms.append(v)
            return
        a, b = node.inputs[0], node.inputs[1]
        if node.op == "Mul":
            out.nodes.append(node)
            walk(a, False)
            walk(b, False)
            return
        cb = const_scalar(b, ix)
        if node.op == "Div" and cb not in (None, 0.0):
            out.nodes.append(node)
            out.coeff /= cb
            walk(a, False)
        elif node.op == "Pow" and cb is not None and cb in (2.0, 3.0):
            out.nodes.append(node)
            for _ in range(int(cb)):
                walk(a, False)
        else:
            out.terms.append(v)

    walk(value, True)
    return out


def _half_x_times(ix: GraphIndex, x: Value, inner: Value) -> tuple[Product, Value] | None:
    """The Mul tree computing 0.5 * x * inner in any association: (its flattening, its output).

    Climbs at most two Mul/Div nodes from `inner` (the `1 + erf/tanh` term), reading each once.
    """
    cur, found = inner, None
    for _ in range(2):
        user = ix.sole_user(cur, ("Mul", "Div"))
        if user is None or (user.op == "Div" and user.inputs[0] is not cur):
            break
        cur = user.outputs[0]
        p = product(ix, cur, keep=(x, inner))
        if sorted(map(id, p.terms)) == sorted((id(x), id(inner))):
            found = p, cur
            if math.isclose(p.coeff, 0.5, rel_tol=1e-2):
                break  # (x * inner) / 2 only gets its 0.5 one node up: keep climbing otherwise
    return found


def _one_plus(ix: GraphIndex, value: Value) -> Node | None:
    """The Add computing `value + 1` (either order) that alone reads `value`."""
    add = ix.sole_user(value, "Add")
    if add is None or const_scalar(other_input(add, value), ix) != 1.0:
        return None
    return add


def _standin(
    ix: GraphIndex, result: PassResult, anchor: Node, nodes: list[Node], op: str,
    inputs: list[Value | None], output: Value, attrs: dict,
) -> bool:
    try:
        make_standin(ix.graph, nodes, op, inputs, [output], attrs, ix)
    except FusionError as e:
        result.refuse(anchor, f"{op} pattern matched but cannot be replaced: {e}")
        return False
    result.changed += 1
    return True


def _run(graph: Graph, result: PassResult, anchors: tuple[str, ...], rule: Callable) -> None:
    """Apply `rule(graph, ix, node, result) -> bool` to each anchor node still in the graph. A rule changes the
    graph only through `_standin`, which keeps `ix` current."""
    ix = GraphIndex(graph)
    for node in list(graph.nodes):
        if node.op in anchors and not node.domain and not node.replaced and any(n is node for n in graph.nodes):
            rule(graph, ix, node, result)


def _gelu_erf(graph: Graph, ix: GraphIndex, erf: Node, result: PassResult) -> bool:
    """x * 0.5 * (1 + erf(x / sqrt(2))) in its orderings (Div by 1.4142 or Mul by 0.7071)."""
    arg = erf.inputs[0]
    if arg is None or not ix.single_use(arg) or ix.producer(arg, ("Mul", "Div")) is None:
        return False
    scaled = product(ix, arg)
    if len(scaled.terms) != 1:
        return False
    x = scaled.terms[0]
    add = _one_plus(ix, erf.outputs[0])
    outer = add and _half_x_times(ix, x, add.outputs[0])
    if not outer:
        return False
    p, out = outer
    problem = const_problem("erf argument scale", scaled.coeff, SQRT1_2, rel=1e-4, dtype=x.dtype) or const_problem(
        "outer coefficient", p.coeff, 0.5, rel=1e-4, dtype=x.dtype
    )
    if problem:
        result.refuse(erf, f"GELU (erf form) near match: {problem}")
        return False
    nodes = [*scaled.nodes, erf, add, *p.nodes]
    return _standin(ix, result, erf, nodes, "Gelu", [x], out, {"approximate": "none"})


def _cube_plus_x(ix: GraphIndex, inner: Value) -> tuple[Value, Product, Node] | None:
    """inner = x + c * x^3 (x^3 as Pow(x, 3) or x*x*x): (x, the flattened c*x^3, the Add)."""
    add = ix.producer(inner, "Add")
    if add is None:
        return None
    for x, cube in operand_orders(add):
        if x is None or cube is None or not ix.single_use(cube) or ix.producer(cube, ("Mul", "Pow")) is None:
            continue
        p = product(ix, cube, keep=(x,))
        if len(p.terms) == 3 and all(t is x for t in p.terms):
            return x, p, add
    return None


def _gelu_tanh(graph: Graph, ix: GraphIndex, tanh: Node, result: PassResult) -> bool:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), x^3 as Pow or Mul*Mul."""
    arg = tanh.inputs[0]
    if arg is None or not ix.single_use(arg) or ix.producer(arg, "Mul") is None:
        return False
    scaled = product(ix, arg)
    if len(scaled.terms) != 1 or not ix.single_use(scaled.terms[0]):
        return False
    cubic = _cube_plus_x(ix, scaled.terms[0])
    if cubic is None:
        return False
    x, cube, inner_add = cubic
    add = _one_plus(ix, tanh.outputs[0])
    outer = add and _half_x_times(ix, x, add.outputs[0])
    if not outer:
        return False
    p, out = outer
    problem = (
        const_problem("tanh argument scale", scaled.coeff, SQRT_2_PI, rel=1e-4, dtype=x.dtype)
        or const_problem("cubic coefficient", cube.coeff, GELU_CUBIC, rel=1e-4, dtype=x.dtype)
        or const_problem("outer coefficient", p.coeff, 0.5, rel=1e-4, dtype=x.dtype)
    )
    if problem:
        result.refuse(tanh, f"GELU (tanh form) near match: {problem}")
        return False
    nodes = [*cube.nodes, inner_add, *scaled.nodes, tanh, add, *p.nodes]
    return _standin(ix, result, tanh, nodes, "Gelu", [x], out, {"approximate": "tanh"})


@register("recognize_gelu")
def recognize_gelu(graph: Graph, result: PassResult) -> None:
    """Decomposed GELU (erf and tanh forms) -> Gelu(approximate)."""
    _run(graph, result, ("Erf",), _gelu_erf)
    _run(graph, result, ("Tanh",), _gelu_tanh)


def _silu(graph: Graph, ix: GraphIndex, sig: Node, result: PassResult) -> bool:
    x = sig.inputs[0]
    mul = ix.sole_user(sig.outputs[0], "Mul")
    if x is None or mul is None or other_input(mul, sig.outputs[0]) is not x:
        return False
    return _standin(ix, result, sig, [sig, mul], "Silu", [x], mul.outputs[0], {})


@register("recognize_silu")
def recognize_silu(graph: Graph, result: PassResult) -> None:
    """x * sigmoid(x) (either operand order) -> Silu(x)."""
    _run(graph, result, ("Sigmoid",), _silu)


# ---- norms -------------------------------------------------------------------------------------

def _square_of(ix: GraphIndex, value: Value) -> Value | None:
    """x for value = Pow(x, 2) or Mul(x, x)."""
    node = ix.producer(value, ("Pow", "Mul"))
    if node is None:
        return None
    a, b = node.inputs[0], node.inputs[1]
    if node.op == "Mul":
        return a if a is b else None
    return a if const_scalar(b, ix) == 2.0 else None


def _mean_axis(node: Node, rank: int | None) -> int | None:
    """The first normalized axis (negative) if this ReduceMean keeps dims over trailing axes."""
    if not node.attr("keepdims", 1):
        return None
    return trailing_axes(node.attr("axes"), rank)


@dataclass
class _Denominator:
    """x / sqrt(mean + eps) spelled some way: the nodes from the mean's Add on, eps, the result."""

    nodes: list[Node]
    eps: float | None
    out: Value


def _inv_std(ix: GraphIndex, var: Value, numerator: Value) -> _Denominator | None:
    """numerator * rsqrt(var + eps): Rsqrt, Reciprocal(Sqrt), Div(1, Sqrt), or Div(numerator, Sqrt)."""
    add = ix.sole_user(var, "Add")
    if add is None:
        return None
    eps = const_scalar(other_input(add, var), ix)
    a = add.outputs[0]
    r = ix.sole_user(a, RSQRT_OPS)
    if r is not None:
        mul = ix.sole_user(r.outputs[0], "Mul")
        if mul is not None and other_input(mul, r.outputs[0]) is numerator:
            return _Denominator([add, r, mul], eps, mul.outputs[0])
        return None
    sqrt = ix.sole_user(a, "Sqrt")
    if sqrt is None:
        return None
    s = sqrt.outputs[0]
    user = ix.sole_user(s, ("Div", "Reciprocal"))
    if user is None:
        return None
    if user.op == "Div" and user.inputs[1] is s:
        if user.inputs[0] is numerator:
            return _Denominator([add, sqrt, user], eps, user.outputs[0])
        if const_scalar(user.inputs[0], ix) != 1.0:
            return None
    elif user.op == "Div":
        return None
    mul = ix.sole_user(user.outputs[0], "Mul")
    if mul is not None and other_input(mul, user.outputs[0]) is numerator:
        return _Denominator([add, sqrt, user, mul], eps, mul.outputs[0])
    return None


def _param_of(ix: GraphIndex, value: Value, x: Value, axis: int, op: str) -> tuple[Node, Value] | None:
    """`value` op p (either order), read once, with p shaped like x's normalized trailing dims."""
    node = ix.sole_user(value, op)
    if node is None:
        return None
    p = other_input(node, value)
    k = -axis
    if p is None or p.shape is None or len(p.shape) != k:
        return None
    if x.shape is not None and tuple(x.shape[-k:]) != tuple(p.shape):
        return None
    return node, p


def _layer_norm(graph: Graph, ix: GraphIndex, mean: Node, result: PassResult) -> bool:
    """(x - mean) / sqrt(var + eps) * w + b with var = mean((x - mean)^2), the mean over trailing axes."""
    x = mean.inputs[0]
    sub = ix.sole_user(mean.outputs[0], "Sub")
    if x is None or sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean.outputs[0]:
        return False
    d = sub.outputs[0]
    users = ix.users(d)
    if len(users) != 2 or ix.is_output(d):
        return False
    sq = next((u for u in users if _square_of(ix, u.outputs[0]) is d), None)
    if sq is None:
        return False
    mean2 = ix.sole_user(sq.outputs[0], "ReduceMean")
    if mean2 is None:
        return False
    axis = _mean_axis(mean, x.rank)
    if axis is None:
        result.refuse(mean, f"LayerNorm near match: mean over axes {mean.attr('axes')} (keepdims="
                      f"{mean.attr('keepdims', 1)}) is not over the trailing axes with kept dims")
        return False
    if _mean_axis(mean2, x.rank) != axis:
        result.refuse(mean2, f"LayerNorm near match: variance axes {mean2.attr('axes')} differ from mean axes")
        return False
    den = _inv_std(ix, mean2.outputs[0], d)
    if den is None:
        return False
    if den.eps is None or den.eps < 0:
        result.refuse(mean, "LayerNorm near match: epsilon is not a non-negative constant scalar")
        return False
    nodes = [mean, sub, sq, mean2, *den.nodes]
    out, inputs = den.out, [x, None, None]
    scale = _param_of(ix, out, x, axis, "Mul")
    if scale:
        nodes.append(scale[0])
        out, inputs[1] = scale[0].outputs[0], scale[1]
        shift = _param_of(ix, out, x, axis, "Add")
        if shift:
            nodes.append(shift[0])
            out, inputs[2] = shift[0].outputs[0], shift[1]
    attrs = {"axis": axis, "epsilon": den.eps}
    return _standin(ix, result, mean, nodes, "LayerNormalization", inputs, out, attrs)


@register("recognize_layer_norm")
def recognize_layer_norm(graph: Graph, result: PassResult) -> None:
    """Decomposed LayerNorm (ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div, * w + b) -> LayerNormalization."""
    _run(graph, result, ("ReduceMean",), _layer_norm)


def _rms_norm(graph: Graph, ix: GraphIndex, mean: Node, result: PassResult) -> bool:
    """x * rsqrt(mean(x^2) + eps) [* w], optionally computed in float32 between Casts."""
    sq_out = mean.inputs[0]
    xf = None if sq_out is None or not ix.single_use(sq_out) else _square_of(ix, sq_out)
    if xf is None:
        return False
    axis = _mean_axis(mean, xf.rank)
    den = _inv_std(ix, mean.outputs[0], xf)
    if den is None:
        return False
    if axis is None:
        result.refuse(mean, f"RMSNorm near match: mean over axes {mean.attr('axes')} (keepdims="
                      f"{mean.attr('keepdims', 1)}) is not over the trailing axes with kept dims")
        return False
    if den.eps is None or den.eps < 0:
        result.refuse(mean, "RMSNorm near match: epsilon is not a non-negative constant scalar")
        return False
    nodes = [ix.producer(sq_out), mean, *den.nodes]
    x, out, weight = xf, den.out, None
    # Upcast in, cast back out (HF Llama): take both Casts in, so X and Y keep the model's dtype.
    up = ix.producer(xf, "Cast")
    inside = {id(n) for n in nodes}
    if up is not None and up.inputs[0] is not None and all(id(u) in inside for u in ix.users(xf)):
        x_in = up.inputs[0]
        scale = _param_of(ix, out, x_in, axis, "Mul")
        after = scale[0].outputs[0] if scale else out
        down = ix.sole_user(after, "Cast")
        if down is not None and down.attr("to") == x_in.dtype and x_in.dtype is not None:
            nodes += [up, *([scale[0]] if scale else []), down]
            x, out = x_in, down.outputs[0]
            weight = scale[1] if scale else None
    if weight is None:
        scale = _param_of(ix, out, x, axis, "Mul")
        if scale:
            nodes.append(scale[0])
            out, weight = scale[0].outputs[0], scale[1]
    attrs = {"axis": axis, "epsilon": den.eps}
    return _standin(ix, result, mean, nodes, "RMSNormalization", [x, weight], out, attrs)


@register("recognize_rms_norm")
def recognize_rms_norm(graph: Graph, result: PassResult) -> None:
    """Decomposed RMSNorm (Pow/ReduceMean/Add/Rsqrt or Sqrt, * w, Casts) -> RMSNormalization."""
    _run(graph, result, ("ReduceMean",), _rms_norm)
