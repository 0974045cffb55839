"""Finalize: put back the original nodes of every stand-in no fusion consumed, then drop dead nodes.

Recognised canonical nodes (Gelu for its erf form, LayerNormalization for its decomposition, ...)
have no origin, so no backend could emit them; expanding them restores exactly the exported ops.
Backends thus only ever see original nodes and fused ("tkopt") nodes. This pass always runs.
"""

from __future__ import annotations

from tkopt.ir import Graph, Node

from .base import PassResult
from .patterns import is_standin
from .pipeline import register


def expand_standins(graph: Graph) -> int:
    """Replace each stand-in by its original nodes (in place, in order). Returns how many."""
    nodes: list[Node] = []
    count = 0
    for n in graph.nodes:
        if is_standin(n):
            nodes.extend(n.replaced)
            count += 1
        else:
            nodes.append(n)
    if count:
        graph.nodes = nodes
        graph.toposort()
    return count


def remove_unused(graph: Graph) -> int:
    """Drop canonical nodes whose outputs nothing reads (e.g. left behind by folding).

    Graph outputs are always live; namespaced ops ("aten::...", "<domain>::...") are kept, since
    they may have effects the IR does not model.
    """
    live = {id(v) for v in graph.outputs}
    keep: list[Node] = []
    for n in reversed(graph.nodes):
        if "::" in n.op or any(id(o) in live for o in n.outputs):
            keep.append(n)
            live.update(id(v) for v in n.inputs if v is not None)
    dropped = len(graph.nodes) - len(keep)
    graph.nodes = keep[::-1]
    return dropped


@register("finalize", required=True)
def finalize(graph: Graph, result: PassResult) -> None:
    """Expand unconsumed stand-ins and remove dead nodes."""
    result.changed += expand_standins(graph) + remove_unused(graph)
