"""The native ORT op library: built from real TileLang kernels, loaded by a real ORT session."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tkopt.backends.onnx_model import check
from tkopt.backends.onnx_model import export_onnx as to_onnx
from tkopt.frontends.onnx import import_onnx
from tkopt.models.blocks import REFERENCE_MODELS
from tkopt.models.export import export_onnx
from tkopt.ort import headers
from tkopt.ort.library import KernelLibrary, check_target
from tkopt.ort.native import KernelSource, LibraryBuildError, compile_library
from tkopt.ort.run import make_inputs
from tkopt.ort.session import InferenceSession, OpLibraryError
from tkopt.passes.pipeline import run_passes
from tkopt.pipeline import optimize
from tkopt.targets.ort_target import OrtTarget


def build(graph, target: str, path: Path) -> dict[str, str]:
    """Every fused node's kernel built and linked into `path`: {node: why} for nodes without one."""
    lib = KernelLibrary(target)
    fused = [n for n in graph.nodes if n.is_fused]
    failed = lib.prepare(fused)
    lib.link([n for n in fused if n.name not in failed], path)
    return failed


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> dict:
    """BERT-style layer (dynamo export) optimized, with its CPU op library built once for the module."""
    d = tmp_path_factory.mktemp("bert")
    model, inputs = REFERENCE_MODELS["bert_layer"]()
    src = export_onnx(model, inputs, d / "bert.onnx", dynamo=True)
    graph = import_onnx(src)
    run_passes(graph)
    failed = build(graph, "cpu", d / "bert.cpu.so")
    fused = to_onnx(graph)
    onnx.helper.set_model_props(fused, {"tkopt.op_library": "bert.cpu.so", "tkopt.target": "cpu"})
    check(fused)
    onnx.save(fused, d / "bert.tkopt.onnx")
    return {"dir": d, "src": src, "fused": d / "bert.tkopt.onnx", "failed": failed, "model": model}


def _run(session, feeds):
    return session.run(None, feeds)


def test_fused_nodes_run_natively_and_match(bert):
    assert bert["failed"] == {}
    fused = onnx.load(bert["fused"])
    assert sum(n.domain == "tkopt" for n in fused.graph.node) == 7  # q, k and v: one FusedGemmGroup
    ref = ort.InferenceSession(str(bert["src"]), providers=["CPUExecutionProvider"])
    sess = InferenceSession(bert["fused"])
    # Symbolic batch and sequence dims keep working: several sizes, none a tile multiple.
    base = make_inputs(onnx.load(str(bert["src"])))
    for batch, seq in [(2, 8), (3, 13), (1, 1)]:
        feeds = {}
        for name, arr in base.items():
            shape = (batch, seq, *arr.shape[2:])
            if np.issubdtype(arr.dtype, np.integer):
                a = np.ones(shape, arr.dtype)
                a[..., seq - seq // 4:] = 0
            else:
                a = np.random.default_rng(seq).standard_normal(shape).astype(arr.dtype)
            feeds[name] = a
        want, got = _run(ref, feeds), _run(sess, feeds)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape
            rel = np.abs(g - w).max() / np.abs(w).max()
            assert rel < 1e-5, (batch, seq, rel)


def test_plain_session_options_way(bert):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(bert["dir"] / "bert.cpu.so"))
    sess = ort.InferenceSession(str(bert["fused"]), so, providers=["CPUExecutionProvider"])
    feeds = make_inputs(onnx.load(str(bert["src"])))
    assert np.isfinite(sess.run(None, feeds)[0]).all()


def test_missing_library_names_it(bert, tmp_path):
    moved = tmp_path / "bert.tkopt.onnx"
    shutil.copy(bert["fused"], moved)
    with pytest.raises(OpLibraryError, match=r"bert\.cpu\.so is missing"):
        InferenceSession(moved)


def test_without_library_ort_error_gets_a_hint(bert):
    model = onnx.load(bert["fused"])
    del model.metadata_props[:]
    path = bert["dir"] / "nolib.onnx"
    onnx.save(model, path)
    with pytest.raises(OpLibraryError, match="hint: .*op library"):
        InferenceSession(path)


def test_library_for_another_model_is_refused(bert, tmp_path):
    model = onnx.load(bert["fused"])
    for n in model.graph.node:
        if n.domain == "tkopt":
            n.name = n.name + "_renamed"
            break
    path = bert["dir"] / "renamed.onnx"
    onnx.save(model, path)
    with pytest.raises(Exception, match="built for another model"):
        InferenceSession(path)


def test_unservable_nodes_are_left_unfused(tmp_path):
    """The CPU kernels are float32/float64: a float16 model keeps its nodes unfused, with a warning and the
    reason in the report, and still runs."""
    model, inputs = REFERENCE_MODELS["mlp"]()
    src = export_onnx(model.half(), tuple(t.half() for t in inputs), tmp_path / "mlp16.onnx", dynamo=True)
    graph = import_onnx(src)
    with pytest.warns(UserWarning, match=r"runs unfused on ORT cpu: its kernel failed: .*float16 has no cpu kernel"):
        result = optimize(graph, OrtTarget("cpu", graph.meta["onnx_model"], tmp_path), select="all")
    report = result.report
    assert report.passes.total_fused > 0 and report.total_fused == 0 and not any(report.fusions.values())
    failed = report.decided("kernel_failed")
    assert len(failed) == report.passes.total_fused
    assert all("float16 has no cpu kernel" in d.reason for d in failed)
    assert result.artifact.library is None
    out = result.artifact.model
    assert not any(n.domain == "tkopt" for n in out.graph.node)
    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = make_inputs(onnx.load(str(src)))
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(sess.run(None, feeds)[0], want[0])


def test_build_failure_shows_the_compiler_message(tmp_path):
    broken = KernelSource("tk0", "int tk0_call(void* a) { return this_is_not_defined; }\n", [("A", "buffer")],
                          {"A": [4]}, has_init=False)
    with pytest.raises(LibraryBuildError, match="this_is_not_defined"):
        compile_library([], [broken], "cpu", {}, tmp_path / "x.so")
    assert not list(tmp_path.iterdir())  # no half-written library


def test_newer_headers_than_runtime_fail_clearly(bert, tmp_path, monkeypatch):
    """A library built against a newer ORT C API than the runtime is refused with a message, not a crash."""
    newer = tmp_path / "include"
    shutil.copytree(headers.include_dir(), newer)
    h = newer / "onnxruntime_c_api.h"
    h.write_text(re.sub(r"#define ORT_API_VERSION \d+", "#define ORT_API_VERSION 999", h.read_text()))
    monkeypatch.setenv("TKOPT_ORT_INCLUDE", str(newer))
    graph = import_onnx(bert["src"])
    run_passes(graph, disable=["attention", "add_norm"])
    build(graph, "cpu", tmp_path / "new.so")
    so = ort.SessionOptions()
    with pytest.raises(Exception, match="built against ONNX Runtime C API version 999"):
        so.register_custom_ops_library(str(tmp_path / "new.so"))


def test_unknown_target_is_refused():
    with pytest.raises(ValueError, match="--target must be one of cpu, sm80, sm90"):
        check_target("sm70")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm90", "sm80"])
def test_cuda_library_compiles(tmp_path, target):
    """CI has nvcc but no GPU: the CUDA-target library for a model must at least compile."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    model, inputs = REFERENCE_MODELS["mlp"]()
    src = export_onnx(model.half(), tuple(t.half() for t in inputs), tmp_path / "mlp16.onnx", dynamo=True)
    graph = import_onnx(src)
    report = run_passes(graph)
    assert report.total_fused > 0
    assert build(graph, target, tmp_path / f"mlp.{target}.so") == {}
    assert (tmp_path / f"mlp.{target}.so").stat().st_size > 0


def test_a_gpu_kernel_is_built_for_ort_as_torch_builds_it(tmp_path):
    """The native library's kernel is the one the torch path compiles and measures: lowered and compiled with the
    program's own pass configs (attention's fast math, which TileLang turns into nvcc's --use_fast_math), and the
    kernel cache keeps them apart from a build without."""
    from tkopt.fused_ops import schema
    from tkopt.kernels import attention
    from tkopt.ort.library import _lowered

    class Attention(torch.nn.Module):  # two heads of 64, a dim the GPU kernels serve; causal: no mask input
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(128, 128)

        def forward(self, x):
            q = x.view(2, 16, 2, 64).transpose(1, 2)
            o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            return self.proj(o.transpose(1, 2).reshape(2, 16, 128))

    x = torch.randn(2, 16, 128, dtype=torch.float16)
    src = export_onnx(Attention().half().eval(), (x,), tmp_path / "attention16.onnx", dynamo=True)
    graph = import_onnx(src)
    run_passes(graph)
    attn = next(n for n in graph.nodes if n.op == "FusedAttention")
    spec = schema("FusedAttention").program(attn, "sm90")
    assert spec.pass_configs == attention.program_pass_configs("sm90") == {"tl.enable_fast_math": True}
    assert _lowered(spec, "sm90").flags == ["--use_fast_math"]
    plain = _lowered(replace(spec, pass_configs={}), "sm90")
    assert plain.flags == [] and plain.symbol != _lowered(spec, "sm90").symbol
    gemm = next(n for n in graph.nodes if n.op == "FusedGemm")
    assert _lowered(schema("FusedGemm").program(gemm, "sm90"), "sm90").flags == []
    assert attention.program_pass_configs("cpu") == {}  # the C backend's attention, as torch's CPU path builds it
