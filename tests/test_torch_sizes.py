"""Measured selection on the torch targets at more than the example's size: one specialization of a dynamic
export serves every size its dims admit, so a fused node is kept only if it also wins at a larger size."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn
from torch.export import Dim

import tkopt
from tests.modules import LinearAddNorm
from tkopt.backends.torch_ops import CUSTOM_OPS
from tkopt.frontends.fx import import_fx
from tkopt.input_sizes import gathers_refuse, index_out_of_range
from tkopt.kernels.tuning import shape_bucket
from tkopt.passes.pipeline import run_passes
from tkopt.pipeline import MARGIN, _apply, _entry
from tkopt.report import NodeDecision
from tkopt.targets.torch_target import TorchTarget

AUTO = {0: Dim.AUTO, 1: Dim.AUTO, 2: Dim.AUTO}
EXAMPLE = "example inputs (x 2x8x32)"
LARGER = "larger inputs (x 8x32x32)"  # batch and sequence 4x each: 16x the elements
LARGER_RE = re.escape(LARGER)


def _fused(dynamic: bool):
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 32), torch.randn(2, 8, 32))
    ep = torch.export.export(LinearAddNorm(32).eval(), inputs, dynamic_shapes=(AUTO, AUTO) if dynamic else None)
    graph = import_fx(ep)
    run_passes(graph, ())
    return graph, next(n for n in graph.nodes if n.op == "FusedAddNorm"), inputs


@pytest.fixture
def timed_shapes(monkeypatch) -> list[list[tuple[int, ...]]]:
    """The input shapes of every call of the add + norm's custom op (the real op still runs)."""
    real = CUSTOM_OPS["FusedAddNorm"]
    seen: list[list[tuple[int, ...]]] = []

    def spy(*args):
        seen.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return real(*args)

    monkeypatch.setitem(CUSTOM_OPS, "FusedAddNorm", spy)
    return seen


def test_a_dynamic_export_is_measured_at_the_example_and_a_larger_size(monkeypatch, timed_shapes) -> None:
    """Symbolic batch and sequence: the node is timed at the example inputs, then at 4x each (the inputs hold
    16x the elements), on the values the original graph computes there; the labels name both sizes."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    graph, norm, inputs = _fused(dynamic=True)
    with torch.no_grad():
        [m] = TorchTarget(inputs).measure(graph, [norm], lambda fused, unfused: True)
    assert m.error is None
    assert m.labels == [f"{EXAMPLE}, against eager", f"{LARGER}, against eager"]
    assert {shapes[0] for shapes in timed_shapes} == {(2, 8, 32), (8, 32, 32)}
    assert timed_shapes[-1][:2] == [(8, 32, 32), (8, 32, 32)]  # the residual and the GEMM's output


@pytest.mark.parametrize(("large_dim", "labels"), [
    (16, [EXAMPLE, "larger inputs (x 8x16x32)"]),  # the sequence stops at LARGE_DIM, the batch grows 4x
    (4, [EXAMPLE, "larger inputs (x 4x8x32)"]),  # the sequence's example is past it: not grown at all
    (1, [EXAMPLE]),  # both are: the example is the one size measured
])
def test_no_dim_grows_past_large_dim_unless_its_example_is_there(monkeypatch, large_dim, labels) -> None:
    """A dim that long already is not grown (torch_target.LARGE_DIM): a Llama-style model served at 1x8192 was
    measured, and its attention probed, at 131072 keys."""
    monkeypatch.setattr("tkopt.targets.torch_target.LARGE_DIM", large_dim)
    graph, _, inputs = _fused(dynamic=True)
    assert [size.label for size in TorchTarget(inputs).sizes(graph.meta["fx_module"])] == labels


def test_a_node_that_loses_at_the_larger_size_is_not_kept(monkeypatch, timed_shapes) -> None:
    """A node that wins at the example and loses at the larger size: measuring stops there, and the decision
    names the size it lost at. The rule (pipeline._wins) lets only the first timing win, so the outcome does
    not hang on how TileLang's serial CPU kernels compare with ATen."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    first: list[object] = []

    def wins_first(fused, unfused) -> bool:
        first.append(first[0] if first else fused)
        return fused is first[0]

    monkeypatch.setattr("tkopt.pipeline._wins", wins_first)
    graph, norm, inputs = _fused(dynamic=True)
    target = TorchTarget(inputs, inductor=True)
    with torch.no_grad():
        [m] = target.measure(graph, [norm], wins_first)
    # won against eager at the example, so against inductor there too: only the first timing wins, so it lost
    assert m.labels == [f"{EXAMPLE}, against eager", f"{EXAMPLE}, against inductor"]
    first.clear()
    target.inductor = False
    with torch.no_grad():
        [m] = target.measure(graph, [norm], wins_first)
    assert m.labels == [f"{EXAMPLE}, against eager", f"{LARGER}, against eager"]
    d = NodeDecision(norm.name, norm.op, "add_norm", len(norm.replaced))
    first.clear()
    _apply(d, _entry(m), cached=False)
    assert d.decision == "slower" and d.reason == f"under {MARGIN:.2f}x at {LARGER}, against eager"
    assert (d.fused_ms, d.unfused_ms) == (m.sizes[1][0].min_ms, m.sizes[1][1].min_ms)


def test_a_static_export_is_measured_once_at_the_example(monkeypatch, timed_shapes) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    graph, norm, inputs = _fused(dynamic=False)
    target = TorchTarget(inputs)
    with torch.no_grad():
        [m] = target.measure(graph, [norm], lambda fused, unfused: True)
    assert m.labels == ["example inputs, against eager"]
    assert {shapes[0] for shapes in timed_shapes} == {(2, 8, 32)}
    assert target.node_key(graph, norm)[3][0] == ["float32", [2, 8, 32]]


def test_the_decision_key_names_every_size_measured() -> None:
    """A dynamic dim's key is its shape bucket at each size measured: a decision measured at the example alone
    (an older tkopt, or an example whose dims are at the top of their range) is not read as one measured at
    both; a static export's key is as before. The key needs the sizes only: the larger inputs are not made
    (with every decision cached they would never run)."""
    graph, norm, inputs = _fused(dynamic=True)
    target = TorchTarget(inputs)
    x = target.node_key(graph, norm)[3][0]
    assert x == ["float32", [[shape_bucket(2), shape_bucket(8)], [shape_bucket(8), shape_bucket(32)], 32]]
    larger = target.sizes(graph.meta["fx_module"])[1]
    assert "flat" not in vars(larger)
    assert [list(t.shape) for t in larger.flat] == [[8, 32, 32], [8, 32, 32]] and larger.flat[0].device.type == "cpu"


def test_tkopt_compile_measures_at_both_sizes_and_reuses_the_decisions(tmp_path, monkeypatch) -> None:
    """tkopt.compile with a dynamic export, every node made to win (no margin): each decision records
    both sizes, and a second compile of the same model measures nothing."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tkopt.pipeline.MARGIN", 0.0)
    torch.manual_seed(0)
    model = LinearAddNorm(32).eval()
    inputs = (torch.randn(2, 8, 32), torch.randn(2, 8, 32))
    fast = tkopt.compile(model, inputs, dynamic=True)
    nodes = fast.tkopt_report.nodes
    assert {d.op for d in nodes} == {"FusedGemm", "FusedAddNorm"}
    assert all(d.decision in ("kept", "declined") and not d.cached for d in nodes), nodes
    entries = [e for e in json.loads((tmp_path / "select-torch-cpu.json").read_text()).values() if "sizes" in e]
    assert len(entries) == 2
    for entry in entries:  # tkopt.compile's export names the first positional argument args_0
        assert [s["label"] for s in entry["sizes"]] == [
            "example inputs (args_0 2x8x32), against eager", "larger inputs (args_0 8x32x32), against eager"]

    def refuse(*args, **kwargs):
        raise AssertionError("measured although every decision was cached")

    monkeypatch.setattr(TorchTarget, "measure", refuse)
    again = tkopt.compile(model, inputs, dynamic=True)
    assert all(d.cached for d in again.tkopt_report.nodes)


class _Positions(nn.Module):
    """Learned positions for 16 tokens (GPT-2's wpe, looked up by arange): torch.export cannot bound the
    sequence by them, so it admits any length, and the model fails beyond 16."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.positions = nn.Embedding(16, hidden)
        self.block = LinearAddNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.positions(torch.arange(x.shape[1], device=x.device))
        return self.block(h, h)


def test_a_size_the_model_cannot_run_at_is_skipped_and_named(monkeypatch, timed_shapes) -> None:
    """The position embedding's indices run past its table at the larger size. The capture refuses the gather
    in Python before it runs: on CUDA its kernel's device-side assert would leave the process no usable GPU
    (GPT-2 past its 1024 positions did, on the H200)."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 32),)
    graph = import_fx(torch.export.export(_Positions(32).eval(), inputs, dynamic_shapes=(AUTO,)))
    run_passes(graph, ())
    norm = next(n for n in graph.nodes if n.op == "FusedAddNorm")
    target = TorchTarget(inputs)
    larger = target.sizes(graph.meta["fx_module"])[1].label
    assert larger == LARGER
    refused = r"the model does not run there \(OutOfRange: aten.embedding.default: indices 0..31 out of range"
    with torch.no_grad(), pytest.warns(UserWarning, match=rf"not measured at {LARGER_RE}: {refused}"):
        [m] = target.measure(graph, [norm], lambda fused, unfused: True)
    assert m.error is None and m.labels == [f"{EXAMPLE}, against eager"]
    assert {shapes[0] for shapes in timed_shapes} == {(2, 8, 32)}


class _Causal(nn.Module):
    """A causal mask sliced from a 16-row buffer, as GPT-2 blocks do: torch.export admits a sequence in [2, 16]
    but guards against 16 itself, a hole its range cannot say."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(16, 16)))
        self.block = LinearAddNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return self.block(self.bias[:t, :t] @ x, x)


def test_a_size_the_export_guards_refuse_shrinks_toward_the_example() -> None:
    """4x batch and sequence would be 8x16 (the sequence at the top of its range), which the guards refuse, as
    they do 6x16 and 4x16; the growth halves until they take one: 3x12."""
    from tkopt.input_sizes import guards_refuse

    inputs = (torch.randn(2, 8, 32),)
    gm = import_fx(torch.export.export(_Causal(32).eval(), inputs, dynamic_shapes=(AUTO,))).meta["fx_module"]
    assert "Guard failed" in guards_refuse(gm, [torch.randn(8, 16, 32)])
    sizes = TorchTarget(inputs).sizes(gm)
    assert [s.label for s in sizes] == [EXAMPLE, "larger inputs (x 3x12x32)"]
    assert guards_refuse(gm, sizes[1].flat) is None


@pytest.mark.gpu
def test_cuda_measures_each_node_against_eager_and_inductor_at_both_sizes(tmp_path, monkeypatch) -> None:
    """tkopt.compile on CUDA, every node made to win (no margin): each is timed against eager, then inductor's
    code, at the example inputs and again at the larger size, as CUDA-graph replays; the program still matches
    eager at a size of its own."""
    from tkopt.models import blocks

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tkopt.pipeline.MARGIN", 0.0)
    torch.manual_seed(0)
    model = blocks.GPT2Block(blocks.GPT2BlockConfig(hidden=256, heads=4, max_seq=128)).eval().cuda().half()
    inputs = tuple(t.cuda().half() if t.is_floating_point() else t.cuda() for t in model.example_inputs(2, 77))
    fast = tkopt.compile(model, inputs, dynamic=True)
    print(fast.tkopt_report)
    entries = [e for e in json.loads((tmp_path / "select-torch-cuda.json").read_text()).values() if "sizes" in e]
    assert entries
    for entry in entries:
        labels = [s["label"] for s in entry["sizes"]]
        where = list(dict.fromkeys(label.rsplit(", against ", 1)[0] for label in labels))
        assert len(where) == 2 and where[1].startswith("larger inputs (args_0 "), entry
        assert labels == [f"{w}, against {a}" for w in where for a in ("eager", "inductor")], entry
    with torch.no_grad():
        x = tuple(t.cuda().half() if t.is_floating_point() else t.cuda() for t in model.example_inputs(3, 100))
        want = model(*x)
        assert ((fast(*x) - want).abs().max() / want.abs().max()).item() < 1e-2


def test_the_accuracy_check_skips_a_size_the_guards_refuse(monkeypatch) -> None:
    """The accuracy check tries the top of each dim's range (sequence 16 here), which the program's guards refuse
    although the range admits it: that size is skipped and named, not run into the guard."""
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    torch.manual_seed(0)
    model = _Causal(32).eval()
    fast = tkopt.compile(model, (torch.randn(2, 8, 32),), select="all", dynamic=True, check_accuracy=True)
    accuracy = fast.tkopt_accuracy
    assert accuracy.ok and {(2, 8), (2, 2), (3, 3)} <= {tuple(r["args[0]"][:2]) for r in accuracy.runs}
    refused = "args[0] [7, 16, 32]: the program's guards refuse it (Guard failed"
    assert any(s.startswith(refused) for s in accuracy.skipped), accuracy.skipped



def test_gathers_refuse_names_the_first_gather_past_its_table() -> None:
    """The check the accuracy sweep runs on CUDA before eager: through the program's graph, every gather's indices
    checked before it runs. Negative indices count where the op takes them (aten.index), nowhere else."""
    gm = torch.export.export(_Positions(32).eval(), (torch.randn(2, 8, 32),), dynamic_shapes=(AUTO,)).module()
    assert gathers_refuse(gm, [torch.randn(2, 8, 32)]) is None
    assert gathers_refuse(gm, [torch.randn(3, 17, 32)]) == (
        "aten.embedding.default: indices 0..16 out of range for dim 0 of size 16")
    aten = torch.ops.aten
    x = torch.randn(4, 3)
    assert index_out_of_range(aten.index.Tensor, (x, [None, torch.tensor([-3, 2])])) is None
    assert index_out_of_range(aten.index.Tensor, (x, [None, torch.tensor([0, 3])])) == (
        "indices 0..3 out of range for dim 1 of size 3")
    assert index_out_of_range(aten.index_select.default, (x, 0, torch.tensor([-1]))) is not None
    assert index_out_of_range(aten.gather.default, (x, 1, torch.tensor([[0, 2]]))) is None
    assert index_out_of_range(aten.index.Tensor, (x, [x > 0])) is None  # a bool mask indexes nothing out of range


@pytest.mark.gpu
def test_the_accuracy_check_on_cuda_skips_a_size_whose_gathers_run_past_their_table() -> None:
    """check_accuracy on CUDA at a sequence past the 16 positions: the size is skipped and named. Run eagerly, its
    embedding's device-side assert would leave this process no usable GPU."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, device="cuda")
    compiled = tkopt.compile(_Positions(32).cuda().eval(), x, dynamic=True, check_accuracy=True)
    accuracy = compiled.tkopt_accuracy
    assert accuracy is not None and accuracy.ok and accuracy.runs
    assert any("does not run there (aten.embedding.default: indices" in s for s in accuracy.skipped)
    assert torch.cuda.is_available() and torch.zeros(1, device="cuda").item() == 0  # the context still works
