"""Canonicalization: fold constant (mostly shape) subgraphs and drop no-op nodes.

Exporters spell shape arithmetic as Shape/Gather/Concat/Unsqueeze chains and leave Identity and
no-op Casts around; folding and dropping them lets the fusion patterns see the real dataflow
(a Reshape reading a constant shape, a Mul reading the constant 0.5). A folded node is removed and
its output Value gets `const` (no producer any more): backends emit it as an initializer/constant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tkopt.ir import Graph, Node, Value

from .base import PassResult
from .patterns import is_noop_cast, is_op
from .pipeline import register

# Largest folded result kept (elements): shape tensors and scalars, never copies of weights.
FOLD_LIMIT = 1024

# For readers of a newly constant input, the attribute that the contract says mirrors it.
CONST_INPUT_ATTRS: dict[str, dict[int, str]] = {
    "Reshape": {1: "shape"}, "Expand": {1: "shape"}, "Unsqueeze": {1: "axes"}, "Squeeze": {1: "axes"},
    "ReduceMean": {1: "axes"}, "ReduceSum": {1: "axes"},
    "Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"},
}

Arrays = Sequence[np.ndarray | None]


def _np_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.float32 if dtype == "bfloat16" else dtype)


def _ints(node: Node, key: str, arr: np.ndarray | None) -> list[int] | None:
    """An int-list operand given as attribute (canonical form) or as a constant input."""
    val = node.attr(key)
    if val is None and arr is not None:
        val = arr
    return None if val is None else [int(v) for v in np.asarray(val).reshape(-1)]


def _shape(node: Node, ins: Arrays) -> np.ndarray:
    dims = node.inputs[0].shape  # type: ignore[union-attr]
    start, end = node.attr("start", 0), node.attr("end")
    return np.array(dims[start:end], dtype=np.int64)  # type: ignore[index]


def _slice(node: Node, ins: Arrays) -> np.ndarray:
    x = ins[0]
    starts, ends = _ints(node, "starts", ins[1]), _ints(node, "ends", ins[2])
    axes = _ints(node, "axes", ins[3] if len(ins) > 3 else None) or list(range(len(starts or [])))
    steps = _ints(node, "steps", ins[4] if len(ins) > 4 else None) or [1] * len(axes)
    index = [slice(None)] * x.ndim
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):  # type: ignore[arg-type]
        index[a] = slice(s, e, st)
    return x[tuple(index)]


def _unsqueeze(node: Node, ins: Arrays) -> np.ndarray:
    x = ins[0]
    axes = _ints(node, "axes", ins[1] if len(ins) > 1 else None) or []
    rank = x.ndim + len(axes)
    for a in sorted(a + rank if a < 0 else a for a in axes):
        x = np.expand_dims(x, a)
    return x


def _squeeze(node: Node, ins: Arrays) -> np.ndarray:
    axes = _ints(node, "axes", ins[1] if len(ins) > 1 else None)
    return np.squeeze(ins[0], axis=None if axes is None else tuple(axes))


def _reshape(node: Node, ins: Arrays) -> np.ndarray:
    out = node.outputs[0].shape
    if out is not None and all(isinstance(d, int) for d in out):
        return ins[0].reshape(out)
    shape = _ints(node, "shape", ins[1])
    if not node.attr("allowzero", 0):
        shape = [ins[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]  # type: ignore[arg-type]
    return ins[0].reshape(shape)


def _div(node: Node, ins: Arrays) -> np.ndarray:
    a, b = ins
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer division truncates
    return a / b


EVALUATORS: dict[str, Callable[[Node, Arrays], np.ndarray]] = {
    "Constant": lambda n, i: np.asarray(n.attr("value")),
    "Shape": _shape,
    "Size": lambda n, i: np.array(int(np.prod(n.inputs[0].shape)), dtype=np.int64),  # type: ignore[union-attr]
    "Identity": lambda n, i: i[0],
    "Cast": lambda n, i: i[0].astype(_np_dtype(n.attr("to"))),
    "Add": lambda n, i: i[0] + i[1],
    "Sub": lambda n, i: i[0] - i[1],
    "Mul": lambda n, i: i[0] * i[1],
    "Div": _div,
    "Pow": lambda n, i: np.power(i[0], i[1]),
    "Neg": lambda n, i: -i[0],
    "Sqrt": lambda n, i: np.sqrt(i[0]),
    "Reciprocal": lambda n, i: 1 / i[0],
    "Max": lambda n, i: np.maximum.reduce(list(i)),
    "Min": lambda n, i: np.minimum.reduce(list(i)),
    "Equal": lambda n, i: np.equal(i[0], i[1]),
    "Less": lambda n, i: np.less(i[0], i[1]),
    "Greater": lambda n, i: np.greater(i[0], i[1]),
    "Not": lambda n, i: np.logical_not(i[0]),
    "And": lambda n, i: np.logical_and(i[0], i[1]),
    "Where": lambda n, i: np.where(i[0], i[1], i[2]),
    "Gather": lambda n, i: np.take(i[0], i[1], axis=n.attr("axis", 0)),
    "Slice": _slice,
    "Concat": lambda n, i: np.concatenate(list(i), axis=n.attr("axis", 0)),
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Expand": lambda n, i: np.broadcast_to(i[0], np.broadcast_shapes(i[0].shape, tuple(_ints(n, "shape", i[1])))),
    "ConstantOfShape": lambda n, i: np.full(
        tuple(int(d) for d in i[0]), np.asarray(n.attr("value", np.zeros(1, np.float32))).reshape(-1)[0]
    ),
    "Range": lambda n, i: np.arange(i[0].item(), i[1].item(), i[2].item()),
}


def _static(value: Value | None) -> bool:
    return value is not None and value.shape is not None and all(isinstance(d, int) for d in value.shape)


def _foldable(node: Node) -> bool:
    if not is_op(node, tuple(EVALUATORS)) or len(node.outputs) != 1:
        return False
    if node.op in ("Shape", "Size"):
        return _static(node.inputs[0])
    return all(v is None or v.const is not None for v in node.inputs)


def _evaluate(node: Node) -> np.ndarray | None:
    """The node's constant result, or None when it cannot or should not be folded."""
    try:
        out = np.asarray(EVALUATORS[node.op](node, [None if v is None else v.const for v in node.inputs]))
    except (ValueError, TypeError, IndexError, KeyError):
        return None  # unusual attribute forms: leave the node to run as exported
    if out.dtype == object:
        return None
    if node.op != "Constant" and out.size > FOLD_LIMIT:
        return None
    dtype = node.outputs[0].dtype
    return out.astype(_np_dtype(dtype)) if dtype is not None else out


@register("fold_constants")
def fold_constants(graph: Graph, result: PassResult) -> None:
    """Evaluate nodes whose inputs are all constant (and Shape of static shapes) into const Values."""
    folded: list[Node] = []
    outputs = {id(v) for v in graph.outputs}
    for node in graph.nodes:
        if not _foldable(node) or id(node.outputs[0]) in outputs:
            continue
        data = _evaluate(node)
        if data is None:
            continue
        out = node.outputs[0]
        out.const = np.array(data, order="C")  # ascontiguousarray would make 0-d 1-d
        if out.shape is None:
            out.shape = tuple(data.shape)
        folded.append(node)
    if not folded:
        return
    graph.remove_nodes(folded)
    _mirror_const_attrs(graph)
    result.changed += len(folded)


def _mirror_const_attrs(graph: Graph) -> None:
    """Give readers of now-constant operands the attribute the canonical form promises."""
    for node in graph.nodes:
        for pos, key in CONST_INPUT_ATTRS.get(node.op, {}).items():
            if pos < len(node.inputs) and node.inputs[pos] is not None and key not in node.attrs:
                data = node.inputs[pos].const  # type: ignore[union-attr]
                if data is not None:
                    node.attrs[key] = [int(v) for v in data.reshape(-1)]


@register("drop_identity")
def drop_identity(graph: Graph, result: PassResult) -> None:
    """Remove Identity and Casts to the input's own dtype, pointing their readers at the input.

    A node whose output is a graph output stays, so the graph's interface keeps its names.
    """
    dropped: list[Node] = []
    outputs = {id(v) for v in graph.outputs}
    for node in graph.nodes:
        if not (is_op(node, "Identity") or is_noop_cast(node)) or node.inputs[0] is None:
            continue
        if id(node.outputs[0]) in outputs:
            continue
        graph.replace_uses(node.outputs[0], node.inputs[0], skip=[node])
        dropped.append(node)
    graph.remove_nodes(dropped)
    result.changed += len(dropped)
