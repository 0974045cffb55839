"""Matching helpers shared by the passes: who produces/reads a value, constants, axes, stand-ins.

Passes match by walking producers and users from an anchor node (as onnxscript's rewriter does),
so these helpers answer the questions a rule asks: "is this value made by a Mul?", "is it read only
once?", "is that operand the constant 0.5 (within tolerance)?". `GraphIndex` caches producers and
users so a pass over a large graph stays linear: pass it to `fuse`/`make_standin`, which keep it current,
or call `refresh()` after any other rewrite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from tkopt.ir import FUSED_DOMAIN, Dim, Graph, Node, Value

from .base import FusionError, flatten_replaced, legality_problem, place

# Ops that only pass a value through (Cast is one when it casts to the value's own dtype).
PASS_THROUGH = ("Identity", "Cast")


class GraphIndex:
    """Producers and users of every value of `graph`, computed once; `fuse`/`make_standin` given the index keep
    it current, any other change to the graph needs `refresh()`."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.refresh()

    def refresh(self) -> None:
        """Re-read producers and users after a rewrite."""
        self._prod = self.graph.producers()
        self._users = self.graph.user_map()
        self._outs = {id(v) for v in self.graph.outputs}
        self.sorted = False  # the graph is known to be in topological order (set by `place`)

    def replaced(self, old: Sequence[Node], new: Node) -> bool:
        """Update producers and users for `new` having taken the place of `old` with no other change (what
        `place` does), touching only the values they read and write; users stay in graph order, as `refresh`
        lists them. Returns whether the graph is known to be still sorted: it was, and `new` comes after the
        producers of what it reads and before the readers of what it makes (every other node kept its
        relative order, and legality left no other reader of what `old` made)."""
        gone = {id(n) for n in old}
        for n in old:
            for o in n.outputs:
                self._prod.pop(id(o), None)
        for o in new.outputs:
            self._prod[id(o)] = new
        position = self.graph.nodes.index  # of the few nodes asked about (a dict of all cost more)
        read = {id(v): v for n in (*old, new) for v in n.inputs if v is not None}
        for key, value in read.items():
            users = [u for u in self._users.get(key, ()) if id(u) not in gone]
            if any(v is value for v in new.inputs):
                users.append(new)
                users.sort(key=position)
            if users:
                self._users[key] = users
            else:
                self._users.pop(key, None)
        at = position(new)
        self.sorted = (
            self.sorted
            and all(position(p) < at for v in new.inputs if v is not None and (p := self._prod.get(id(v))))
            and all(position(u) > at for o in new.outputs for u in self._users.get(id(o), ()))
        )
        return self.sorted

    def user_map(self) -> dict[int, list[Node]]:
        """id(value) -> consuming nodes, as `Graph.user_map` gives them (the index's own map: do not mutate)."""
        return self._users

    def producer(self, value: Value | None, op: str | Iterable[str] | None = None) -> Node | None:
        """The node producing `value`, if there is one and (when `op` is given) it is that op."""
        if value is None:
            return None
        node = self._prod.get(id(value))
        if node is None or (op is not None and not is_op(node, op)):
            return None
        return node

    def users(self, value: Value) -> list[Node]:
        return self._users.get(id(value), [])

    def is_output(self, value: Value) -> bool:
        return id(value) in self._outs

    def single_use(self, value: Value) -> bool:
        """Read by exactly one node, once, and not a graph output: safe to fold into that reader."""
        users = self.users(value)
        return (
            len(users) == 1
            and not self.is_output(value)
            and sum(1 for v in users[0].inputs if v is value) == 1
        )

    def sole_user(self, value: Value, op: str | Iterable[str] | None = None) -> Node | None:
        """The one node reading `value` if `single_use(value)` (and it is `op` when given)."""
        if not self.single_use(value):
            return None
        user = self.users(value)[0]
        return user if op is None or is_op(user, op) else None


def index_of(g: Graph | GraphIndex) -> GraphIndex:
    return g if isinstance(g, GraphIndex) else GraphIndex(g)


def is_op(node: Node | None, op: str | Iterable[str]) -> bool:
    """`node` is an unfused canonical node of op `op` (or one of several)."""
    if node is None or node.domain == FUSED_DOMAIN:
        return False
    return node.op == op if isinstance(op, str) else node.op in tuple(op)


def producer_of(g: Graph | GraphIndex, value: Value | None, op: str | Iterable[str] | None = None) -> Node | None:
    """The node producing `value` if it is `op` (any op when None). Prefer a GraphIndex in loops."""
    return index_of(g).producer(value, op)


def single_use(g: Graph | GraphIndex, value: Value) -> bool:
    return index_of(g).single_use(value)


def other_input(node: Node, value: Value) -> Value | None:
    """For a binary node reading `value`, its other operand (None if it does not read `value`)."""
    a, b = node.inputs[0], node.inputs[1]
    if a is value:
        return b
    if b is value:
        return a
    return None


def operand_orders(node: Node) -> Iterator[tuple[Value | None, Value | None]]:
    """(a, b) then (b, a): for matching commutative ops (Add, Mul) in either operand order."""
    a, b = node.inputs[0], node.inputs[1]
    yield a, b
    yield b, a


# ---- constants ---------------------------------------------------------------------------------

def const_array(g: Graph | GraphIndex | None, value: Value | None) -> np.ndarray | None:
    """The data of `value` if it is constant: a const Value, a Constant node's output, or either seen
    through Identity/Cast (the Cast applied). `g` may be None to look at `value.const` only."""
    if value is None:
        return None
    if value.const is not None:
        return value.const
    if g is None:
        return None
    ix = index_of(g)
    node = ix.producer(value)
    if node is None:
        return None
    if is_op(node, "Constant") and isinstance(node.attr("value"), np.ndarray | int | float):
        return np.asarray(node.attr("value"))
    if is_op(node, "Identity"):
        return const_array(ix, node.inputs[0])
    if is_op(node, "Cast"):
        data = const_array(ix, node.inputs[0])
        dtype = node.attr("to")
        if data is None or dtype is None:
            return None
        return data.astype(np.float32 if dtype == "bfloat16" else np.dtype(dtype))
    return None


def const_scalar(value: Value | None, g: Graph | GraphIndex | None = None) -> float | None:
    """The value of a constant holding one element (any shape, e.g. () or (1,)), else None."""
    data = const_array(g, value)
    if data is None or data.size != 1:
        return None
    scalar = data.reshape(())[()]
    if isinstance(scalar, np.floating):  # float32 1e-6 reads as 1e-06, not 9.99999997e-07
        return float(str(scalar))
    return float(scalar)


def close(got: float | None, want: float, rel: float = 1e-3, abs_tol: float = 1e-6) -> bool:
    """`got` equals `want` up to rounding in how the exporter or model author wrote it."""
    return got is not None and math.isclose(got, want, rel_tol=rel, abs_tol=abs_tol)


# Unit roundoff of the 16-bit floats: how far from the number it stands for such a constant can be.
ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# A float64 model's coefficient: what its digits may miss the number by. A float64 model computes to ~1e-16, so a
# coefficient rounded to float32 (torch's dynamo exporter writes Python scalars so: sqrt(2/pi) as 0.79788458,
# 3e-8 off) moves its results by ~1e-8, and the fused op, which computes the exact function, would not reproduce
# them (fuzz seed 2050).
FLOAT64_REL = 1e-12


def const_problem(what: str, got: float | None, want: float, rel: float = 1e-3, dtype: str | None = None) -> str | None:
    """None if `got` matches `want`, else a refusal reason naming the constant and both values. `dtype`: the
    constants' dtype. `rel` is the tolerance of a float32 model. A 16-bit float cannot hold `want` within it
    (fp16's sqrt(2/pi) is 0.79785, 4e-5 off, and its 1/sqrt(2) 0.70703, 1.1e-4 off), so two of its roundings more
    are allowed: a coefficient may be a product or quotient of two constants, and a model of that dtype computes
    no closer anyway. A float64 model's must be right to FLOAT64_REL."""
    abs_tol = 1e-6
    if dtype == "float64":
        rel, abs_tol = FLOAT64_REL, 0.0
    rel = max(rel, 2 * ROUNDING.get(dtype or "", 0.0))
    if got is None:
        return f"{what} is not a constant scalar (expected {want:.6g})"
    if not close(got, want, rel, abs_tol):
        model = f" in a {dtype} model" if dtype else ""
        return f"{what} is {got!r}, expected {want!r} (relative tolerance {rel:g}{model})"
    return None


# ---- shapes and axes ---------------------------------------------------------------------------

def norm_axis(axis: int, rank: int | None) -> int:
    """A non-negative axis when the rank is known; negative axes stay negative otherwise."""
    return axis + rank if axis < 0 and rank is not None else axis


def norm_axes(axes: Sequence[int] | int | None, rank: int | None) -> tuple[int, ...] | None:
    if axes is None:
        return None
    if isinstance(axes, int | np.integer):
        axes = [int(axes)]
    return tuple(sorted(norm_axis(int(a), rank) for a in axes))


def trailing_axes(axes: Sequence[int] | int | None, rank: int | None) -> int | None:
    """If `axes` are exactly the last k axes, the first of them as a negative axis (-k), else None.

    Works without the rank when the axes are given negatively (as exporters usually write them).
    """
    if axes is None:
        return None
    ax = [int(axes)] if isinstance(axes, int | np.integer) else [int(a) for a in axes]
    if not ax:
        return None
    if rank is not None:
        ax = [a - rank if a >= 0 else a for a in ax]
    elif any(a >= 0 for a in ax):
        return None
    ax = sorted(ax)
    return ax[0] if ax == list(range(-len(ax), 0)) else None


def is_last_axis(axis: int | None, rank: int | None) -> bool:
    return axis is not None and (axis == -1 or (rank is not None and axis == rank - 1))


def squeezed_shape(shape: Sequence[Dim] | None) -> tuple[Dim, ...] | None:
    """`shape` without leading 1s: (1, 1, N) and (N,) broadcast alike over a trailing axis."""
    if shape is None:
        return None
    s = list(shape)
    while len(s) > 1 and s[0] == 1:
        s.pop(0)
    return tuple(s)


def is_vector_of(value: Value | None, size: Dim) -> bool:
    """`value` broadcasts as a vector of `size` over the last axis: shape (size,) or (1, ..., size)."""
    if value is None or value.shape is None:
        return False
    s = squeezed_shape(value.shape)
    return s is not None and len(s) == 1 and s[0] is not None and s[0] == size


def last_dim(value: Value | None) -> Dim:
    return None if value is None or not value.shape else value.shape[-1]


# ---- walking -----------------------------------------------------------------------------------

def is_noop_cast(node: Node, dtype_of: Value | None = None) -> bool:
    """A Cast to the dtype its input already has."""
    src = dtype_of or (node.inputs[0] if node.inputs else None)
    return is_op(node, "Cast") and src is not None and src.dtype is not None and node.attr("to") == src.dtype


def strip(g: Graph | GraphIndex, value: Value, ops: Iterable[str] = PASS_THROUGH) -> Value:
    """Walk up from `value` through single-input pass-through producers (Identity, Cast, ...)."""
    ix = index_of(g)
    ops = tuple(ops)
    node = ix.producer(value, ops)
    while node is not None and node.inputs and node.inputs[0] is not None:
        value = node.inputs[0]
        node = ix.producer(value, ops)
    return value


def make_standin(
    graph: Graph,
    nodes: Sequence[Node],
    op: str,
    inputs: Sequence[Value | None],
    outputs: Sequence[Value],
    attrs: dict[str, Any],
    index: GraphIndex | None = None,
) -> Node:
    """Replace `nodes` by one canonical node `op` standing for them (e.g. Gelu for its erf form).

    The stand-in has `replaced` (the original nodes) and no origin and no domain: if no fusion
    consumes it, the finalize pass puts the original nodes back. Raises FusionError (the reason)
    when the nodes cannot legally become one node (an intermediate is read elsewhere, ...). `index`, when
    given, is used and kept current as by `fuse`.
    """
    problem = legality_problem(graph, nodes, outputs, index)
    if problem:
        raise FusionError(problem)
    members = {id(n) for n in nodes}
    ordered = [n for n in graph.nodes if id(n) in members]
    node = Node(op=op, inputs=list(inputs), outputs=list(outputs), attrs=dict(attrs),
                name=graph.fresh_name(op), replaced=flatten_replaced(ordered))
    place(graph, ordered, node, index)
    return node


def is_standin(node: Node) -> bool:
    """A recognised canonical node that still stands for original nodes (not a fused node)."""
    return bool(node.replaced) and node.domain != FUSED_DOMAIN
