"""Fused nodes that run as ONNX Runtime's own ops on the ORT CPU target (FusedOp.ort_ops): which nodes are lowered,
which are not and why, and that the optimized model equals the original in real ORT sessions at several sizes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tkopt.api import optimize_onnx
from tkopt.frontends.onnx import import_onnx
from tkopt.fused_ops import Unservable, schema
from tkopt.models.export import export_onnx
from tkopt.passes.pipeline import run_passes
from tkopt.targets.ort_target import OrtTarget

H = 24
EPS = 1e-6


class AddRms(nn.Module):
    """Llama's residual add and RMSNorm, the sum used after it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + r
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * self.weight, s * 2


class Rms(AddRms):
    """RMSNorm alone (no residual)."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight + r


class AddLayerNorm(nn.Module):
    """F.layer_norm after a residual add: the exporter writes ONNX's LayerNormalization."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(H) + 0.5), nn.Parameter(torch.randn(H))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x + r, (H,), self.weight, self.bias, 1e-5)


class AddLayerNormByHand(AddLayerNorm):
    """The same LayerNorm written out: a two-pass variance, which ORT's one-pass LayerNorm would not reproduce."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        s = x + r
        d = s - s.mean(-1, keepdim=True)
        return d / torch.sqrt((d * d).mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias


def _optimize(tmp_path: Path, model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = model.to(dtype).eval()
    inputs = (torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype))
    src = export_onnx(model, inputs, tmp_path / "model.onnx", dynamo=True)
    optimized, report = optimize_onnx(src, tmp_path / "out.onnx", report=False, target="cpu", select="all",
                                      check_accuracy=True)
    assert report.accuracy is not None and report.accuracy.ok and len(report.accuracy.runs) >= 3
    ops = Counter((n.domain, n.op_type) for n in optimized.graph.node)
    [norm] = [d for d in report.nodes if d.op == "FusedAddNorm"]
    return norm, ops, optimized


@pytest.mark.parametrize(("model", "op"), [
    (AddRms(), ("com.microsoft", "SkipSimplifiedLayerNormalization")),
    (Rms(), ("", "SimplifiedLayerNormalization")),
    (AddLayerNorm(), ("com.microsoft", "SkipLayerNormalization")),
], ids=["add_rms", "rms", "add_layer_norm"])
def test_norms_run_as_onnx_runtimes_own_ops_and_match(tmp_path: Path, model: nn.Module, op: tuple[str, str]) -> None:
    """The fused norm runs as ORT's op (no tkopt node, no op library), named in the report; the accuracy check ran
    the optimized model against the original in ORT at several sizes; with a residual, the sum ORT's op also
    writes feeds what read it."""
    norm, ops, optimized = _optimize(tmp_path, model, (2, 5, H))
    assert norm.decision == "kept" and norm.runs_as == f"ONNX Runtime's {op[1]}"
    assert ops[op] == 1 and not any(d == "tkopt" for d, _ in ops)
    assert not (tmp_path / "out.tkopt_ops.so").exists() and not any(p.suffix == ".so" for p in tmp_path.iterdir())
    if op[0]:
        assert any(o.domain == op[0] for o in optimized.opset_import)
    if type(model) is AddRms:
        [skip] = [n for n in optimized.graph.node if n.op_type == op[1]]
        assert skip.output[3]  # the sum, read by what follows (s * 2)


@pytest.mark.parametrize(("model", "shape", "dtype", "why"), [
    (AddLayerNormByHand(), (2, 5, H), torch.float32, "one-pass variance"),
    (AddRms(), (2, 5, H), torch.float64, "not float64 of rank 3"),
    (AddRms(), (2, 3, 5, H), torch.float32, "not float32 of rank 4"),
], ids=["layer_norm_by_hand", "float64", "rank4"])
def test_norms_ort_does_not_compute_alike_keep_the_library_kernel(tmp_path: Path, model: nn.Module,
                                                                   shape: tuple[int, ...], dtype: torch.dtype,
                                                                   why: str) -> None:
    """A near miss of ORT's ops runs on tkopt's kernel, and the refusal says why."""
    norm, ops, _ = _optimize(tmp_path, model, shape, dtype)
    assert norm.decision == "kept" and norm.runs_as == ""
    assert ops[("tkopt", "FusedAddNorm")] == 1
    graph = import_onnx(tmp_path / "model.onnx")
    run_passes(graph)
    [node] = [n for n in graph.nodes if n.op == "FusedAddNorm"]
    with pytest.raises(Unservable, match=why):
        schema("FusedAddNorm").ort_ops(node, "cpu")


def test_the_decision_key_says_what_runs(tmp_path: Path) -> None:
    """A decision cached before a node ran as ORT's ops is not read for it: the key names which one runs."""
    torch.manual_seed(0)
    src = export_onnx(AddRms().eval(), (torch.randn(2, 5, H), torch.randn(2, 5, H)), tmp_path / "m.onnx", dynamo=True)
    graph = import_onnx(src)
    run_passes(graph)
    [node] = [n for n in graph.nodes if n.op == "FusedAddNorm"]
    assert OrtTarget("cpu", graph.meta["onnx_model"], tmp_path).node_key(graph, node)[-1] == "ort ops"
    assert OrtTarget(None, graph.meta["onnx_model"], tmp_path).lowered([node]) == {}  # no target: references
    with pytest.raises(Unservable, match="CPU only"):
        schema("FusedAddNorm").ort_ops(node, "sm90")
