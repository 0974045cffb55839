"""Every reference model and transformers' models through the ORT path on CPU: optimized with the
native op library built for "cpu", run in a real ORT session, fused vs unfused within tolerance,
with the expected fusions and no node left without a kernel."""

from __future__ import annotations

from pathlib import Path

import pytest

import tkopt
from tkopt.models.blocks import EXPECTED_FUSIONS, REFERENCE_MODELS
from tkopt.models.export import export_onnx
from tkopt.models.hf import EXPECTED_FUSIONS as HF_EXPECTED_FUSIONS


def _check(path, expected: dict[str, int], tmp_path) -> None:
    out = tmp_path / "fused.onnx"
    _, report = tkopt.optimize_onnx(path, out, report=False, check_accuracy=True, target="cpu", select="all")
    assert {k: report.passes.fusions.get(k, 0) for k in expected} == expected
    # No node is left without a kernel: a residual that may broadcast (BERT's position embeddings of batch 1)
    # is refused by the add_norm pass itself, which proves shapes through the export (tkopt/passes/shapes.py).
    assert report.decided("kernel_failed") == [] and report.total_fused == sum(expected.values())
    assert report.accuracy.fused_runner == "ort"  # the native library, not a Python fallback
    assert all(o.max_rel < 1e-5 for o in report.accuracy.outputs), report.accuracy.outputs
    assert report.library is not None and Path(report.library).is_file()
    assert Path(report.library).parent == tmp_path and Path(report.library).name.startswith("fused.tkopt-cpu-")


@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_reference_model_runs_on_native_library(name: str, tmp_path) -> None:
    model, inputs = REFERENCE_MODELS[name]()
    path = export_onnx(model, inputs, tmp_path / f"{name}.onnx", dynamo=False)
    _check(path, EXPECTED_FUSIONS[name], tmp_path)


@pytest.mark.parametrize("name", sorted(HF_EXPECTED_FUSIONS))
def test_transformers_model_runs_on_native_library(name: str, tmp_path) -> None:
    hf = pytest.importorskip("tkopt.models.hf")
    pytest.importorskip("transformers")
    model, inputs = getattr(hf, name)("eager")
    path = export_onnx(model, inputs, tmp_path / f"{name}.onnx", dynamo=False)
    _check(path, HF_EXPECTED_FUSIONS[name], tmp_path)
