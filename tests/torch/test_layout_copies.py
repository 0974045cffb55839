"""drop_layout_copies: the copies torch's slow paths make before attention become views of their source, only
where that is proved for every size the graph admits; the rewritten program computes what the original does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tkopt
from tkopt.frontends.layout_copies import drop_layout_copies

aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _export(model: nn.Module, args: tuple, dynamic: bool) -> torch.fx.GraphModule:
    shapes = tuple({d: Dim.AUTO for d in range(a.dim())} for a in args) if dynamic else None
    with torch.no_grad():
        return torch.export.export(model, args, dynamic_shapes=shapes).module()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_reads_its_projection_in_place(batch_first: bool, dynamic: bool) -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=batch_first).eval()
    example = torch.randn(2, 16, 64) if batch_first else torch.randn(16, 2, 64)
    gm = _export(model, (example,), dynamic)
    assert aten.contiguous.default in _targets(gm)
    assert drop_layout_copies(gm) == 1
    targets = _targets(gm)
    assert aten.contiguous.default not in targets
    if batch_first:  # the input transpose moved past the packed projection, which reads the input as it is
        projection = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
        assert projection.args[0].op == "placeholder"
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert all(a.target is aten.permute.default for a in sdpa.args[:3])
    sizes = [(2, 16), (3, 7), (1, 33)] if dynamic else [(2, 16)]
    for b, s in sizes:
        x = torch.randn(b, s, 64) if batch_first else torch.randn(s, b, 64)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


class Reinterpreted(nn.Module):
    """q's (D, S) transpose made contiguous and viewed as (S, D): a reinterpretation of memory, which is a strided
    view of q only where S == D is known."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, s, d = q.shape
        return F.scaled_dot_product_attention(q.transpose(2, 3).contiguous().view(b, h, s, d), k, v)


def test_a_reinterpretation_is_rewritten_only_where_its_sizes_prove_it() -> None:
    torch.manual_seed(0)
    model = Reinterpreted()
    args = tuple(torch.randn(2, 3, 16, 16) for _ in range(3))
    static = _export(model, args, dynamic=False)
    assert drop_layout_copies(static) == 1  # S == D == 16: the view reads q[b, h, i, j] as a plain view of q
    torch.testing.assert_close(static(*args), model(*args))
    dynamic = _export(model, tuple(torch.randn(2, 3, 24, 16) for _ in range(3)), dynamic=True)
    assert drop_layout_copies(dynamic) == 0  # the seq length symbolic: its S*D elements in another order
    assert aten.contiguous.default in _targets(dynamic)
    other = tuple(torch.randn(3, 2, 40, 16) for _ in range(3))
    torch.testing.assert_close(dynamic(*other), model(*other))


class CopyReadElsewhere(nn.Module):
    """The packed projection's contiguous copy is also returned: it stays."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        packed = self.proj(x).transpose(0, 1).contiguous()  # (S, B, 3E)
        q, k, v = (t.transpose(0, 1).view(b, s, 4, 8).transpose(1, 2) for t in packed.split(32, dim=-1))
        return F.scaled_dot_product_attention(q, k, v), packed


class CopyAsMask(nn.Module):
    """The copy feeds SDPA's mask, not q, k or v: it stays."""

    def forward(self, q: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias.transpose(2, 3).contiguous())


@pytest.mark.parametrize("model,args", [
    (CopyReadElsewhere(), (torch.randn(2, 8, 32),)),
    (CopyAsMask(), (torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8))),
])
def test_a_copy_with_another_reader_stays(model: nn.Module, args: tuple) -> None:
    gm = _export(model.eval(), args, dynamic=False)
    before = _targets(gm)
    assert drop_layout_copies(gm) == 0
    assert _targets(gm) == before


def test_the_encoder_layer_compiles_without_the_copy() -> None:
    """Through tkopt.compile (every fusion kept, CPU kernels): the fused attention reads the projection's views."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        fast = tkopt.compile(model, x, select="all")
        for shape in [(2, 16, 64), (3, 9, 64)]:
            y = torch.randn(*shape)
            torch.testing.assert_close(fast(y), model(y), rtol=1e-4, atol=1e-4)
    targets = _targets(fast.graph_module)
    assert aten.contiguous.default not in targets and torch.ops.tkopt.fused_attention.default in targets


@pytest.mark.gpu
def test_on_cuda_attention_keeps_the_output_order_the_graph_was_traced_on(monkeypatch) -> None:
    """On CUDA SDPA's output follows q's memory order, and the export turned the reshape after it into a view that
    only the original order allows: the rewritten graphs (static and dynamic exports) run, eagerly and through
    inductor, and tkopt.compile's program (measured, and with every fusion kept) matches eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=True).eval().cuda().half()
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.half)
    with torch.no_grad():
        want = model(x)
        for dynamic in (False, True):
            gm = _export(model, (x,), dynamic)
            assert drop_layout_copies(gm) == 1
            torch.testing.assert_close(gm(x), want, rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(torch.compile(gm)(x), want, rtol=2e-3, atol=2e-3)
        for select in ("measured", "all"):
            fast = tkopt.compile(model, x, select=select)
            torch.testing.assert_close(fast(x), want, rtol=2e-2, atol=2e-2)
            assert aten.contiguous.default not in _targets(fast.graph_module)
