"""Graph.toposort: stable, and an order that is already topological is left exactly as it is."""

from __future__ import annotations

import pytest

from tkopt.ir import Graph, Node, Value


def _chain() -> tuple[Graph, list[Node]]:
    """x -> a -> b, x -> c (c independent of a and b), b and c -> d."""
    g = Graph()
    x = Value("x")
    g.inputs = [x]
    va, vb, vc, vd = (Value(n) for n in "abcd")
    a = Node("Relu", [x], [va], name="a")
    b = Node("Neg", [va], [vb], name="b")
    c = Node("Exp", [x], [vc], name="c")
    d = Node("Add", [vb, vc], [vd], name="d")
    g.outputs = [vd]
    return g, [a, b, c, d]


@pytest.mark.parametrize("order", ["abcd", "cabd", "acbd"])
def test_sorted_order_is_kept(order: str) -> None:
    g, nodes = _chain()
    g.nodes = [nodes["abcd".index(k)] for k in order]
    assert g.is_sorted()
    g.toposort()
    assert "".join(n.name for n in g.nodes) == order


@pytest.mark.parametrize(("order", "want"), [("dcba", "cabd"), ("badc", "abcd"), ("bacd", "abcd")])
def test_unsorted_order_is_sorted_stably(order: str, want: str) -> None:
    """Each node goes as early as its order allows: the earliest-placed ready node first."""
    g, nodes = _chain()
    g.nodes = [nodes["abcd".index(k)] for k in order]
    assert not g.is_sorted()
    g.toposort()
    assert "".join(n.name for n in g.nodes) == want


def test_cycle_raises() -> None:
    g, (a, b, _, _) = _chain()
    a.inputs = [b.outputs[0]]
    g.nodes = [a, b]
    assert not g.is_sorted()
    with pytest.raises(ValueError, match="cycle"):
        g.toposort()
