"""RMSNorm in each spelling (nn.RMSNorm, F.rms_norm with and without eps or weight, written out, Gemma's
(1 + w) weight) fuses with its residual add on every frontend, matching eager; a norm over two axes is
refused with its reason on every frontend."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tkopt
from tkopt.backends.dynamo import make_backend
from tkopt.models.export import export_onnx

D = 16


class Norm(nn.Module):
    """x + r, normalized one way, then a linear: one add_norm and one gemm when the norm is fusable."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.RMSNorm(D, eps=1e-6)
        self.plain = nn.RMSNorm(D, elementwise_affine=False)
        self.weight = nn.Parameter(torch.randn(D) / 4)
        self.wide = nn.RMSNorm((2, D // 2))
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h = x + r
        if self.kind == "module":
            y = self.norm(h)
        elif self.kind == "functional_default_eps":
            y = F.rms_norm(h, (D,), self.weight)
        elif self.kind == "no_weight":
            y = self.plain(h)
        elif self.kind == "gemma":  # written out in float32, weight stored as w with (1 + w) applied
            hf = h.float()
            y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight.float())).type_as(h)
        else:  # "two_axes": normalized over the last two axes
            y = self.wide(h.unflatten(-1, (2, D // 2))).flatten(-2)
        return self.out(y)


FUSABLE = ("module", "functional_default_eps", "no_weight", "gemma")
# Every spelling on the frontends that see it differently (export graph, make_fx graph, opset-23 ONNX);
# nn.RMSNorm on the rest.
CASES = [(k, f) for k in FUSABLE for f in ("compile", "backend_training", "onnx_dynamo_opset23")] + [
    ("module", "backend_no_grad"), ("module", "onnx_dynamo")]


def _model(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return Norm(kind).eval(), (torch.randn(2, 8, D), torch.randn(2, 8, D))


def _run(kind: str, frontend: str, tmp_path) -> tuple[dict[str, int], list[str]]:
    """(fusion counts, refusal reasons) through `frontend`, after checking every output against eager."""
    model, inputs = _model(kind)
    if frontend == "compile":
        fast = tkopt.compile(model, inputs)
        for b, s in ((2, 8), (1, 1), (3, 5)):
            x = (torch.randn(b, s, D), torch.randn(b, s, D))
            torch.testing.assert_close(fast(*x), model(*x), rtol=1e-5, atol=1e-6)
        rep = fast.tkopt_report
        return rep.fusions, [r.reason for r in rep.passes.refusals]
    if frontend.startswith("backend"):
        torch._dynamo.reset()
        backend = make_backend()
        fast = torch.compile(model, backend=backend, dynamic=True)
        training = frontend == "backend_training"
        model.train(training)
        with torch.set_grad_enabled(training):
            torch.testing.assert_close(fast(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)
        rep = backend.graph_modules[-1].tkopt_report
        return rep.fusions, [r.reason for r in rep.passes.refusals]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opset = 23 if frontend.endswith("opset23") else None
        path = export_onnx(model, inputs, tmp_path / f"{kind}.onnx", dynamo=True, opset=opset)
    _, rep = tkopt.optimize_onnx(path, report=False, check_accuracy=True)
    assert rep.accuracy is not None and all(o.max_rel < 1e-5 for o in rep.accuracy.outputs)
    return rep.passes.fusions, [r.reason for r in rep.passes.refusals]


@pytest.mark.parametrize("kind,frontend", CASES)
def test_rms_norm_spellings_fuse_with_their_residual(kind: str, frontend: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    fusions, _ = _run(kind, frontend, tmp_path)
    assert fusions["add_norm"] == 1 and fusions["gemm"] == 1


@pytest.mark.parametrize("frontend", ["compile", "backend_no_grad", "onnx_dynamo_opset23"])
def test_rms_norm_over_two_axes_is_refused_with_its_reason(frontend: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    fusions, reasons = _run("two_axes", frontend, tmp_path)
    assert fusions["add_norm"] == 0
    assert any("only the last axis is fused" in r for r in reasons), reasons
