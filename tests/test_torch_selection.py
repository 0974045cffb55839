"""Measured selection on the torch target with inductor for the unfused rest: a fused node is timed against
eager ATen first, and inductor compiles what it replaces only where the fused op beat eager (a compile costs
seconds, and inductor's code for a subgraph is no slower than ATen's in practice, so it cannot change a loss)."""

from __future__ import annotations

import pytest
import torch

from tests.modules import LinearAddNorm
from tkopt.backends import inductor
from tkopt.frontends.fx import import_fx
from tkopt.passes.pipeline import run_passes
from tkopt.pipeline import MARGIN, _apply, _entry, optimize
from tkopt.report import NodeDecision
from tkopt.targets.torch_target import TorchTarget


@pytest.fixture
def compiles(monkeypatch) -> list[torch.fx.GraphModule]:
    """The modules inductor compiles from here on; the real inductor still compiles each."""
    real = inductor.compile_graph
    seen: list[torch.fx.GraphModule] = []

    def spy(gm, example_inputs):
        seen.append(gm)
        return real(gm, example_inputs)

    monkeypatch.setattr(inductor, "compile_graph", spy)
    return seen


def _targets(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_cpu_inductor_compiles_only_what_beat_eager(tmp_path, monkeypatch, compiles, one_thread) -> None:
    """On CPU with inductor=True (as tkopt.compile(..., inductor=True) runs the rest), real TileLang CPU kernels:
    the GEMM loses to ATen's (the C backend is serial and scalar) and is declined from that measurement, no
    inductor compile of its subgraph; a node that beats eager is then compiled and decided against inductor.
    No fused op beats ATen on this backend (a kernel call alone costs ~0.1 ms; ATen's add + LayerNorm 0.01-0.05
    ms at small shapes, 10x faster at large ones), so the add + norm is then measured under a rule that lets it
    win against eager."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = LinearAddNorm(96).eval()
    inputs = (torch.randn(33, 96), torch.randn(33, 96))
    target = TorchTarget(inputs, inductor=True)
    assert target.fingerprint()["unfused"] == "inductor"
    result = optimize(import_fx(torch.export.export(model, inputs)), target, select="measured")
    by_op = {d.op: d for d in result.report.nodes}
    gemm = by_op["FusedGemm"]
    assert gemm.decision == "slower" and gemm.reason == f"under {MARGIN:.2f}x at example inputs, against eager"
    assert gemm.unfused_ms * MARGIN < gemm.fused_ms
    # Nothing compiled the GEMM's subgraph; the add + norm (which loses to eager too, but a burst of load
    # could make it win there) was compiled exactly when it was measured so.
    assert not any({"aten.linear.default", "aten.addmm.default"} & _targets(gm) for gm in compiles)
    add_norm = by_op["FusedAddNorm"]
    assert len(compiles) == (add_norm.decision == "kept" or add_norm.reason.endswith("against inductor"))

    graph = import_fx(torch.export.export(model, inputs))
    run_passes(graph, ())
    norm = next(n for n in graph.nodes if n.op == "FusedAddNorm")
    compiles.clear()
    with torch.no_grad():
        [m] = target.measure(graph, [norm], lambda fused, unfused: True)
    assert m.error is None and m.labels == ["example inputs, against eager", "example inputs, against inductor"]
    [compiled] = compiles
    assert "aten.layer_norm.default" in _targets(compiled) and "aten.add.Tensor" in _targets(compiled)
    d = NodeDecision(norm.name, norm.op, "add_norm", len(norm.replaced))
    _apply(d, _entry(m), cached=False)
    assert (d.fused_ms, d.unfused_ms) == (m.sizes[1][0].min_ms, m.sizes[1][1].min_ms)
    assert d.decision == "kept" or d.reason == f"under {MARGIN:.2f}x at example inputs, against inductor"


def test_a_node_whose_subgraph_inductor_fails_on_is_decided_against_eager(tmp_path, monkeypatch) -> None:
    """The entry point runs eager code where inductor fails, so that is what the node is decided against,
    with a warning naming the node, instead of blaming the fused kernel."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    def refuse(gm, example_inputs):
        raise RuntimeError("no code for this graph")

    monkeypatch.setattr(inductor, "compile_graph", refuse)
    torch.manual_seed(0)
    model = LinearAddNorm(96).eval()
    inputs = (torch.randn(33, 96), torch.randn(33, 96))
    graph = import_fx(torch.export.export(model, inputs))
    run_passes(graph, ())
    norm = next(n for n in graph.nodes if n.op == "FusedAddNorm")
    warned = f"inductor failed on what {norm.name} .*no code for this graph"
    with torch.no_grad(), pytest.warns(UserWarning, match=warned):
        [m] = TorchTarget(inputs, inductor=True).measure(graph, [norm], lambda fused, unfused: True)
    assert m.error is None and m.labels == ["example inputs, against eager"] and len(m.sizes) == 1
