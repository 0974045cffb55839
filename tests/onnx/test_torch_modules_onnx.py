"""Both ONNX exporters on torch's nn.TransformerEncoder and transformers' Llama: the dynamo exporter's
static-shape export (its default) fuses attention like the dynamic one (K^T folded to a 3-D transpose,
GQA included), and a TorchScript export that runs only at its traced sizes gets its accuracy check
skipped with one line that says so, not an ORT traceback."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tkopt
from tkopt.cli import main
from tkopt.models.export import export_onnx


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("dynamic", [False, True])
def test_dynamo_export_fuses_attention_with_static_and_dynamic_shapes(dynamic: bool, tmp_path, monkeypatch) -> None:
    """Static shapes: the exporter folds K's (B,H,S,D) view away (K^T is a 3-D transpose of (B*H,S,D)
    reshaped to (B,H,D,S)); the attention pass views K as (B,H,S,D) again."""
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_onnx(_encoder(), (torch.randn(2, 8, 32),), tmp_path / "enc.onnx", dynamo=True,
                           dynamic_batch_seq=dynamic)
    _, rep = tkopt.optimize_onnx(path, report=False, check_accuracy=True)
    assert rep.passes.fusions["attention"] == 2 and rep.passes.fusions["add_norm"] == 4
    assert not rep.passes.refusals
    assert rep.accuracy is not None and all(o.max_rel < 1e-5 for o in rep.accuracy.outputs)


def test_dynamo_static_export_fuses_gqa_attention(tmp_path, monkeypatch) -> None:
    """Llama's K^T: the GQA head repeat's (B, Hkv, group, S, D) is reshaped straight to (B*H, S, D)."""
    hf = pytest.importorskip("tkopt.models.hf")
    pytest.importorskip("transformers")
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    model, inputs = hf.hf_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_onnx(model, inputs, tmp_path / "llama.onnx", dynamo=True, dynamic_batch_seq=False)
    _, rep = tkopt.optimize_onnx(path, report=False, check_accuracy=True)
    assert rep.passes.fusions["attention"] == 2 and not rep.passes.refusals
    assert rep.accuracy is not None and all(o.max_rel < 1e-5 for o in rep.accuracy.outputs)


def test_torchscript_export_fixed_to_its_traced_sizes_skips_the_check_with_one_line(tmp_path, capsys) -> None:
    """Exported at sequence 16 with dims declared dynamic, the model's own Reshapes keep 16: ORT fails on
    the original at every size the check tries. The report says the check was skipped and why, in one
    line; no ORT traceback; the optimized model (as runnable as the original) is written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_onnx(_encoder(), (torch.randn(3, 16, 32),), tmp_path / "enc.onnx", dynamo=False)
    _, rep = tkopt.optimize_onnx(path, report=False, check_accuracy=True)
    assert rep.accuracy is not None and not rep.accuracy.runs
    assert len(rep.accuracy.skipped) == 1 and "the original model does not run" in rep.accuracy.skipped[0]
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(path), "-o", str(out)]) == 0 and out.exists()
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "accuracy check skipped" in captured.out
