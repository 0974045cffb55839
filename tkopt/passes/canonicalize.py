"""Canonicalization: fold constant (mostly shape) subgraphs, drop no-op nodes, merge duplicates.

Exporters spell shape arithmetic as Shape/Gather/Concat/Unsqueeze chains and leave Identity and
no-op Casts around; folding and dropping them lets the fusion patterns see the real dataflow
(a Reshape reading a constant shape, a Mul reading the constant 0.5). A folded node is removed and
its output Value gets `const` (no producer any more): backends emit it as an initializer/constant.
Models also write one expression twice (Cohere's norm computes `x - mean` for the variance and again
for the output); merging identical pure nodes gives the patterns the one dataflow they are written for.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from tkopt.ir import Graph, Node, Value

from .base import PassResult
from .evaluators import EVALUATORS, np_dtype
from .patterns import is_noop_cast, is_op
from .pipeline import register
from .shapes import ShapedIndex

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
    """Remove Identity, Casts to the input's own dtype and Slices that keep every element, pointing their readers
    at the input.

    A node whose output is a graph output stays, so the graph's interface keeps its names.
    """
    dropped: list[Node] = []
    outputs = {id(v) for v in graph.outputs}
    shapes = ShapedIndex(graph).shapes if any(is_op(n, "Slice") for n in graph.nodes) else None
    for node in graph.nodes:
        noop = is_op(node, "Identity") or is_noop_cast(node) or (
            shapes is not None and is_op(node, "Slice") and shapes.keeps_every_element(node))
        if not noop or node.inputs[0] is None:
            continue
        if id(node.outputs[0]) in outputs:
            continue
        graph.replace_uses(node.outputs[0], node.inputs[0], skip=[node])
        dropped.append(node)
    graph.remove_nodes(dropped)
    result.changed += len(dropped)


# Canonical ops that draw random numbers: two of them on the same inputs give different results.
RANDOM_OPS = ("Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
              "Bernoulli")


def _frozen(x: Any) -> Hashable:
    """An attribute value as a hashable key (arrays by dtype, shape and bytes); TypeError if it has none."""
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, list | tuple):
        return (type(x).__name__, *map(_frozen, x))
    if isinstance(x, dict):
        return ("dict", *sorted((k, _frozen(v)) for k, v in x.items()))
    hash(x)
    return (type(x).__name__, x)


def _key(node: Node) -> Hashable | None:
    """What makes two nodes compute the same values: op, attributes, the very input Values, output dtypes.
    None for a node that must stay itself: unmapped ("aten::..." may mutate or draw random numbers; a
    custom domain's semantics are unknown), random, input-less (constants: folding's business)."""
    if node.domain or "::" in node.op or node.op in RANDOM_OPS or not node.inputs or not node.outputs:
        return None
    try:
        attrs = _frozen(node.attrs)
    except TypeError:
        return None
    ins = tuple(None if v is None else id(v) for v in node.inputs)
    return node.op, attrs, ins, tuple(v.dtype for v in node.outputs)


@register("merge_duplicates")
def merge_duplicates(graph: Graph, result: PassResult) -> None:
    """Common subexpressions: a pure node computing what an earlier one does from the same inputs is
    removed and its readers read the earlier node's outputs. A node producing a graph output stays, so
    the graph's interface keeps its names."""
    outputs = {id(v) for v in graph.outputs}
    subst: dict[int, Value] = {}
    first: dict[Hashable, Node] = {}
    dropped: list[Node] = []
    for node in graph.nodes:
        if subst:
            node.inputs = [None if v is None else subst.get(id(v), v) for v in node.inputs]
        key = _key(node)
        if key is None or any(id(v) in outputs for v in node.outputs):
            continue
        kept = first.setdefault(key, node)
        if kept is not node:
            subst.update((id(b), a) for a, b in zip(kept.outputs, node.outputs, strict=True))
            dropped.append(node)
    graph.remove_nodes(dropped)
    result.changed += len(dropped)
