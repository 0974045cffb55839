"""Broadcast cos/sin tables realized once, before inductor compiles a graph.

A rotary (or sinusoidal) position table is computed once per model, e.g. HF Llama's
`cos = cat(inv_freq @ positions).cos()`, a (B, S, D) value that every layer's q and k broadcast over the
heads. Inductor counts cos/sin as cheap pointwise ops and inlines the table into each consumer
(`should_realize_on_reuse`), so precise cos and sin run again for every head of every layer: on the H200 a
Llama-style model's rotary kernels cost 4x their memory traffic. A barrier after the cos/sin that inductor
honours (`prims.inductor_force_stride_order`, with the value's own strides: it realizes the table into a
buffer) and eager computes as the identity makes inductor compute the table in one kernel.

Only cos and sin: LayerNorm's rsqrt is broadcast too, and realizing it would split inductor's norm kernel.
torch.export keeps HF's rotary in higher-order ops (its `@torch.no_grad()` forward and its autocast-disabled
region: wrap_with_set_grad_enabled / wrap_with_autocast, each calling a submodule): a table is then the
output of such an op, found by following the submodule's output back to its cos/sin, and realized where the
graph broadcasts it.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

_TRIG_FUNCTIONS = {torch.ops.aten.cos.default, torch.ops.aten.sin.default, torch.cos, torch.sin}
_TRIG_METHODS = {"cos", "sin"}
_HOPS = 6  # how far a table's same-size users (a scale, a cast, a view) are followed to its broadcast


def realize_broadcast_tables(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Insert a realization barrier after each cos/sin of `gm` whose value is broadcast downstream, and
    recompile `gm`; returns how many.

    Sizes are read from each node's traced value ("val" in aten graphs, "example_value" in Dynamo's), symbolic
    sizes at their hints: a misjudged size costs speed only, the barrier never changes a value. The barrier
    has no autograd formula, so a table that autograd records (it depends on an input or parameter that
    requires grad, with grad enabled, as at this compile) is left as it is."""
    # registers prims.inductor_force_stride_order; here, not at import: it imports inductor (0.9 s)
    import torch._inductor.inductor_prims  # noqa: F401

    graph = gm.graph
    recorded = _recorded_by_autograd(gm, example_inputs)
    tables = [n for n in graph.nodes if _computes_trig(gm, n) and n not in recorded and _broadcast(n)]
    for node in tables:
        _insert_barrier(graph, node)
    gm.recompile()
    return len(tables)


def _recorded_by_autograd(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> set[fx.Node]:
    """The nodes that depend on an input or parameter that requires grad (any op counted as differentiable).
    `example_inputs` flattened are the graph's placeholders, as compile_fx matches them."""
    if not torch.is_grad_enabled():
        return set()
    placeholders = gm.graph.find_nodes(op="placeholder")
    leaves = pytree.tree_leaves(list(example_inputs))
    recorded = {p for p, x in zip(placeholders, leaves, strict=True) if _requires_grad(x)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if _requires_grad(functools.reduce(getattr, node.target.split("."), gm)):
                recorded.add(node)
        elif any(a in recorded for a in node.all_input_nodes):
            recorded.add(node)
    return recorded


def _requires_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _is_trig(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _TRIG_FUNCTIONS
    return node.op == "call_method" and node.target in _TRIG_METHODS


def _computes_trig(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` is a cos/sin, or an output of a higher-order op whose submodule computes it from one
    through ops that keep its size (a scale, a cast, another such op's output)."""
    body = _hop_output(gm, node)
    if body is None:
        return _is_trig(node)
    gm, node = body
    for _ in range(_HOPS):
        if _is_trig(node):
            return True
        body = _hop_output(gm, node)
        if body is not None:
            gm, node = body
            continue
        same = [a for a in node.all_input_nodes if _shape(a) is not None and _shape(a) == _shape(node)]
        if len(same) != 1:
            return False
        node = same[0]
    return False


def _hop_output(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.GraphModule, fx.Node] | None:
    """(the submodule, its output node) that `node` = getitem(a higher-order op calling a submodule, i) reads;
    None for any other node."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    hop, index = node.args
    if not isinstance(hop, fx.Node) or hop.op != "call_function" or not isinstance(index, int):
        return None
    attrs = (functools.reduce(getattr, a.target.split("."), gm) for a in hop.args
             if isinstance(a, fx.Node) and a.op == "get_attr")
    bodies = [m for m in attrs if isinstance(m, fx.GraphModule)]
    if len(bodies) != 1:
        return None
    body = bodies[0]
    outputs = body.graph.output_node().args[0]
    out = outputs[index] if isinstance(outputs, (tuple, list)) and index < len(outputs) else None
    return (body, out) if isinstance(out, fx.Node) else None


def _value(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val", node.meta.get("example_value"))
    return v if isinstance(v, torch.Tensor) else None


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    """The node's tensor shape, symbolic sizes at their hints; None without a tensor value or a hint."""
    v = _value(node)
    if v is None:
        return None
    sizes = [d.node.hint if isinstance(d, torch.SymInt) else d for d in v.shape]
    return None if None in sizes else tuple(sizes)


def _broadcast(node: fx.Node) -> bool:
    """Whether a user within _HOPS, reached through users with as many elements (a scale, a cast, a view),
    broadcasts the value to more elements: its shape has the value's, right-aligned, with 1s widened or dims
    added (a concatenation or a gather of the table is no broadcast: they read each element about once)."""
    shape = _shape(node)
    if shape is None:
        return False
    size = math.prod(shape)
    frontier = [(node, shape)]
    for _ in range(_HOPS):
        reached = []
        for n, have in frontier:
            for user in n.users:
                out = _shape(user)
                if out is not None and math.prod(out) == size:
                    reached.append((user, out))
                elif out is not None and math.prod(out) > size and _broadcasts(have, out):
                    return True
        frontier = reached
    return False


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    tail = out[len(out) - len(shape):]
    return len(shape) <= len(out) and all(s in (1, o) for s, o in zip(shape, tail, strict=True))


def _insert_barrier(graph: fx.Graph, node: fx.Node) -> None:
    """`node`'s users read `inductor_force_stride_order(node, node's strides)` instead, the strides read from
    the value itself (exact at every size, dynamic ones included)."""
    value = _value(node)
    assert value is not None  # _broadcast read its size
    key = "val" if "val" in node.meta else "example_value"
    strides: list[fx.Node] = []
    anchor = node
    for dim in range(value.dim()):
        with graph.inserting_after(anchor):
            if key == "val":
                anchor = graph.call_function(torch.ops.aten.sym_stride.int, (node, dim))
            else:
                anchor = graph.call_method("stride", (node, dim))
        anchor.meta[key] = value.stride(dim)
        strides.append(anchor)
    with graph.inserting_after(anchor):
        barrier = graph.call_function(torch.ops.prims.inductor_force_stride_order.default, (node, strides))
    barrier.meta[key] = value
    ours: set[Any] = {barrier, *strides}
    node.replace_all_uses_with(barrier, delete_user_cb=lambda user: user not in ours)
