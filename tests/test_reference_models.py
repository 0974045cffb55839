"""Every reference model through every frontend: the expected fusions fire and fused matches unfused.

Frontends: torch.export FX (tkopt.compile), ONNX from the dynamo exporter, ONNX from the
TorchScript exporter. Fused nodes run their torch references here (TKOPT_KERNELS=reference) so
that this file checks the graph side alone, in float32, to 1e-5 relative; the TileLang kernels
are checked against the same references in tests/kernels and end to end in tests/test_fused_execution.py.
"""

from __future__ import annotations

import pytest
import torch

import tkopt
from tkopt.models.blocks import EXPECTED_FUSIONS, REFERENCE_MODELS
from tkopt.models.export import export_onnx
from tkopt.models.hf import EXPECTED_FUSIONS as HF_EXPECTED_FUSIONS

FRONTENDS = ("fx", "onnx_dynamo", "onnx_torchscript")


def _counts(fusions: dict[str, int], expected: dict[str, int]) -> dict[str, int]:
    return {k: fusions.get(k, 0) for k in expected}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_expected_fusions_and_parity(name: str, frontend: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    model, inputs = REFERENCE_MODELS[name]()
    _check_fusions_and_parity(model, inputs, EXPECTED_FUSIONS[name], frontend, tmp_path / f"{name}.onnx")


def _check_fusions_and_parity(model, inputs, expected: dict[str, int], frontend: str, onnx_path) -> None:
    """Through `frontend` (FX via tkopt.compile, or an ONNX export): the expected fusion counts, and every
    output within 1e-5 relative error of the unfused model."""
    if frontend == "fx":
        optimized = tkopt.compile(model, inputs)
        assert _counts(optimized.tkopt_report.fusions, expected) == expected
        with torch.no_grad():
            want, got = model(*inputs), optimized(*inputs)
        want, got = ((t,) if isinstance(t, torch.Tensor) else t for t in (want, got))
        for w, g in zip(want, got, strict=True):
            rel = ((g - w).abs().max() / w.abs().max()).item()
            assert rel < 1e-5, rel
        return
    path = export_onnx(model, inputs, onnx_path, dynamo=frontend == "onnx_dynamo")
    _, report = tkopt.optimize_onnx(path, report=False, check_accuracy=True)
    assert _counts(report.passes.fusions, expected) == expected
    assert report.accuracy is not None and report.accuracy.ok
    for out in report.accuracy.outputs:
        assert out.max_rel < 1e-5, (out.name, out.max_rel)


# transformers' models from tiny random configs (2 layers): the same fusions from every frontend.
HF_CASES = [(n, "eager", f) for n in HF_EXPECTED_FUSIONS for f in FRONTENDS]
HF_CASES += [(n, "sdpa", "fx") for n in HF_EXPECTED_FUSIONS]


@pytest.mark.parametrize("name,impl,frontend", HF_CASES)
def test_transformers_models(name: str, impl: str, frontend: str, tmp_path, monkeypatch) -> None:
    hf = pytest.importorskip("tkopt.models.hf")
    pytest.importorskip("transformers")
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    model, inputs = getattr(hf, name)(impl)
    _check_fusions_and_parity(model, inputs, HF_EXPECTED_FUSIONS[name], frontend, tmp_path / f"{name}.onnx")
