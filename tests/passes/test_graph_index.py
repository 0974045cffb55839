"""A GraphIndex kept current through fusions (`place`) equals one rebuilt from the graph, users in graph order;
legality read from it gives the graph's own answer; memoized reshape sizes are sympy.simplify's."""

from __future__ import annotations

import pytest
import sympy
from torch import nn

from tkopt.frontends.fx import import_fx
from tkopt.ir import Graph, Node, Value
from tkopt.models import blocks
from tkopt.models.export import export_fx
from tkopt.passes import patterns
from tkopt.passes.base import FusionError, legality_problem
from tkopt.passes.patterns import GraphIndex, make_standin
from tkopt.passes.pipeline import run_passes
from tkopt.passes.shapes import _simplified, size_symbol


def _assert_current(ix: GraphIndex) -> None:
    fresh = GraphIndex(ix.graph)
    assert ix._prod == fresh._prod
    assert {k: [u.name for u in us] for k, us in ix._users.items()} == {
        k: [u.name for u in us] for k, us in fresh._users.items()
    }


@pytest.mark.parametrize("name", ["gpt2_block", "llama_block", "bert_layer"])
def test_index_stays_current_through_every_fusion(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every in-place update the passes make on a real export leaves the index equal to a rebuilt one."""
    real = GraphIndex.replaced
    updates = []

    def checked(self: GraphIndex, old: list[Node], new: Node) -> bool:
        still_sorted = real(self, old, new)
        _assert_current(self)
        assert not still_sorted or self.graph.is_sorted()
        updates.append(still_sorted)
        return still_sorted

    monkeypatch.setattr(patterns.GraphIndex, "replaced", checked)
    model, inputs = blocks.REFERENCE_MODELS[name]()
    run_passes(import_fx(export_fx(model, inputs)))
    assert len(updates) >= 4 and any(updates)


def test_the_users_map_is_not_rebuilt_per_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole-graph user maps are built per pass and per attention anchor, not per fusion: two more GPT-2
    blocks (14 more fused nodes) add the attention pass's two per block (its refresh and its legality
    check), where rebuilding per fusion added ~2 per fused node."""
    real = Graph.user_map
    built: list[int] = []
    monkeypatch.setattr(Graph, "user_map", lambda self: built.append(1) or real(self))

    def run(depth: int) -> tuple[int, int]:
        model, (x,) = blocks.REFERENCE_MODELS["gpt2_block"]()
        graph = import_fx(export_fx(nn.Sequential(*[model] * depth), (x,), dynamic=False))
        built.clear()
        report = run_passes(graph)
        return len(built), report.total_fused

    (maps1, fused1), (maps3, fused3) = run(1), run(3)
    assert fused3 - fused1 >= 10
    assert maps3 - maps1 <= 4


def _graph(order: str) -> tuple[Graph, dict[str, Node]]:
    """c reads x; a = Relu(x) feeds b = Neg(a) and r = Exp(a); d reads x last. Nodes in `order`."""
    x = Value("x")
    va, vb, vr, vc, vd = (Value(f"v{k}") for k in "abrcd")
    nodes = {
        "c": Node("Exp", [x], [vc], name="c"),
        "a": Node("Relu", [x], [va], name="a"),
        "b": Node("Neg", [va, x], [vb], name="b"),
        "r": Node("Exp", [va], [vr], name="r"),
        "d": Node("Sigmoid", [x], [vd], name="d"),
    }
    g = Graph()
    g.inputs = [x]
    g.nodes = [nodes[k] for k in order]
    g.outputs = [vb, vr, vc, vd]
    return g, nodes


@pytest.mark.parametrize("order", ["cabrd", "carbd"])
def test_index_after_a_standin_in_place_and_after_a_sort(order: str) -> None:
    """Merging a and b in a graph known sorted: with r after b the order still holds (no sort); with r between
    them r must move after the stand-in (sorted, the index rebuilt). Either way x's readers stay in graph order."""
    g, n = _graph(order)
    ix = GraphIndex(g)
    ix.sorted = g.is_sorted()
    new = make_standin(g, [n["a"], n["b"]], "Gelu", [n["a"].inputs[0]], [n["a"].outputs[0], n["b"].outputs[0]],
                       {}, ix)
    assert [m.name for m in g.nodes] == ["c", new.name, "r", "d"]
    _assert_current(ix)
    assert [u.name for u in ix.users(g.inputs[0])] == ["c", new.name, "d"]
    assert ix.producer(n["a"].outputs[0]) is new


def test_legality_through_the_index_matches_the_graph() -> None:
    """A refused merge (a's output is read by r outside the set) gives the same reason either way."""
    g, n = _graph("cabrd")
    ix = GraphIndex(g)
    want = legality_problem(g, [n["a"], n["b"]], [n["b"].outputs[0]])
    assert want == "intermediate va (from a) is also used by r"
    assert legality_problem(g, [n["a"], n["b"]], [n["b"].outputs[0]], ix) == want
    with pytest.raises(FusionError, match="also used by r"):
        make_standin(g, [n["a"], n["b"]], "Gelu", [g.inputs[0]], [n["b"].outputs[0]], {}, ix)
    _assert_current(ix)


def test_a_path_out_and_back_in_is_found_in_a_sorted_graph() -> None:
    """a -> r -> b with r outside: merging a and b would read its own output. The walk, bounded by the
    match's last node in a graph known sorted, still finds r."""
    x = Value("x")
    va, vr, vb = Value("va"), Value("vr"), Value("vb")
    a, r = Node("Relu", [x], [va], name="a"), Node("Exp", [va], [vr], name="r")
    b = Node("Add", [va, vr], [vb], name="b")
    g = Graph()
    g.inputs, g.nodes, g.outputs = [x], [a, r, b], [vb]
    ix = GraphIndex(g)
    ix.sorted = True
    want = "path leaves the match at r and re-enters it"
    assert legality_problem(g, [a, b], [va, vb]) == want
    assert legality_problem(g, [a, b], [va, vb], ix) == want


s, t = size_symbol("s"), size_symbol("t")


@pytest.mark.parametrize("expr", [
    sympy.Integer(12), s, 4 * s * t, s**2 * t,  # monomials: returned as they are
    (2 * s + 2) / (s + 1), (s * t + s) / (t + 1), s / 2, (s - t) / (t - s),  # the rest: simplified
])
def test_simplified_is_sympy_simplify(expr: sympy.Expr) -> None:
    assert _simplified(expr) == sympy.simplify(expr)
