"""The build wave (tkopt.targets.kernel_builds): per fused node, the kernels its calls at the example shapes use,
tuning candidates included, each planned once; built in workers, they reach this process as disk-cache loads;
probes check them with tuning off. Planned for an H200 (sm90) here: compile keys need no GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.modules import LinearAddNorm, SelfAttention
from tkopt.frontends.fx import import_fx
from tkopt.ir import Graph, Node
from tkopt.kernels import gemm_epilogue, tuning
from tkopt.kernels.arch import Build
from tkopt.kernels.attention import tune_candidates
from tkopt.kernels.config import TileConfig
from tkopt.kernels.gemm_epilogue import _tuning_key, tuning_space
from tkopt.kernels.norm import norm_candidates
from tkopt.kernels.workers import compile_job, map_in_workers
from tkopt.passes.pipeline import run_passes
from tkopt.targets import torch_target
from tkopt.targets.kernel_builds import load, planned_builds, planned_jobs
from tkopt.targets.torch_target import TorchTarget

H200 = Build("sm90", "sm_90", 132)
CPU = torch.device("cpu")


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Empty tuning and kernel caches, tuning on (as a cold compile on the GPU has them), and no shipped winners:
    what a shape that tkopt/kernels/tuned/ does not hold plans (tests/kernels/test_shipped_tuning.py: one that it
    does)."""
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "tkopt"))
    monkeypatch.setenv("TKOPT_SHIPPED_TUNING", "0")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))  # workers inherit it
    monkeypatch.delenv("TKOPT_AUTOTUNE", raising=False)
    tuning.clear_memory_cache()
    yield tmp_path
    tuning.clear_memory_cache()


def _fused(dtype: torch.dtype, batch: int = 2, seq: int = 48, hidden: int = 256) -> tuple[list[Node], tuple, Graph]:
    """SelfAttention's fused nodes, exported with a dynamic sequence at (batch, seq, hidden): GEMMs of
    M = batch * seq rows and attention of head dim 64; the example inputs; the graph. The q, k and v projections
    stay three GEMMs of one signature (gemm_group off): what these tests plan."""
    model = SelfAttention(hidden, hidden // 64).to(dtype).eval()
    x = torch.randn(batch, seq, hidden, dtype=dtype)
    graph = import_fx(torch.export.export(model, (x,), dynamic_shapes=({1: torch.export.Dim.AUTO},)))
    run_passes(graph, ("gemm_group",))
    return [n for n in graph.nodes if n.is_fused], (x,), graph


def _tiles(jobs) -> list[tuple[int, int, int]]:
    return [job.args[0][4].block_tile for job in jobs]  # kernel_for_key(key, gpu): key[4] is the TileConfig


def _candidates(m: int, n: int) -> list[dict]:
    """The fp16 GEMM tuning candidates at m rows and n columns on the H200's 132 SMs."""
    return tuning_space("sm90", m, n, torch.float16, sms=132)[1]


def test_a_gemm_and_an_attention_plan_each_candidate_once(caches) -> None:
    nodes, _, _ = _fused(torch.float16)
    gemm = next(n for n in nodes if n.op == "FusedGemm")
    attention = next(n for n in nodes if n.op == "FusedAttention")

    tiles = _tiles(planned_jobs(gemm, H200))
    # M = 96 tunes: each candidate, and not the default tile 96 rows get on 132 SMs (64x128), which tuning never
    # times (the wave compiled it for the probe alone: one job of five per GEMM signature)
    assert tiles == [c["block_tile"] for c in _candidates(96, 256)]
    assert all(job.args[0][10] is None for job in planned_jobs(gemm, H200)), "M must stay dynamic"

    jobs = planned_jobs(attention, H200)
    assert [dict(job.args[2]) for job in jobs] == tune_candidates("sm90", 64)  # the default is the first one
    assert {job.args[1][5] for job in jobs} == {("bshd",) * 4}, "the layouts the transposed views are read in"

    small, _, _ = _fused(torch.float16, batch=1, seq=40)  # M = 40 <= 64: GEMMs do not tune, attention does
    assert _tiles(planned_jobs(next(n for n in small if n.op == "FusedGemm"), H200)) == [(64, 128, 64)]


def test_a_gemm_of_few_rows_plans_the_candidates_it_tunes_at_the_larger_size(caches) -> None:
    """40 rows at the example do not tune; selection measures a node that wins there again at about 16x the
    elements (TorchTarget.sizes), where 640 rows do: the wave builds those candidates too, or the tuning there
    would start a worker wave of its own and wait on it."""
    model, x = SelfAttention(256, 4).half().eval(), torch.randn(1, 40, 256, dtype=torch.float16)
    graph = import_fx(torch.export.export(model, (x,), dynamic_shapes=({1: torch.export.Dim.AUTO},)))
    run_passes(graph, ())
    gemm = next(n for n in graph.nodes if n.op == "FusedGemm")
    sizes = [size.dims for size in TorchTarget((x,)).sizes(graph.meta["fx_module"])[1:]]
    assert [list(dims.values()) for dims in sizes] == [[640]]
    assert _tiles(planned_jobs(gemm, H200)) == [(64, 128, 64)]
    candidates = [c["block_tile"] for c in _candidates(640, 256)]
    assert _tiles(planned_jobs(gemm, H200, sizes)) == [(64, 128, 64), *candidates]


def test_an_add_norm_plans_its_candidates_once(caches) -> None:
    x = torch.randn(2, 48, 768, dtype=torch.float16)
    dynamic = {1: torch.export.Dim.AUTO}
    graph = import_fx(torch.export.export(LinearAddNorm(768).half(), (x, x), dynamic_shapes=(dynamic, dynamic)))
    run_passes(graph, ())
    norm = next(n for n in graph.nodes if n.op == "FusedAddNorm")
    configs = [dict(job.args[6]) for job in planned_jobs(norm, H200)]  # compile_norm(..., config items)
    assert configs == norm_candidates(768, 2, "sm90") and len(configs) > 1  # the default is the first one


def test_a_cached_winner_is_all_that_is_planned(caches) -> None:
    nodes, _, _ = _fused(torch.float16)
    gemm = next(n for n in nodes if n.op == "FusedGemm")
    attention = next(n for n in nodes if n.op == "FusedAttention")
    cands = _candidates(96, 256)
    key = _tuning_key(96, 256, 256, torch.float16, None, True, False, True, "ieee")  # q's projection: bias, W^T
    tuning.pick_config("gemm", "sm90", key, cands, {"block_tile": (64, 128, 64)},
                       lambda c: 1.0 if c == cands[2] else 2.0)
    (gkey,) = {job.args[1] for job in planned_jobs(attention, H200)}
    attn_cands = tune_candidates("sm90", 64)
    tuning.pick_config("flash_attention", "sm90", gkey + (2, 64, 64), attn_cands, attn_cands[0],
                       lambda c: 1.0 if c == attn_cands[1] else 2.0)
    tuning.clear_memory_cache()  # read back from the files, as a later process does

    assert _tiles(planned_jobs(gemm, H200)) == [cands[2]["block_tile"]]
    assert [dict(job.args[2]) for job in planned_jobs(attention, H200)] == [attn_cands[1]]


def test_nodes_of_one_signature_plan_their_builds_once(caches) -> None:
    nodes, _, _ = _fused(torch.float16)
    projections = [n for n in nodes if n.op == "FusedGemm" and n.inputs[3] is None]
    assert len(projections) == 3  # q, k and v
    builds = planned_builds(nodes, CPU, {"device": "this test"}, build=H200)
    per_node = [job for n in nodes for job in planned_jobs(n, H200)]
    assert len(builds) == len(set(per_node)) == len(per_node) - 2 * len(planned_jobs(projections[0], H200))


def test_the_wave_hands_out_the_longest_compiles_first(caches) -> None:
    """Attention's compiles (~8 s each for sm90) go out before the GEMMs' (~3.6 s) and norms' (~3 s): planned in
    node order, the attention of a model's first layer followed its GEMMs and could start last and run alone."""
    nodes, _, _ = _fused(torch.float16)
    kinds = [job.fn.split(":")[0].rsplit(".", 1)[1] for job in planned_builds(nodes, CPU, {"device": "t"},
                                                                              build=H200).values()]
    assert kinds == sorted(kinds, key=["attention", "gemm_epilogue"].index) and kinds[0] == "attention", kinds


def test_the_workers_import_only_what_the_compiles_need(caches, monkeypatch) -> None:
    """A worker imports the module of the function it runs: the planner's (tkopt's IR, the targets, sympy) cost
    each of the wave's workers about a second of a cold compile (15 of them on the H200)."""
    from tkopt.targets import kernel_builds

    nodes, _, _ = _fused(torch.float16)
    ran = []
    monkeypatch.setattr(kernel_builds, "map_in_workers",
                        lambda fn, jobs, n, cancel: ran.append(fn) or [None] * len(jobs))
    kernel_builds.prebuild(nodes, CPU, {"device": "this test"}, workers=2)
    (fn,) = ran
    heavy = ("tkopt.ir", "tkopt.targets", "sympy")
    check = f"import sys, {fn.__module__}; print([m for m in {heavy} if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True).stdout == "[]\n"


def test_a_default_picked_with_tuning_suspended_is_not_kept(caches, monkeypatch) -> None:
    """A probe's config (tuning off) must not become the config of the calls at real shapes, which tune (here: a
    cached winner stands in for the tuning, so that nothing compiles or runs)."""
    monkeypatch.setattr(gemm_epilogue, "_SELECTED", {})
    monkeypatch.setattr(gemm_epilogue, "_sm_count", lambda arch: H200.sms)  # tunes as on the H200
    cands = _candidates(96, 256)
    args = ("gemm", "sm90", 96, 256, 256, torch.float16, None, True, False, True)

    def run(config):
        raise AssertionError("nothing is timed here")

    with tuning.suspended():  # the probe's pick: the first candidate, which the wave built
        assert gemm_epilogue.select_config(*args, run) == TileConfig(**cands[0])
    key = _tuning_key(96, 256, 256, torch.float16, None, True, False, True, "ieee")
    tuning.pick_config("gemm", "sm90", key, cands, {"block_tile": (128, 256, 64)},
                       lambda c: 1.0 if c == cands[2] else 2.0)
    assert gemm_epilogue.select_config(*args, run).block_tile == cands[2]["block_tile"]


@pytest.mark.slow  # two fresh interpreters import torch and TileLang and lower four sm90 GEMMs: 15-30 s on 2 cores
def test_the_wave_builds_what_tuning_then_only_times(caches, monkeypatch) -> None:
    """The wave's compiles reach this process as disk-cache loads, and the GEMM's tuning at its real shapes then
    starts no worker wave and compiles nothing: it times (here a stand-in times nothing: no GPU)."""
    from tilelang.cache import kernel_cache

    nodes, _, _ = _fused(torch.float16)
    jobs = planned_jobs(next(n for n in nodes if n.op == "FusedGemm"), H200)  # the candidates: M = 96 tunes
    assert map_in_workers(compile_job, jobs, 2) == [None] * len(jobs)

    compiles = []
    phase = kernel_cache.jit_phase
    monkeypatch.setattr(kernel_cache, "jit_phase", lambda name, **kw: compiles.append(name) or phase(name, **kw))
    monkeypatch.setattr(gemm_epilogue, "_CACHE", {})
    monkeypatch.setattr(gemm_epilogue, "_SELECTED", {})
    load(jobs)
    assert compiles == [], "a kernel the wave built was compiled again here"
    assert len(gemm_epilogue._CACHE) == len(jobs), "the loads fill the kernels' own cache, where tuning looks"

    waves = []
    monkeypatch.setattr(gemm_epilogue, "map_in_workers", lambda *args: waves.append(args))
    monkeypatch.setattr(gemm_epilogue, "_sm_count", lambda arch: H200.sms)  # tunes as on the H200 the wave planned
    timed = []

    def run(config) -> float:  # the kernel a timing would launch: compiled_kernel, as gemm's own run reaches it
        timed.append(gemm_epilogue.compiled_kernel("sm90", 256, 256, torch.float16, config, True, True))
        return float(len(timed))

    gemm_epilogue.select_config("gemm", "sm90", 96, 256, 256, torch.float16, None, True, False, True, run)
    assert len(timed) == len(_candidates(96, 256)) and waves == [] and compiles == []


def test_the_probe_checks_the_example_shapes_with_tuning_off(caches, monkeypatch) -> None:
    """Tuning belongs at the real shapes; a probe that tuned timed candidates at a size no call has (each
    attention kernel's three candidates compiled and timed serially here: most of 16.6 s on the H200)."""
    monkeypatch.setenv("TKOPT_BUILD_WORKERS", "1")
    nodes, args, graph = _fused(torch.float32, hidden=64)
    gemm = next(n for n in nodes if n.op == "FusedGemm")
    seen = []
    run = torch_target.run_kernel

    def spy(op, inputs, attrs):
        seen.append((tuning.tuning_suspended(), [tuple(t.shape) for t in inputs if t is not None]))
        return run(op, inputs, attrs)

    monkeypatch.setattr(torch_target, "run_kernel", spy)
    assert TorchTarget(args).probe(graph, [gemm]) == {}
    assert seen == [(True, [(2, 48, 64), (64, 64), (64,)])]


def test_the_probe_declines_a_kernel_that_computes_wrong(caches, monkeypatch) -> None:
    """A probe checks the kernel's outputs against the op's reference on its random inputs: a kernel that runs but
    computes wrong on this device (here one output element off) is declined with the reason, as one that fails."""
    monkeypatch.setenv("TKOPT_BUILD_WORKERS", "1")
    nodes, args, graph = _fused(torch.float32, hidden=64)
    gemm = next(n for n in nodes if n.op == "FusedGemm")
    target = TorchTarget(args)
    run = torch_target.run_kernel

    def off_by_one(op, inputs, attrs):
        outs = run(op, inputs, attrs)
        outs[0].view(-1)[7] += 1.0
        return outs

    monkeypatch.setattr(torch_target, "run_kernel", off_by_one)
    reason = target.probe(graph, [gemm])[gemm.name]
    assert reason.startswith("output Y differs from the op's reference on random inputs: max relative error")
    monkeypatch.setattr(torch_target, "run_kernel", run)
    assert target.probe(graph, [gemm]) == {}  # a failed probe is not remembered as passed: it ran again


def test_the_probe_leaves_out_what_rounds_to_inf_apart() -> None:
    """Unit-scale random inputs put a large gated GEMM's float16 products near 65504, where kernel and reference
    may round to inf apart: those elements are left out; an error anywhere else still counts."""
    want = torch.tensor([1.0, 2.0, float("inf"), 40000.0], dtype=torch.float16)
    got = torch.tensor([1.0, 2.0, 65504.0, float("inf")], dtype=torch.float16)
    assert torch_target.probe_error("Y", got, want).ok
    assert not torch_target.probe_error("Y", got + torch.tensor([0, 1.0, 0, 0], dtype=torch.float16), want).ok


@pytest.mark.gpu
def test_a_cold_compile_builds_in_one_wave_and_tunes_only_at_real_shapes(caches, monkeypatch) -> None:
    """Cold caches, tuning on, more than one worker: the only worker wave is the build's. Selection's tuning at
    the real shapes times candidates the wave built (it used to start a wave per GEMM key and wait), and the
    probes tune nothing (they used to tune every attention kernel at a size no call has)."""
    import tkopt
    from tkopt.kernels import attention, workers
    from tkopt.targets import kernel_builds

    monkeypatch.setenv("TKOPT_BUILD_WORKERS", "4")  # gpu_session.sh runs tests with 1
    monkeypatch.setenv("TKOPT_AUTOTUNE", "1")
    monkeypatch.setattr(gemm_epilogue, "_SELECTED", {})  # no winners other tests in this process picked
    monkeypatch.setattr(attention, "_CONFIG_MEMO", {})
    waves: list[str] = []
    for module in (kernel_builds, gemm_epilogue):
        monkeypatch.setattr(module, "map_in_workers", lambda fn, jobs, n, cancel=None, m=module.__name__:
                            waves.append(m) or workers.map_in_workers(fn, jobs, n, cancel))
    tuned: list[bool] = []  # per tuning run: whether a probe ran it
    in_probe = [False]
    progress, probe = tuning._progress, TorchTarget._probe
    monkeypatch.setattr(tuning, "_progress", lambda n, desc: tuned.append(in_probe[0]) or progress(n, desc))

    def probing(self, node, at=None):
        in_probe[0] = True
        try:
            return probe(self, node, at)
        finally:
            in_probe[0] = False

    monkeypatch.setattr(TorchTarget, "_probe", probing)
    torch.manual_seed(0)
    model = SelfAttention(384, 6).half().cuda().eval()
    x = torch.randn(2, 80, 384, dtype=torch.float16, device="cuda")  # GEMMs of 160 rows: they tune
    compiled = tkopt.compile(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=2e-2, rtol=2e-2)
    seconds = tkopt.last_report().seconds
    print({k: round(v, 2) for k, v in seconds.items()})
    assert waves == [kernel_builds.__name__], waves
    assert tuned and not any(tuned), f"tuning runs: {len(tuned)}, in probes: {sum(tuned)}"
    assert "kernels: probes" in seconds
