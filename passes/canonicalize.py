"""Canonicalization: fold constant (mostly shape) subgraphs and drop no-op nodes.

Exporters spell shape arithmetic as Shape/Gather/Concat/Unsqueeze chains and leave Identity and
no-op Casts around; folding and dropping them lets the fusion patterns see the real dataflow
(a Reshape reading a constant shape, a Mul reading the constant 0.5). A folded node is removed and
its output Value gets `const` (no producer any more): backends emit it as an initializer/constant.
"""

from __future__ import annotations

import numpy as np

from tkopt.ir import Graph, Node, Value

from .base import PassResult
from .evaluators import EVALUATORS, np_dtype
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
    return out.astype(np_dtype(dtype)) if dtype is not None else out


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
