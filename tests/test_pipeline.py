"""The one pipeline: measured selection on the CPU against what the target would otherwise run (ORT's own
kernels, eager ATen), its decisions cached and reused, and the one report every entry point returns."""

from __future__ import annotations

import contextlib
import json
import math
import time

import onnx
import pytest
import torch

import tkopt
from tkopt.ir import Node
from tkopt.measure import Timing
from tkopt.models.blocks import REFERENCE_MODELS
from tkopt.models.export import export_onnx
from tkopt.pipeline import MARGIN, UNFUSED, _apply, _entry, _wins, loop_times, resolve_select
from tkopt.report import NodeDecision, WholeGraph
from tkopt.targets import Measured
from tkopt.targets.ort_target import OrtTarget
from tkopt.targets.torch_target import TorchTarget


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh decision cache for the test; ORT's headers, lowered kernels and compiled objects stay shared
    (fetching and compiling them again would only cost time)."""
    from tkopt.cache import cache_path
    from tkopt.ort.headers import HeadersError, include_dir

    with contextlib.suppress(HeadersError):  # the ORT tests need them; the torch ones run without (the GPU box)
        include_dir()
    (tmp_path / "cache").mkdir()
    for shared in ("ort-kernels", "ort-include"):
        cache_path(shared).mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / shared).symlink_to(cache_path(shared))
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _refuse_to_measure(monkeypatch, target_class) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("measured although every decision was cached")

    monkeypatch.setattr(target_class, "measure", refuse)
    monkeypatch.setattr(target_class, "compare_whole", refuse)


def _check_measured(report, alternatives: set[str]) -> None:
    assert report.select == "measured" and report.nodes
    w = report.whole_graph
    assert w is not None and not w.cached
    # On CUDA tkopt's program (CUDA graphs) is raced even with no fusion kept, and with fusions kept, so is the
    # same program with every fusion put back.
    fused = any(d.decision == "kept" or d.reason.startswith("the whole graph ran faster") for d in report.nodes)
    if report.target == "torch-cuda":
        assert set(w.times_ms) == {"tkopt", *alternatives} | ({UNFUSED} if fused else set())
    elif fused:
        assert set(w.times_ms) == {"tkopt", *alternatives}
    elif len(alternatives) == 1:  # nothing fused: the one alternative runs, untimed
        assert w.times_ms == {} and w.winner in alternatives and w.note.startswith("no fusion kept"), w
    else:  # nothing fused: the best of the alternatives runs
        assert set(w.times_ms) == alternatives and w.winner in alternatives
    for d in report.nodes:
        assert not d.cached and d.fused_ms > 0 and d.unfused_ms > 0, d
        won = d.unfused_ms >= MARGIN * d.fused_ms
        if d.decision == "declined":  # it won alone, but the whole graph ran faster as the alternative
            assert won and w.winner != "tkopt" and d.reason == f"the whole graph ran faster as {w.winner}", d
        else:
            assert d.decision in ("kept", "slower") and (d.decision == "kept") == won, d
    # what the decision compares: a tiny model's CUDA-graph programs are host-bound too, and their CPU times count
    loop = loop_times(w.times_ms, w.host_ms)
    assert w.winner == "tkopt" or "tkopt" not in loop or loop[w.winner] < loop["tkopt"] * 1.02


def _measured_nothing(w) -> bool:
    """The whole-graph decision was read from the cache, or needed no timing (nothing fused, one alternative)."""
    return w.cached or (not w.times_ms and w.note.startswith("no fusion kept"))


def test_ort_cpu_measures_against_ort_and_reuses_the_decisions(cache_dir, tmp_path, monkeypatch) -> None:
    """Each fused node is timed on the CPU op library against ORT running what it replaced; the second
    optimization of the same model reads every decision from the cache and measures nothing."""
    model, inputs = REFERENCE_MODELS["mlp"]()
    path = export_onnx(model, inputs, tmp_path / "mlp.onnx", dynamo=False)
    _, first = tkopt.optimize_onnx(path, tmp_path / "a.onnx", report=False, target="cpu", check_accuracy=True)
    assert first.target == "ort-cpu" and first.accuracy.ok
    _check_measured(first, {"ort"})
    saved = onnx.load(str(tmp_path / "a.onnx"))
    if first.whole_graph.winner == "ort":  # the user's model, unchanged, is what was faster
        assert not any(n.domain == "tkopt" for n in saved.graph.node) and first.total_fused == 0
        assert first.library is None
    else:
        assert sum(n.domain == "tkopt" for n in saved.graph.node) == first.total_fused
    assert json.loads((cache_dir / "select-ort-cpu.json").read_text())

    _refuse_to_measure(monkeypatch, OrtTarget)
    _, second = tkopt.optimize_onnx(path, tmp_path / "b.onnx", report=False, target="cpu")
    assert all(d.cached for d in second.nodes) and _measured_nothing(second.whole_graph)
    assert [(d.node, d.decision, d.fused_ms) for d in second.nodes] == [
        (d.node, d.decision, d.fused_ms) for d in first.nodes]
    assert second.whole_graph.winner == first.whole_graph.winner


def test_torch_cpu_measures_against_eager_and_reuses_the_decisions(cache_dir, monkeypatch) -> None:
    """tkopt.compile on the CPU: fused nodes timed on TileLang's CPU kernels against the replaced ATen ops,
    the module against eager; a second compile measures nothing, and either way the result matches eager."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS["mlp"]()
    fast = tkopt.compile(model, inputs)
    report = fast.tkopt_report
    assert report.target == "torch-cpu"
    _check_measured(report, {"eager"})
    # where the stages' time went inside the target, for compile-time work
    assert {"kernels: parallel builds", "kernels: probes", "selection: fused ops' first calls (tuning at real "
            "shapes)"} <= set(report.seconds), report.seconds
    spec = fast.specializations[-1]
    assert spec.graphed == (report.whole_graph.winner == "tkopt")
    assert report.whole_graph.winner == "tkopt" or spec.run is fast.plain is model  # eager: the module itself runs

    _refuse_to_measure(monkeypatch, TorchTarget)
    probed: list[str] = []
    probe = TorchTarget.probe
    monkeypatch.setattr(TorchTarget, "probe", lambda self, graph, nodes, *rest: probed.extend(n.name for n in nodes)
                        or probe(self, graph, nodes, *rest))
    again = tkopt.compile(model, inputs)
    assert all(d.cached for d in again.tkopt_report.nodes) and _measured_nothing(again.tkopt_report.whole_graph)
    # kernels are built again only for the nodes the cache keeps
    assert sorted(probed) == sorted(d.node for d in again.tkopt_report.nodes if d.decision != "slower")
    with torch.no_grad():
        for f in (fast, again):
            torch.testing.assert_close(f(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_a_kernel_probed_on_this_machine_is_not_probed_again(cache_dir, monkeypatch) -> None:
    """A probe that passed is remembered with what it checked (the kernel's compiles, its inputs' layouts, the
    device, the versions): a warm compile runs none, and edited kernel sources probe again."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS["mlp"]()
    probed: list[str] = []
    probe = TorchTarget._probe
    monkeypatch.setattr(TorchTarget, "_probe", lambda self, n, at=None: probed.append(n.name) or probe(self, n, at))
    first = tkopt.compile(model, inputs, select="all").tkopt_report
    assert first.total_fused and probed
    probed.clear()
    again = tkopt.compile(model, inputs, select="all").tkopt_report
    assert probed == [] and again.total_fused == first.total_fused
    monkeypatch.setattr("tkopt.targets.kernel_builds.versions", lambda: {"sources": "edited"})
    tkopt.compile(model, inputs, select="all")
    assert probed


def test_a_tuned_kernel_is_probed_before_it_is_kept(cache_dir, monkeypatch) -> None:
    """Selection's first calls tune a kept node's kernel at its real shapes, after the probe checked a
    candidate: the winner is checked too, and one that computes wrong runs unfused, with a warning."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setattr("tkopt.pipeline._wins", lambda fused, unfused: True)
    keys = iter(range(1000))  # every planned kernel another: as a tuning winner is after the probe
    monkeypatch.setattr("tkopt.targets.torch_target.probe_record", lambda *a: f"probe:{next(keys)}")
    tuned = []
    probe, check_kept = TorchTarget._probe, TorchTarget.check_kept
    monkeypatch.setattr(TorchTarget, "check_kept", lambda self, *a: tuned.append(True) or check_kept(self, *a))
    monkeypatch.setattr(TorchTarget, "_probe", lambda self, n, at=None: "wrong" if tuned else probe(self, n, at))
    model, inputs = REFERENCE_MODELS["mlp"]()
    with pytest.warns(UserWarning, match="its kernel failed: its tuned kernel: wrong"):
        compiled = tkopt.compile(model, inputs)
    report = compiled.tkopt_report
    assert report.nodes and all(d.decision == "kernel_failed" and d.reason == "its tuned kernel: wrong"
                                for d in report.nodes), report.nodes
    assert report.total_fused == 0
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_kept_kernels_are_probed_at_every_size_selection_measured(cache_dir, monkeypatch) -> None:
    """A dynamic graph is measured at a larger size too, where a node's kernel may be another (a GEMM's tile for
    more rows, another bucket's tuning winner): that kernel is probed there before the node is kept, and one
    that computes wrong there is declined, naming the size."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setattr("tkopt.pipeline._wins", lambda fused, unfused: True)
    larger: list[str] = []
    probe = TorchTarget._probe

    def probing(self, n, at=None):
        if at:
            larger.append(n.name)
            return "wrong"
        return probe(self, n, at)

    monkeypatch.setattr(TorchTarget, "_probe", probing)
    model, inputs = REFERENCE_MODELS["mlp"]()
    with pytest.warns(UserWarning, match=r"its kernel failed: its tuned kernel at .+: wrong"):
        compiled = tkopt.compile(model, inputs, dynamic=True)
    report = compiled.tkopt_report
    assert larger and report.nodes and report.total_fused == 0
    assert all(d.decision == "kernel_failed" and d.reason.startswith("its tuned kernel at ") for d in report.nodes)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_a_decision_measured_by_other_selection_code_is_measured_again(cache_dir, monkeypatch) -> None:
    """Decisions are kept for the code that measured them: the same kernels timed another way (a baseline run
    without the mask a pass left out, say) must not reuse what the old code decided."""
    from tkopt import decisions

    decisions.DecisionCache("test", {"device": "x"}).put(["node"], {"decision": "kept"})
    assert decisions.DecisionCache("test", {"device": "x"}).get(["node"]) == {"decision": "kept"}
    monkeypatch.setattr(decisions, "selection_sources", lambda: "edited")
    assert decisions.DecisionCache("test", {"device": "x"}).get(["node"]) is None


class _NoFusion(torch.nn.Module):
    """Nothing to fuse: the whole-graph comparison alone decides what calls run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + 1


@pytest.mark.parametrize(("select", "winner"), [("measured", "eager"), ("all", None)])
def test_torch_cpu_calls_run_exactly_the_whole_graph_winner(cache_dir, monkeypatch, select, winner) -> None:
    """Where the user's module wins (here: nothing was fused, so it wins untimed), every call goes straight to it,
    at its own cost (no boxing, no exported program around it), new shapes included; where tkopt's program
    runs (select="all": no comparison), calls never reach the module."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model = _NoFusion()
    seen: list[torch.Tensor] = []
    model.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    fast = tkopt.compile(model, torch.randn(2, 8), select=select)
    whole = fast.tkopt_report.whole_graph
    assert (whole and whole.winner) == winner
    xs = [torch.randn(shape) for shape in [(2, 8), (1, 8), (5, 3)]]  # (1, 8): a new export where tkopt runs
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(fast(x), model(x))
        seen.clear()
        for x in xs:
            fast(x)
    if winner == "eager":
        assert whole.times_ms == {} and whole.note == "no fusion kept, so the model runs as it was"
        assert fast.plain is model and fast.uncaptured_reason == "the plain alternative runs (eager)"
        assert len(seen) == 3 and all(a is x for a, x in zip(seen, xs, strict=True))
    else:
        assert fast.plain is None and not seen


class _Graphed(TorchTarget):
    """A torch target whose program differs from the plain alternatives even unfused, as on CUDA."""

    def races_unfused(self) -> bool:
        return True


def test_the_unfused_program_is_raced_and_runs_where_the_fusions_lose_together(cache_dir, monkeypatch,
                                                                               one_thread) -> None:
    """Nodes that each won alone can lose together: where the target's own program differs from the plain
    alternatives (on CUDA: inductor and CUDA graphs), that program with every fusion put back is raced too, and
    where it wins, it runs: tkopt's program, unfused, and the decision is cached like the others. Here every
    node is made to win (no margin) and TileLang's serial CPU kernels lose as a whole; the plain alternative
    is made slower than both."""
    from tkopt.frontends.fx import import_fx
    from tkopt.pipeline import optimize

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setattr("tkopt.pipeline.MARGIN", 0.0)
    model, inputs = REFERENCE_MODELS["gpt2_block"]()  # its attention's fallback reads a causal mask

    def slow(*args: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return model(*args)

    def run() -> tuple:
        target = _Graphed(inputs, alternatives={"slow": lambda: slow})
        return optimize(import_fx(torch.export.export(model, inputs)), target, select="measured"), target

    readied = []
    real_prepare = _Graphed.prepare_whole
    monkeypatch.setattr(_Graphed, "prepare_whole",
                        lambda self, programs, likely: readied.append(1) or real_prepare(self, programs, likely))
    result, target = run()
    w = result.report.whole_graph
    assert set(w.times_ms) == {"tkopt", UNFUSED, "slow"} and w.winner == UNFUSED, w
    assert w.times_ms[UNFUSED] * 1.02 <= w.times_ms["tkopt"]
    assert result.winner == "tkopt" and result.artifact is result.emitted
    assert not any(n.is_fused for n in result.graph.nodes)
    # every value a node reads is produced, or is an input, weight or constant (sealing never dropped it)
    produced = {id(o) for n in result.graph.nodes for o in n.outputs}
    assert all(v is None or v.const is not None or id(v) in produced or v.origin.op in ("placeholder", "get_attr")
               for n in result.graph.nodes for v in n.inputs)
    assert not any(str(n.target).startswith("tkopt.") for n in result.emitted.graph.nodes)
    reason = f"the whole graph ran faster as {UNFUSED}"
    assert result.report.nodes and all(d.decision == "declined" and d.reason == reason for d in result.report.nodes)
    with torch.no_grad():
        torch.testing.assert_close(target.runner(result.emitted)(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)

    _refuse_to_measure(monkeypatch, TorchTarget)
    again, _ = run()
    assert again.report.whole_graph.cached and again.report.whole_graph.winner == UNFUSED
    # every decision cached (all kept): the kept nodes' kernels load, and nothing is compiled beside them for a race
    # that will not run
    assert readied == [1]
    assert not any(n.is_fused for n in again.graph.nodes)


def test_the_programs_that_need_no_kernel_are_readied_while_kernels_build(cache_dir, monkeypatch, one_thread) -> None:
    """tkopt's unfused program and the plain alternatives need no kernel, so their first calls (on CUDA:
    inductor's compiles, CUDA-graph captures) run while the kernels build, not after selection. With no
    fusion kept, the program raced and returned is that unfused program, with no first call of its own."""
    import threading

    from tkopt.frontends.fx import import_fx
    from tkopt.pipeline import optimize
    from tkopt.targets import torch_target

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS["gpt2_block"]()
    readied, overlapped, prepared = threading.Event(), [], []
    real_prebuild, real_prepare = torch_target.prebuild, _Graphed.prepare_whole

    def prebuild(*args, **kwargs) -> list:
        built = real_prebuild(*args, **kwargs)
        overlapped.append(readied.wait(timeout=60))  # returns at once where the programs were readied meanwhile
        return built

    def prepare_whole(self, programs, likely) -> None:
        prepared.extend(programs)
        real_prepare(self, programs, likely)
        readied.set()

    monkeypatch.setattr(torch_target, "prebuild", prebuild)
    monkeypatch.setattr(_Graphed, "prepare_whole", prepare_whole)
    target = _Graphed(inputs, alternatives={"eager": lambda: model})
    result = optimize(import_fx(torch.export.export(model, inputs)), target, select="measured")
    assert overlapped == [True]
    assert not any(d.decision == "kept" for d in result.report.nodes)  # TileLang's serial CPU kernels lose
    assert prepared == [result.emitted] and result.report.whole_graph.winner in ("tkopt", "eager")
    seconds = result.report.seconds
    assert "whole graph: first calls, while kernels build" in seconds and "whole graph: first calls" not in seconds
    with torch.no_grad():
        torch.testing.assert_close(target.runner(result.emitted)(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_inductor_compiles_both_raced_programs_in_children(cache_dir, monkeypatch, tmp_path) -> None:
    """Where the target's program is inductor's (as on CUDA), the unfused program and the fused one as it will be if
    selection keeps every node compile in child processes while kernels build; selection keeps them all here (no
    margin), so the program emitted after it is that very one, takes the child's compile over, and both first calls
    find the children's code in inductor's cache. Real children, real inductor and TileLang's kernels on CPU."""
    from tkopt.backends.inductor import InductorOrEager
    from tkopt.frontends.fx import import_fx
    from tkopt.pipeline import optimize

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr("tkopt.pipeline.MARGIN", 0.0)
    model, inputs = REFERENCE_MODELS["mlp"]()
    target = _Graphed(inputs, wrap=InductorOrEager, inductor=True, alternatives={"eager": lambda: model})
    result = optimize(import_fx(torch.export.export(model, inputs)), target, select="measured")
    # selection kept every node (the race may then have declined them all: TileLang's serial CPU kernels)
    assert all(d.decision == "kept" or d.reason.startswith("the whole graph ran faster") for d in result.report.nodes)
    seconds = result.report.seconds
    for name in ("tkopt", UNFUSED):
        assert f"whole graph: the compile here, which found the child's code ({name})" in seconds
    with torch.no_grad():
        torch.testing.assert_close(target.runner(result.emitted)(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)


def _timing(ms: float, host_ms: float = math.nan) -> Timing:
    return Timing(ms, ms, ms, 3, 1, "cuda_events", ms, host_ms)


def test_a_fusion_is_kept_only_by_a_clear_margin_at_every_size() -> None:
    node = Node("FusedGemm", [], [], name="n")
    d = NodeDecision("n", "FusedGemm", "gemm", 1)
    near = Measured(node, [(_timing(1.0), _timing(1.05))], ["batch 1, seq 128"])
    _apply(d, _entry(near), cached=False)
    assert d.decision == "slower" and d.reason == f"under {MARGIN:.2f}x at batch 1, seq 128"
    assert (d.fused_ms, d.unfused_ms) == (1.0, 1.05)
    both = Measured(node, [(_timing(1.0), _timing(1.5)), (_timing(2.0), _timing(2.1))], ["small", "large"])
    _apply(d, _entry(both), cached=True)
    assert d.decision == "slower" and d.reason.endswith("at large") and d.cached
    won = Measured(node, [(_timing(1.0), _timing(1.5)), (_timing(2.0), _timing(2.5))], ["small", "large"])
    _apply(d, _entry(won), cached=False)
    assert d.decision == "kept" and d.reason == "" and d.speedup == pytest.approx(1.25)
    failed = Measured(node, error="RuntimeError: boom")
    _apply(d, _entry(failed), cached=False)
    assert d.decision == "kernel_failed" and "boom" in d.reason
    assert _wins(_timing(1.0), _timing(MARGIN)) and not _wins(_timing(1.0), _timing(MARGIN * 0.99))


class _Timed:
    """A target's whole-graph surface with given race times, for the winner's rule alone."""

    def __init__(self, times: dict[str, float], hosts: dict[str, float] | None = None) -> None:
        self.times, self.hosts = times, hosts or {}

    def alternatives(self) -> list[str]:
        return [k for k in self.times if k not in ("tkopt", UNFUSED)]

    def whole_key(self, graph, programs) -> list:
        return sorted(self.times.items())

    def compare_whole(self, graph, programs) -> dict[str, Timing]:
        return {k: _timing(ms, self.hosts.get(k, math.nan)) for k, ms in self.times.items()}


@pytest.mark.parametrize(("fused", "times", "winner"), [
    (True, {"tkopt": 1.0, "inductor": 1.01}, "inductor"),  # a fused program must win by the margin
    (True, {"tkopt": 1.0, "inductor": 1.03}, "tkopt"),
    (True, {"tkopt": 1.0, UNFUSED: 1.01, "inductor": 1.01}, UNFUSED),  # the unfused one ties both
    (True, {"tkopt": 1.0, UNFUSED: 1.01, "inductor": 0.98}, "inductor"),
    (False, {"tkopt": 1.01, "inductor": 1.0}, "tkopt"),  # no fusion: a tie is tkopt's
    (False, {"tkopt": 1.03, "inductor": 1.0}, "inductor"),
])
def test_whole_graph_ties_go_to_the_plain_model_only_against_fusions(cache_dir, fused, times, winner) -> None:
    """A fused program must beat the best alternative by WHOLE_MARGIN; a program with no fusion (on CUDA:
    inductor's code under CUDA graphs, timed exactly, where a race flatters uncaptured alternatives) need only
    come within it."""
    from tkopt.decisions import DecisionCache
    from tkopt.ir import FUSED_DOMAIN, Graph
    from tkopt.pipeline import _whole

    graph = Graph("g")
    graph.nodes = [Node("FusedGemm", [], [], name="n", domain=FUSED_DOMAIN) if fused else Node("MatMul", [], [])]
    programs = {k: object() for k in times if k in ("tkopt", UNFUSED)}
    w = _whole(graph, _Timed(times), programs, DecisionCache("test", {}))
    assert w.winner == winner and w.times_ms == times


@pytest.mark.parametrize(("hosts", "winner"), [
    ({"tkopt": 0.02, "eager": 0.22}, "tkopt"),  # eager issues its calls at the GPU's pace: the CPU decides
    ({"tkopt": 0.02, "eager": 0.12}, "eager"),  # eager's CPU keeps well ahead: its timed call stands
    ({}, "eager"),  # no CPU times (a CPU race): the timed calls alone
])
def test_whole_graph_weighs_an_alternatives_cpu_time_where_it_sets_the_pace(cache_dir, hosts, winner) -> None:
    """An alternative 5% faster in the race loses to tkopt's CUDA-graph program when its CPU time per call is
    near its call time (the encoder layer on the H200: Dynamo's graph raced at 0.231 ms, tkopt's program at
    0.242, and Dynamo's graph then ran at 0.25-0.60 ms in a loop)."""
    from tkopt.decisions import DecisionCache
    from tkopt.ir import FUSED_DOMAIN, Graph
    from tkopt.pipeline import _whole

    graph = Graph("g")
    graph.nodes = [Node("FusedGemm", [], [], name="n", domain=FUSED_DOMAIN)]
    times = {"tkopt": 0.242, "eager": 0.231}
    target, cache = _Timed(times, hosts), DecisionCache("test", {})
    w = _whole(graph, target, {"tkopt": object()}, cache)
    assert w.winner == winner and w.host_ms == hosts, w
    target.compare_whole = None  # the second decision reads the cache, CPU times too
    assert _whole(graph, target, {"tkopt": object()}, cache) == WholeGraph(winner, times, hosts, cached=True)


def test_select_needs_something_to_measure_on(tmp_path) -> None:
    model = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []))
    target = OrtTarget(None, model, tmp_path)
    assert resolve_select(None, target) == "all"
    with pytest.raises(ValueError, match="select='measured' needs a device to measure on .*torch references"):
        resolve_select("measured", target)
    with pytest.raises(ValueError, match="select must be one of measured, all"):
        resolve_select("fastest", target)


def test_report_table_json_and_last_report(monkeypatch) -> None:
    """print(report) is the CLI's table (not a dataclass repr), to_dict() is JSON, and a torch.compile
    backend user finds the report through tkopt.last_report()."""
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    model, inputs = REFERENCE_MODELS["gpt2_block_sdpa"]()
    torch._dynamo.reset()
    fast = torch.compile(model, backend="tkopt")
    with torch.no_grad():
        fast(*inputs)
    report = tkopt.last_report()
    assert report is not None and report.target == "torch-cpu" and report.select == "all"
    assert report.total_fused == len(report.nodes) > 0
    text = str(report)
    assert text.startswith("tkopt ") and "Report(" not in text and "fusions" in text and "fused nodes" in text
    assert f"fused: {report.total_fused} of {len(report.nodes)} candidates" in text
    d = json.loads(report.to_json())
    assert d["total_fused"] == report.total_fused and d["candidates"] == report.passes.fusions
    assert [n["decision"] for n in d["nodes"]] == ["kept"] * len(report.nodes)
    compiled = tkopt.compile(model, inputs)
    assert tkopt.last_report() is compiled.tkopt_report


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.cuda().half() if t.is_floating_point() else t.cuda()


@pytest.mark.gpu
def test_cuda_measures_against_inductor_and_cuda_graphs(cache_dir, monkeypatch) -> None:
    """tkopt.compile on CUDA: each fused node against inductor's code for what it replaces, both replayed as
    CUDA graphs; the module against eager and inductor with CUDA graphs; the winner runs and matches eager."""
    from tkopt.models import blocks

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    torch.manual_seed(0)
    model = blocks.GPT2Block(blocks.GPT2BlockConfig(hidden=256, heads=4, max_seq=128)).eval().cuda().half()
    inputs = tuple(_cuda(t) for t in model.example_inputs(batch=2, seq=77))
    fast = tkopt.compile(model, inputs, dynamic=True)
    report = fast.tkopt_report
    assert report.target == "torch-cuda"
    _check_measured(report, {"eager"})
    # an alternative that won is what runs; tkopt's program, fused or with its fusions put back, runs as its own
    assert (fast.plain is None) == (report.whole_graph.winner in ("tkopt", UNFUSED))
    print(report)
    # Per size (the example inputs, then a larger one: the export is dynamic), inductor compiled a node's
    # subgraph only where the fused op had beaten eager, and each timing but the last was a win.
    nodes = [e for e in json.loads((cache_dir / "select-torch-cuda.json").read_text()).values() if "sizes" in e]
    assert nodes
    for entry in nodes:
        labels = [s["label"] for s in entry["sizes"]]
        where = list(dict.fromkeys(label.rsplit(", against ", 1)[0] for label in labels))
        assert where[0].startswith("example inputs (") and all(w.startswith("larger inputs (") for w in where[1:])
        assert labels == [f"{w}, against {a}" for w in where for a in ("eager", "inductor")][:len(labels)], entry
        assert all(s["unfused_ms"] >= MARGIN * s["fused_ms"] for s in entry["sizes"][:-1]), entry
    with torch.no_grad():
        want = model(*inputs)
        assert ((fast(*inputs) - want).abs().max() / want.abs().max()).item() < 1e-2
    _refuse_to_measure(monkeypatch, TorchTarget)
    again = tkopt.compile(model, inputs, dynamic=True)
    assert all(d.cached for d in again.tkopt_report.nodes) and _measured_nothing(again.tkopt_report.whole_graph)


@pytest.mark.gpu
def test_cuda_races_both_programs_as_their_own_graphs(cache_dir, monkeypatch) -> None:
    """tkopt.compile on CUDA with every node kept (no margin): the race times tkopt's fused and unfused programs,
    each replayed as its own CUDA graphs (keyed by one specialization alone, the second would have replayed the
    first's), and only the winner's graphs stay."""
    from tkopt.models import blocks

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setattr("tkopt.pipeline.MARGIN", 0.0)
    torch.manual_seed(0)
    model = blocks.GPT2Block(blocks.GPT2BlockConfig(hidden=256, heads=4, max_seq=128)).eval().cuda().half()
    inputs = tuple(_cuda(t) for t in model.example_inputs(batch=2, seq=77))
    fast = tkopt.compile(model, inputs)
    w = fast.tkopt_report.whole_graph
    print(fast.tkopt_report)
    # torch.compile(module) is not raced: the unfused program is inductor's code under CUDA graphs already
    assert set(w.times_ms) == {"tkopt", UNFUSED, "eager"}, w
    # the unfused program and the alternatives were compiled and captured while the kernels built
    parts = {"whole graph: first calls, while kernels build", "whole graph: first calls",
             "whole graph: first calls, while kernels build: tkopt's programs",
             "whole graph: first calls, while kernels build: eager", "kernels: the build wave itself"}
    assert parts <= set(fast.tkopt_report.seconds)
    spec = fast.specializations[-1]
    assert all(key[1] is spec.run for key in fast.graphs.graphs) if spec.graphed else not fast.graphs.graphs
    with torch.no_grad():
        want = model(*inputs)
        assert ((fast(*inputs) - want).abs().max() / want.abs().max()).item() < 1e-2


@pytest.mark.gpu
def test_cuda_backend_measures_and_reports(cache_dir, monkeypatch) -> None:
    """torch.compile(backend="tkopt") on CUDA measures too, on stand-ins for Dynamo's fake inputs."""
    from tkopt.models import blocks

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    torch.manual_seed(0)
    model = blocks.LlamaBlock(blocks.LlamaBlockConfig(hidden=256, heads=4, kv_heads=2, ffn=512)).eval().cuda().half()
    inputs = tuple(_cuda(t) for t in model.example_inputs(batch=2, seq=77))
    torch._dynamo.reset()
    fast = torch.compile(model, backend="tkopt")
    with torch.no_grad():
        got = fast(*inputs)
        want = model(*inputs)
    report = tkopt.last_report()
    assert report.target == "torch-cuda"
    _check_measured(report, {"eager", "inductor"})  # in inference inductor runs the rest, as in tkopt.compile
    print(report)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


def test_backend_races_dynamos_own_graph_and_optimizes_once(cache_dir, monkeypatch) -> None:
    """The backend's whole-graph alternative is Dynamo's graph as torch runs it (here torch's fused encoder
    fast path), and the winner is what runs. The layer's norm eps, a float Dynamo specializes by a guard, is
    specialized before tkopt works: it made AOTAutograd restart Dynamo, which optimized the graph twice."""
    from tkopt.backends import dynamo

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    calls = []
    real = dynamo.optimize_graph_module
    monkeypatch.setattr(dynamo, "optimize_graph_module", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    torch._dynamo.reset()
    backend = dynamo.make_backend()
    fast = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        got, want = fast(x), model(x)
    assert len(calls) == 1
    _check_measured(backend.graph_modules[-1].tkopt_report, {"eager"})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fallbacks_input_made_after_its_fused_node_survives_and_unfuses_in_order() -> None:
    """Node order follows the fused node's own inputs, so the producer of what only its fallback reads (a
    causal mask's Slice in the TorchScript GPT-2 export) can come after it. It must stay until sealing, and
    unfusing must put it first: a one-pass backward sweep dropped it, and the ONNX export then failed the
    checker ("input '/Slice_1_output_0' of node /Where is not output of any previous nodes")."""
    from tkopt.ir import FUSED_DOMAIN, Graph, Value
    from tkopt.passes.base import unfuse
    from tkopt.passes.finalize import remove_unused, seal

    def build() -> tuple[Graph, Node, Node]:
        x, s, y = Value("x", "float32", (2, 3)), Value("s", "float32", (2, 3)), Value("y", "float32", (2, 3))
        mask = Node("Relu", [x], [s], name="mask")
        fused = Node("FusedThing", [x], [y], name="fused", domain=FUSED_DOMAIN,
                     replaced=[Node("Add", [x, s], [y], name="add")])
        g = Graph("g")
        g.inputs, g.outputs, g.nodes = [x], [y], [fused, mask]
        return g, fused, mask

    g, fused, mask = build()
    assert remove_unused(g) == 0 and g.nodes == [fused, mask]
    unfuse(g, [fused])
    assert [n.name for n in g.nodes] == ["mask", "add"]
    g, fused, mask = build()
    assert seal(g) == 1 and g.nodes == [fused]  # kernels settled: the fallback's input goes
