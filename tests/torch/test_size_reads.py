"""Sizes read off tensors a fusion absorbed (issue 8, defect 4): the rebuilt module reads them off
a tensor that still exists instead of failing with "was replaced in the IR but is still read by"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export import Dim

from tkopt.frontends.fx import import_fx
from tkopt.pipeline import optimize
from tkopt.targets.torch_target import TorchTarget

D = 8


class SizeAfterFusedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.l1(x))
        b, s, _ = h.shape
        return self.l2(h).reshape(b * s, D) * h.numel()


def _reading_sizes_off(gm: fx.GraphModule, target: torch._ops.OpOverload) -> fx.GraphModule:
    """The exported graph with every size read moved onto the first `target` node's output.

    torch.export binds sizes to graph inputs; other tracers bind a size to the first tensor that
    carried it, which can be a value a fusion absorbs (here the GEMM's output before its GELU)."""
    src = next(n for n in gm.graph.nodes if n.target is target)
    val = src.meta["val"]
    for n in list(gm.graph.nodes):
        if n.target is torch.ops.aten.sym_size.int:
            dim = next(i for i, d in enumerate(val.shape) if str(d) == str(n.meta["val"]))
            n.args = (src, dim)
            src.append(n)
    numel = src.graph.call_function(torch.ops.aten.sym_numel.default, (src,))
    numel.meta["val"] = val.numel()
    src.append(numel)
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    mul.args = (mul.args[0], numel)
    gm.graph.lint()
    gm.recompile()
    return gm


def test_size_reads_of_a_fused_intermediate_are_rederived() -> None:
    torch.manual_seed(0)
    model = SizeAfterFusedLayer().eval()
    dims = {0: Dim("batch", min=2, max=16), 1: Dim("seq", min=2, max=64)}
    ep = torch.export.export(model, (torch.randn(2, 5, D),), dynamic_shapes=(dims,))
    gm = _reading_sizes_off(ep.module(), torch.ops.aten.linear.default)
    result = optimize(import_fx(gm), TorchTarget((torch.randn(2, 5, D),)), select="all")
    assert result.report.fusions["gemm"] == 2  # linear+gelu absorbs the linear output the sizes were read off
    fused = result.emitted
    size_ops = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default)
    reads = [n for n in fused.graph.nodes if n.target in size_ops]
    assert reads and all(n.args[0].op == "placeholder" for n in reads)
    for b, s in [(2, 5), (3, 7), (4, 2)]:
        x = torch.randn(b, s, D)
        torch.testing.assert_close(fused(x), model(x))
