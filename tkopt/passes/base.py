"""What every pass shares: the result it reports, refusals with reasons, and the one way to fuse.

A fusion rule reads like the math (after onnxscript's rewriter): find candidate anchors, `check`
each match and return a refusal reason string for a near miss, else `rewrite` it with `fuse`.
Reasons are kept so that the report can say why a near match was not fused.

Every condition a rewrite relies on must hold for every shape and value the graph admits: prove it
from the graph's structure (tkopt/passes/shapes.py for dims, tkopt/passes/masks.py for masks), never by trying
sizes; where it cannot be proved, keep the general form or refuse with the reason. The discipline,
and FusedAttention's exact semantics: docs/LEGALITY.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tkopt.fused_ops import schema
from tkopt.ir import FUSED_DOMAIN, Graph, Node, Value


class GraphIndex(Protocol):
    """What `fuse` reads and keeps current of an index of the graph (patterns.GraphIndex; a protocol here, as
    patterns builds on this module)."""

    sorted: bool

    def user_map(self) -> dict[int, list[Node]]: ...

    def replaced(self, old: Sequence[Node], new: Node) -> bool: ...

    def refresh(self) -> None: ...


@dataclass
class Refusal:
    """A near match that was not fused: which rule, at which node, and why."""

    rule: str
    node: str
    reason: str

    def __str__(self) -> str:
        return f"{self.rule} at {self.node}: {self.reason}"


@dataclass
class PassResult:
    name: str
    fused: int = 0
    changed: int = 0  # canonicalization edits (folded, dropped, recognised)
    refusals: list[Refusal] = field(default_factory=list)

    def refuse(self, node: Node | str, reason: str) -> None:
        self.refusals.append(Refusal(self.name, node if isinstance(node, str) else node.name, reason))


class FusionError(ValueError):
    """Raised by `fuse` when the node set cannot legally become one node; the message is the reason."""


def legality_problem(
    graph: Graph, nodes: Sequence[Node], outputs: Sequence[Value], index: GraphIndex | None = None
) -> str | None:
    """Why `nodes` cannot become one node producing `outputs`, or None if it can.

    Two rules: no dataflow path may leave the set and re-enter it (the fused node would depend on
    its own output), and every value produced inside and read outside must be one of `outputs`.
    Users are read from `index` when given (it must be current for `graph`), else from the graph.
    """
    inside = {id(n) for n in nodes}
    produced = {id(v) for n in nodes for v in n.outputs}
    wanted = {id(v) for v in outputs}
    missing = [v for v in outputs if id(v) not in produced]
    if missing:
        return f"outputs {[v.name for v in missing]} are not produced by the matched nodes"
    users = graph.user_map() if index is None else index.user_map()
    for n in nodes:
        for v in n.outputs:
            outside = [u for u in users.get(id(v), []) if id(u) not in inside]
            if (outside or graph.is_output(v)) and id(v) not in wanted:
                who = outside[0].name if outside else "the graph output"
                return f"intermediate {v.name} (from {n.name}) is also used by {who}"
    # One walk forward from every node the match feeds: reaching the match again is a cycle. In a graph the
    # index knows to be sorted, such a path runs through nodes placed before the match's last one, so the walk
    # leaves out the rest (all that a match early in a whole model feeds).
    order = graph.nodes
    last = max(map(order.index, nodes)) if index is not None and index.sorted else None

    def may_return(u: Node) -> bool:
        if last is None:
            return True
        try:
            order.index(u, 0, last)
        except ValueError:
            return False
        return True

    exits = {id(u): u for n in nodes for v in n.outputs for u in users.get(id(v), []) if id(u) not in inside}
    stack = [(u, u) for u in exits.values() if may_return(u)]  # (node, where the path left the match)
    seen = set(exits)
    while stack:
        n, left_at = stack.pop()
        for v in n.outputs:
            for u in users.get(id(v), []):
                if id(u) in inside:
                    return f"path leaves the match at {left_at.name} and re-enters it"
                if id(u) not in seen:
                    seen.add(id(u))
                    if may_return(u):
                        stack.append((u, left_at))
    return None


def flatten_replaced(nodes: Iterable[Node]) -> list[Node]:
    """The frontend's original nodes behind `nodes` (stand-ins and fused nodes expanded)."""
    out: list[Node] = []
    for n in nodes:
        out.extend(n.replaced or [n])
    return out


def fuse(
    graph: Graph,
    nodes: Sequence[Node],
    op: str,
    inputs: Sequence[Value | None],
    outputs: Sequence[Value],
    attrs: dict[str, Any],
    index: GraphIndex | None = None,
) -> Node:
    """Replace `nodes` by one fused node `op` reading `inputs` and producing `outputs`.

    The fused node takes the original output Values themselves, so every reader keeps working.
    An optional output that is unused is passed as None by the caller and dropped here.
    Raises FusionError (with the reason) if the set cannot be fused: dtypes the op does not declare,
    or a dataflow problem (`legality_problem`). Every fusion goes through here, so these two hold for all.
    With `index` (current for `graph`: nothing else changed since it was refreshed or last passed here), the
    legality check reads its users and the index is kept current (`place`), so the caller need not refresh it.
    """
    s = schema(op)
    if len(inputs) > len(s.inputs):
        raise ValueError(f"{op} takes {len(s.inputs)} inputs {s.inputs}, got {len(inputs)}")
    inputs = s.padded(inputs)  # trailing optional inputs left out: absent
    problem = s.dtype_problem(inputs, outputs) or legality_problem(
        graph, nodes, [v for v in outputs if v is not None], index
    )
    if problem:
        raise FusionError(problem)
    for name, v in zip(s.inputs, inputs, strict=True):
        if v is None and name not in s.optional_inputs:
            raise ValueError(f"{op}: input {name} is required")
    outs = list(outputs)
    while outs and outs[-1] is None:
        outs.pop()
    if any(v is None for v in outs):
        raise ValueError(f"{op}: only trailing outputs may be omitted")
    members = {id(n) for n in nodes}
    ordered = [n for n in graph.nodes if id(n) in members]
    fused = Node(
        op=op, inputs=list(inputs), outputs=outs, attrs=s.full_attrs(attrs),
        name=graph.fresh_name(op), domain=FUSED_DOMAIN, replaced=flatten_replaced(ordered),
    )
    place(graph, ordered, fused, index)
    return fused


def place(graph: Graph, ordered: Sequence[Node], new: Node, index: GraphIndex | None = None) -> None:
    """Put `new` where the last of `ordered` (in graph order) stood, drop them and re-sort (a reader of one of
    their outputs may sit between them). `index`, current before, is updated in place and rebuilt only where
    the sort moved a node; the sort's whole-graph check is skipped where the index knows the order still holds.
    Rebuilding the index and checking the order after every fusion was most of the passes' time on whole models."""
    graph.add_node(new, graph.nodes.index(ordered[-1]) + 1)
    graph.remove_nodes(ordered)
    if index is None:
        graph.toposort()
    elif not index.replaced(ordered, new):
        if graph.toposort():
            index.refresh()
        index.sorted = True


def unfuse(graph: Graph, nodes: Iterable[Node]) -> None:
    """Put fused nodes' original subgraphs back (their kernels are unavailable or lost), each where its fused
    node stood, in one pass and one sort (one per node was most of emitting BERT-base); readers keep working
    because the originals produce the very Values the fused nodes did."""
    back = {id(n) for n in nodes}
    if back:
        graph.nodes = [r for n in graph.nodes for r in (n.replaced if id(n) in back else [n])]
        graph.toposort()
