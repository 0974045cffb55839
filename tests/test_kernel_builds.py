"""Kernels built in parallel worker interpreters reach this process through TileLang's disk cache, and kernels
built here before start no workers."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from tkopt.frontends.fx import import_fx
from tkopt.ir import Graph
from tkopt.models.blocks import REFERENCE_MODELS
from tkopt.passes.pipeline import run_passes
from tkopt.targets.kernel_builds import input_specs, prebuild, record_built


def _files(path) -> list:
    return [p for p in path.rglob("*") if p.is_file()]


@pytest.mark.slow  # two fresh interpreters import torch and TileLang: 15-20 s on 2 idle cores
def test_workers_build_distinct_kernels_once_into_tilelangs_disk_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "tkopt"))
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))  # the workers inherit it
    model, inputs = REFERENCE_MODELS["mlp"]()
    graph = import_fx(torch.export.export(model, inputs))
    run_passes(graph, ())
    fused = [n for n in graph.nodes if n.is_fused]
    distinct = list({repr((n.op, sorted(n.attrs.items()), input_specs(n))): n for n in fused}.values())[:2]
    assert len(distinct) == 2, [n.op for n in fused]
    cpu, fingerprint = torch.device("cpu"), {"device": "this test"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed worker warns
        prebuild(distinct, cpu, fingerprint, workers=2)
    assert _files(tmp_path / "tilelang"), "the workers built nothing"

    record_built(distinct, cpu, fingerprint)  # as the probes do once they pass
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "again"))
    prebuild(distinct, cpu, fingerprint, workers=2)
    assert not (tmp_path / "again").exists() or not _files(tmp_path / "again"), "workers started for built kernels"


@pytest.mark.parametrize(("beside", "cores", "env", "started"), [
    (True, 16, None, True),  # builds while the caller compiles the unfused program
    (False, 16, None, False),  # alone: a worker would only add its start to the build
    (True, 2, None, False),  # no core to spare
    (True, 16, "1", False),  # TKOPT_BUILD_WORKERS=1: none
])
def test_a_lone_build_goes_to_a_worker_only_beside_the_callers_work(monkeypatch, tmp_path, beside, cores, env,
                                                                     started) -> None:
    """One kernel to build, and the unfused program's first calls running meanwhile (TorchTarget.probe): it builds
    in a worker beside them. It built after them, as it was loaded: the Llama-style model's served size spent
    10.4 s so on the H100 (benchmarks/results/2026-12-07-h100-b)."""
    from tkopt.targets import kernel_builds

    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    if env is None:
        monkeypatch.delenv("TKOPT_BUILD_WORKERS", raising=False)
    else:
        monkeypatch.setenv("TKOPT_BUILD_WORKERS", env)
    calls: list[tuple[int, int]] = []

    def in_workers(fn, jobs, workers, cancel=None):
        calls.append((len(jobs), workers))
        return [None] * len(jobs)

    monkeypatch.setattr(kernel_builds, "map_in_workers", in_workers)
    model, inputs = REFERENCE_MODELS["mlp"]()
    graph = import_fx(torch.export.export(model, inputs))
    run_passes(graph, ())
    node = next(n for n in graph.nodes if n.is_fused)
    jobs = prebuild([node], torch.device("cpu"), {"device": "this test"}, beside=beside)
    assert len(jobs) == 1
    assert calls == ([(1, 2)] if started else [])


def test_probe_shapes_keep_the_example_sizes_relations() -> None:
    """K's and V's lengths under two symbols (an export that never learnt they are one, as torch 2.11's did for
    a transformers decoder's cache) but equal in the example: the probe gives them one size, or the attention
    kernel refuses K and V of different lengths and the fusion is lost ("kernel failed")."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v

    q, k, v = torch.randn(2, 4, 5, 64), torch.randn(2, 4, 9, 64), torch.randn(2, 4, 9, 64)
    auto = {0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO}
    ep = torch.export.export(Attend(), (q, k, v), dynamic_shapes=(auto, auto, auto))
    graph = import_fx(ep)
    run_passes(graph, ())
    (node,) = [n for n in graph.nodes if n.op == "FusedAttention"]
    for v_in, name in zip(node.inputs[1:3], ("k", "v"), strict=True):
        v_in.shape = (*v_in.shape[:2], f"len_{name}", 64)  # what the older export named them
    specs = input_specs(node)
    (_, qs, _), (_, ks, _), (_, vs, _) = specs[:3]
    assert ks == vs and qs[2] < ks[2] and qs[0] == ks[0], specs


def test_an_interrupt_while_the_whole_graph_compiles_does_not_wait_for_the_build_wave(monkeypatch) -> None:
    """TorchTarget.probe compiles the whole graph's alternatives while a thread waits on the build wave (tens of
    seconds of compiles on the H200). Interrupted there (Ctrl-C), it left only when the wave ended; it now stops
    the workers, whether they started before the interrupt or after, and leaves at once."""
    import threading

    from tkopt.kernels import workers
    from tkopt.targets import torch_target

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    spawned = threading.Event()
    real_popen = workers.subprocess.Popen

    def popen(*args, **kwargs):
        spawned.set()
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(workers.subprocess, "Popen", popen)
    # a wave of two workers that would sleep a minute each (time.sleep is a module-level importable function)
    monkeypatch.setattr(torch_target, "prebuild",
                        lambda *args: workers.map_in_workers(time.sleep, [60.0, 60.0], 2, args[-1]))
    target = torch_target.TorchTarget((torch.randn(2),))

    def interrupted() -> None:
        spawned.wait(timeout=30)
        raise KeyboardInterrupt

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        target.probe(Graph("g"), [], interrupted)
    assert time.perf_counter() - t0 < 20
