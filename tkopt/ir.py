"""tkopt's one graph IR, fed by the FX and ONNX frontends and read by both backends.

Ops carry ONNX-flavoured canonical names (MatMul, Add, Softmax, Transpose(perm), ...) so that a
fusion pattern is written once and fires on graphs from torch.export, Dynamo and both ONNX
exporters. Every node keeps `origin`, the frontend's own object (an onnx NodeProto or an fx.Node):
backends re-emit unfused nodes from it unchanged, so the IR never has to express every op's full
semantics. A node that stands for others keeps `replaced`, the original nodes it stands for: a fused node
(domain "tkopt"), whose unfused fallback and reference they are, and a recognised canonical node
(Gelu, LayerNormalization, ...), which the pipeline expands back if no fusion consumed it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Dim = int | str | None  # int: static; str: symbolic (e.g. "batch"); None: unknown
FUSED_DOMAIN = "tkopt"


@dataclass(eq=False)
class Value:
    """A tensor: its dtype ("float32", "float16", "bfloat16", "int64", "bool", ...) and shape.

    `shape` is None when even the rank is unknown. `const` holds the data of initializers, lifted
    constants and folded constants (a numpy array; bfloat16 data is kept as float32); FX parameters and
    persistent buffers have none, as they may change after compiling.
    `origin` is frontend data (e.g. the fx.Node that produces it).
    """

    name: str
    dtype: str | None = None
    shape: tuple[Dim, ...] | None = None
    const: np.ndarray | None = None
    origin: Any = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def is_const(self) -> bool:
        return self.const is not None

    def __repr__(self) -> str:
        return f"%{self.name}:{self.dtype}{list(self.shape) if self.shape is not None else '[?]'}"


@dataclass(eq=False)
class Node:
    """One op. `inputs` may hold None for an omitted optional input (kept positional)."""

    op: str
    inputs: list[Value | None]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""
    origin: Any = None
    replaced: list[Node] = field(default_factory=list)

    @property
    def is_fused(self) -> bool:
        return self.domain == FUSED_DOMAIN

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def __repr__(self) -> str:
        ins = ", ".join("None" if v is None else v.name for v in self.inputs)
        outs = ", ".join(v.name for v in self.outputs)
        dom = f"{self.domain}::" if self.domain else ""
        return f"{outs} = {dom}{self.op}({ins}) {self.attrs or ''} [{self.name}]"


class Graph:
    """Nodes in topological order, graph inputs/outputs, and constants.

    Producers and users are derived on demand (`producer`, `users`), so passes mutate node lists
    and input slots freely and never keep side tables in sync.
    """

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.meta: dict[str, Any] = {}
        self._names: set[str] = set()
        self._counter = itertools.count()

    # ---- construction -------------------------------------------------------------------------
    def fresh_name(self, prefix: str) -> str:
        """A value/node name not used in this graph yet."""
        while True:
            name = f"{prefix}_{next(self._counter)}"
            if name not in self._names:
                self._names.add(name)
                return name

    def reserve(self, name: str) -> str:
        self._names.add(name)
        return name

    def add_node(self, node: Node, index: int | None = None) -> Node:
        if not node.name:
            node.name = self.fresh_name(node.op)
        self.reserve(node.name)
        for v in node.outputs:
            self.reserve(v.name)
        if index is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(index, node)
        return node

    # ---- queries ------------------------------------------------------------------------------
    def producer(self, value: Value) -> Node | None:
        for n in self.nodes:
            if any(o is value for o in n.outputs):
                return n
        return None

    def producers(self) -> dict[int, Node]:
        """id(value) -> producing node, for passes that ask many times."""
        return {id(o): n for n in self.nodes for o in n.outputs}

    def users(self, value: Value) -> list[Node]:
        return [n for n in self.nodes if any(i is value for i in n.inputs)]

    def user_map(self) -> dict[int, list[Node]]:
        """id(value) -> consuming nodes (a node appears once per value even if it reads it twice)."""
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None:
                    users = out.get(id(v))
                    if users is None:
                        out[id(v)] = [n]
                    elif users[-1] is not n:  # nodes come in order: a second read by n finds n last
                        users.append(n)
        return out

    def is_output(self, value: Value) -> bool:
        return any(o is value for o in self.outputs)

    def values(self) -> Iterator[Value]:
        """Every value once: graph inputs, then node inputs/outputs in order."""
        seen: set[int] = set()
        for v in itertools.chain(self.inputs, *((*n.inputs, *n.outputs) for n in self.nodes)):
            if v is not None and id(v) not in seen:
                seen.add(id(v))
                yield v

    def count_ops(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            key = f"{n.domain}::{n.op}" if n.domain else n.op
            counts[key] = counts.get(key, 0) + 1
        return counts

    # ---- order --------------------------------------------------------------------------------
    def toposort(self) -> bool:
        """Reorder nodes topologically, keeping the current order where it is free (stable: of the nodes whose
        producers are placed, the earliest in the current order goes next); returns whether any node moved.
        Raises ValueError on a cycle. An order that is already topological is kept as it is, without sorting:
        fusing sorts after every node it places, which rarely moves anything (BERT-base: 110 sorts). Kahn's
        algorithm on a heap, not networkx, whose import cost every compile 0.36 s (2-core CPU, -X importtime)."""
        if self.is_sorted():
            return False
        prod = self.producers()
        readers: list[list[int]] = [[] for _ in self.nodes]
        waiting = [0] * len(self.nodes)
        position = {id(n): i for i, n in enumerate(self.nodes)}
        for i, n in enumerate(self.nodes):
            for p in {position[id(prod[id(v)])] for v in n.inputs if v is not None and id(v) in prod}:
                readers[p].append(i)
                waiting[i] += 1
        ready = [i for i, w in enumerate(waiting) if w == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for r in readers[i]:
                waiting[r] -= 1
                if waiting[r] == 0:
                    heapq.heappush(ready, r)
        if len(order) < len(self.nodes):
            stuck = [self.nodes[i].name for i, w in enumerate(waiting) if w > 0]
            raise ValueError(f"graph {self.name} has a cycle through {', '.join(stuck[:5])}")
        self.nodes = [self.nodes[i] for i in order]
        return True

    def is_sorted(self) -> bool:
        """Whether every node comes after the producers of its inputs."""
        position = {id(o): i for i, n in enumerate(self.nodes) for o in n.outputs}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                if position.get(id(v), -1) >= i:
                    return False
        return True

    # ---- mutation -----------------------------------------------------------------------------
    def replace_uses(self, old: Value, new: Value, skip: Iterable[Node] = ()) -> None:
        """Point every reader of `old` (and the graph outputs) at `new`, except nodes in `skip`."""
        skipped = {id(n) for n in skip}
        for n in self.nodes:
            if id(n) in skipped:
                continue
            n.inputs = [new if v is old else v for v in n.inputs]
        self.outputs = [new if v is old else v for v in self.outputs]

    def remove_nodes(self, nodes: Iterable[Node]) -> None:
        gone = {id(n) for n in nodes}
        self.nodes = [n for n in self.nodes if id(n) not in gone]

    def remove_dead(self) -> int:
        """Drop nodes none of whose outputs reach a graph output. Returns how many were dropped."""
        live: set[int] = {id(v) for v in self.outputs}
        keep: list[Node] = []
        for n in reversed(self.nodes):
            if any(id(o) in live for o in n.outputs):
                keep.append(n)
                live.update(id(v) for v in n.inputs if v is not None)
        dropped = len(self.nodes) - len(keep)
        self.nodes = keep[::-1]
        return dropped

    def __repr__(self) -> str:
        lines = [f"graph {self.name}({', '.join(map(repr, self.inputs))}):"]
        lines += [f"  {n!r}" for n in self.nodes]
        lines.append(f"  return {', '.join(v.name for v in self.outputs)}")
        return "\n".join(lines)
