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


def remove_unused(graph: Graph, keep_fallbacks: bool = True) -> int:
    """Drop canonical nodes whose outputs nothing reads (e.g. left behind by folding).

    Graph outputs are always live; namespaced ops ("aten::...", "<domain>::...") are kept, since
    they may have effects the IR does not model. With `keep_fallbacks`, what a fused node's original
    nodes read stays live too (e.g. a causal mask the fused node does not need): a node whose kernel
    then proves unavailable is unfused and needs them. `seal` drops them once kernels are settled.
    Node order follows the fused nodes' own inputs only, so a fallback's producer may come after its
    fused node: liveness is swept to a fixed point, not in one backward pass.
    """
    live = {id(v) for v in graph.outputs}
    kept: set[int] = set()
    grew = True
    while grew:
        grew = False
        for n in reversed(graph.nodes):
            if id(n) in kept or not ("::" in n.op or any(id(o) in live for o in n.outputs)):
                continue
            kept.add(id(n))
            grew = True
            live.update(id(v) for v in n.inputs if v is not None)
            if keep_fallbacks and n.is_fused:
                live.update(id(v) for r in n.replaced for v in r.inputs if v is not None)
    dropped = len(graph.nodes) - len(kept)
    graph.nodes = [n for n in graph.nodes if id(n) in kept]
    return dropped


def seal(graph: Graph) -> int:
    """Drop what only fused nodes' fallbacks read: call once every fused node's kernel is settled."""
    return remove_unused(graph, keep_fallbacks=False)


@register("finalize", required=True)
def finalize(graph: Graph, result: PassResult) -> None:
    """Expand unconsumed stand-ins and remove dead nodes."""
    result.changed += expand_standins(graph) + remove_unused(graph)
