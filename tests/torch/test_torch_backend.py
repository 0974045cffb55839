"""Torch backend, tkopt:: custom ops, tkopt.compile and the "tkopt" torch.compile backend, on real
torch.export programs: exact round trips, hand-made fusions that match eager, re-export, dynamic shapes."""

from __future__ import annotations

import importlib.metadata
import logging
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tkopt
from tkopt.backends.torch_module import to_torch_module
from tkopt.backends.torch_ops import CUSTOM_OPS
from tkopt.frontends.fx import import_fx
from tkopt.models.blocks import EXPECTED_FUSIONS, REFERENCE_MODELS
from tkopt.passes.base import fuse
from tkopt.torch_compile import compile as tkopt_compile

D = 16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)
        self.ln = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + r
        y = self.down(F.gelu(self.up(self.ln(s))))
        return y, s * 2


def export_mlp(decompose: bool = False) -> tuple[nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    m = MLP().eval()
    dims = {0: Dim("batch", max=64), 1: Dim("seq", max=128)}
    ep = torch.export.export(m, (torch.randn(2, 5, D), torch.randn(2, 5, D)), dynamic_shapes=(dims, dims))
    return m, ep.run_decompositions() if decompose else ep


def inputs(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, s, D), torch.randn(b, s, D)


@pytest.mark.parametrize("decompose", [False, True])
def test_round_trip_without_fusion_is_exact(decompose):
    m, ep = export_mlp(decompose)
    gm = to_torch_module(import_fx(ep))
    gm.graph.lint()
    assert {n.target for n in gm.graph.find_nodes(op="get_attr")} >= {"up.weight", "down.bias", "ln.weight"}
    for b, s in ((2, 5), (3, 9)):
        args = inputs(b, s)
        for got, want in zip(gm(*args), m(*args), strict=True):
            assert torch.equal(got, want)


def fuse_linear_gelu(graph):
    """Hand-made fusion, as a pass would do it: Linear + Gelu -> FusedGemm(trans_b=1, gelu)."""
    lin = next(n for n in graph.nodes if n.op == "Linear" and n.inputs[1].name == "up_weight")
    gelu = next(n for n in graph.nodes if n.op == "Gelu")
    x, w, b = lin.inputs
    return fuse(graph, [lin, gelu], "FusedGemm", [x, w, b, None], [gelu.outputs[0]],
                {"trans_b": 1, "activation": "gelu"})


def fuse_add_norm(graph):
    """x + r feeding LayerNormalization, the sum also used later -> FusedAddNorm with both outputs."""
    ln = next(n for n in graph.nodes if n.op == "LayerNormalization")
    add = graph.producer(ln.inputs[0])
    x, r = add.inputs
    return fuse(graph, [add, ln], "FusedAddNorm", [x, r, ln.inputs[1], ln.inputs[2]],
                [ln.outputs[0], add.outputs[0]], {"kind": "layer", "epsilon": ln.attrs["epsilon"]})


@pytest.fixture(scope="module")
def fused():
    m, ep = export_mlp()
    graph = import_fx(ep)
    fuse_linear_gelu(graph)
    fuse_add_norm(graph)
    return m, to_torch_module(graph)


def test_hand_fusion_matches_eager(fused):
    m, gm = fused
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.tkopt.fused_gemm.default in targets and torch.ops.tkopt.fused_add_norm.default in targets
    assert torch.ops.aten.gelu.default not in targets and torch.ops.aten.layer_norm.default not in targets
    assert not any(n.target.startswith("_tkopt_const") for n in gm.graph.find_nodes(op="get_attr"))
    assert gm.get_parameter("up.weight") is m.up.weight or torch.equal(gm.get_parameter("up.weight"), m.up.weight)
    for b, s in ((2, 5), (4, 11)):  # the exported dims are symbolic: new shapes run as well
        args = inputs(b, s)
        for got, want in zip(gm(*args), m(*args), strict=True):
            assert got.shape == want.shape and rel_err(got, want) < 1e-5


def test_decomposed_hand_fusion():
    """After run_decompositions: Reshape -> Gemm(x, Transpose(W), b) -> Reshape -> Gelu; fuse Gemm + ... Gelu."""
    m, ep = export_mlp(decompose=True)
    graph = import_fx(ep)
    gelu = next(n for n in graph.nodes if n.op == "Gelu")
    view = graph.producer(gelu.inputs[0])
    gemm = graph.producer(view.inputs[0])
    assert (view.op, gemm.op) == ("Reshape", "Gemm")
    a, w, b = gemm.inputs
    out = gelu.outputs[0]
    fused_node = fuse(graph, [gemm], "FusedGemm", [a, w, b, None], [gemm.outputs[0]], {"activation": "none"})
    assert fused_node.inputs[1] is w
    gm = to_torch_module(graph)
    args = inputs(3, 7)
    got, want = gm(*args), m(*args)
    assert rel_err(got[0], want[0]) < 1e-5 and any(n.target == torch.ops.tkopt.fused_gemm.default
                                                   for n in gm.graph.nodes)
    assert out.origin is not None


def test_backend_follows_rewired_inputs():
    """A pass that drops a node and points its readers elsewhere (replace_uses) is honoured."""

    class M(nn.Module):
        def forward(self, x):
            return torch.relu(x.clone()) + 1

    ep = torch.export.export(M(), (torch.randn(2, 3),))
    graph = import_fx(ep)
    clone = next(n for n in graph.nodes if n.op == "Identity")
    graph.replace_uses(clone.outputs[0], clone.inputs[0])
    graph.remove_nodes([clone])
    gm = to_torch_module(graph)
    assert torch.ops.aten.clone.default not in {n.target for n in gm.graph.nodes}
    x = torch.randn(2, 3)
    assert torch.equal(gm(x), torch.relu(x) + 1)


def test_fused_module_reexports_and_compiles(fused):
    m, gm = fused
    dims = {0: Dim("batch", max=64), 1: Dim("seq", max=128)}
    ep = torch.export.export(gm, inputs(2, 5), dynamic_shapes=(dims, dims))  # fake impls, symbolic shapes
    assert any(n.target == torch.ops.tkopt.fused_gemm.default for n in ep.graph.nodes)
    args = inputs(3, 4)
    assert rel_err(ep.module()(*args)[0], m(*args)[0]) < 1e-5
    compiled = torch.compile(gm, backend="eager", dynamic=True)
    assert rel_err(compiled(*args)[0], m(*args)[0]) < 1e-5


def test_opcheck_all_custom_ops():
    torch.manual_seed(0)
    op = torch.ops.tkopt
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)  # GQA
    cases = [
        (op.fused_gemm, (x, w, b, torch.randn(2, 3, 5), 1, "gelu")),
        (op.fused_gemm_group, (x, w, torch.randn(3, 8), torch.randn(3, 8), b, torch.randn(3), torch.randn(3), 1)),
        (op.fused_gemm_group, (x, torch.randn(8, 5), torch.randn(8, 2), None, None, None, None, 0)),  # no third
        (op.fused_gated_mlp, (x, w, w.clone(), b, None, 1, "silu", 0)),
        (op.fused_attention, (q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2),
                              torch.ones(6, 6, dtype=torch.bool).tril(), None, 0.0, 0, "bshd", 1.0, -1e4, "none", 0)),
        (op.fused_attention, (q, kv, kv, torch.ones(1, 1, 1, 6, dtype=torch.bool), torch.ones(1, dtype=torch.uint8),
                              0.0, 0, "bhsd", 1.0, float("-inf"), "masked", 1)),
        (op.fused_add_norm, (x, None, torch.randn(8), None, "rms", 1e-6)),  # Sum would alias X: must not
    ]
    assert {c[0]._qualified_op_name for c in cases} == {o.name() for o in CUSTOM_OPS.values()}
    for fn, args in cases:
        torch.library.opcheck(fn, args)


def test_custom_op_backward_matches_finite_differences():
    """Every op's backward (its reference differentiated by autograd) passes gradcheck in float64, masks,
    GQA, causal and missing optional inputs included; opcheck with inputs that require grad."""
    torch.manual_seed(0)
    op = torch.ops.tkopt
    d = dict(dtype=torch.float64, requires_grad=True)
    x, w, b = torch.randn(2, 3, 8, **d), torch.randn(5, 8, **d), torch.randn(5, **d)
    q, k, v = torch.randn(1, 4, 6, 8, **d), torch.randn(1, 2, 6, 8, **d), torch.randn(1, 2, 6, 8, **d)
    cases = [
        (op.fused_gemm, (x, w, b, torch.randn(2, 3, 5, **d), 1, "gelu")),
        (op.fused_gemm, (x, torch.randn(8, 5, **d), None, None, 0, "silu")),
        (op.fused_gemm_group, (x, w, torch.randn(3, 8, **d), torch.randn(2, 8, **d), b, torch.randn(3, **d),
                               torch.randn(2, **d), 1)),
        (op.fused_gemm_group, (x, torch.randn(8, 5, **d), torch.randn(8, 2, **d), None, None, None, None, 0)),
        (op.fused_gated_mlp, (x, w, torch.randn(5, 8, **d), b, None, 1, "silu", 0)),
        (op.fused_attention, (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              torch.ones(6, 6, dtype=torch.bool).tril(), None, 0.0, 0, "bshd", 1.0, float("-inf"),
                              "masked", 1)),
        (op.fused_attention, (q, k, v, torch.randn(6, 6, **d), None, 0.5, 1, "bhsd", 0.25, float("-inf"), "nan", 1)),
        (op.fused_add_norm, (x, torch.randn(2, 3, 8, **d), torch.randn(8, **d), torch.randn(8, **d), "layer", 1e-5)),
        (op.fused_add_norm, (x, None, torch.randn(8, **d), None, "rms", 1e-6)),
    ]
    for fn, args in cases:
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

        def call(*ts, fn=fn, args=args, slots=slots):
            full = list(args)
            for i, t in zip(slots, ts, strict=True):
                full[i] = t
            return fn(*full)

        assert torch.autograd.gradcheck(call, [args[i] for i in slots])
        torch.library.opcheck(fn, args)


def test_training_through_compiled_module_matches_eager():
    """tkopt.compile'd module trains: loss gradients w.r.t. input and parameters equal eager's."""
    model, inputs = REFERENCE_MODELS["llama_block"]()
    fast = tkopt.compile(model, inputs)
    assert fast.tkopt_report.total_fused > 0
    grads = []
    for fn in (model, fast):
        model.zero_grad()
        x = inputs[0].clone().requires_grad_(True)
        fn(x, *inputs[1:]).square().mean().backward()
        grads.append([x.grad] + [p.grad.clone() for p in model.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


class Block(nn.Module):
    """Pre-norm attention + MLP block, written the usual way."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@pytest.fixture(scope="module")
def block() -> nn.Module:
    torch.manual_seed(0)
    return Block().eval()


def test_compile_dynamic_shapes(block):
    with torch.no_grad():
        c = tkopt_compile(block, (torch.randn(2, 5, D),), dynamic=True)
        assert c.tkopt_report.total_fused > 0
        assert any(str(n.target).startswith("tkopt.") for n in c.graph_module.graph.nodes)
        for b, s in ((2, 5), (3, 8), (5, 2)):
            x = torch.randn(b, s, D)
            assert rel_err(c(x), block(x)) < 1e-5
        assert len(c.specializations) == 1  # one dynamic export covered every shape
        x = torch.randn(1, 1, D)  # batch/seq of 1 were not covered (0/1 specialisation): re-exported
        assert rel_err(c(x), block(x)) < 1e-5 and len(c.specializations) == 2


def test_compile_static_and_disable(block):
    with torch.no_grad():
        c = tkopt_compile(block, (torch.randn(2, 4, D),), dynamic=False, disable=["attention"])
        assert "attention" in c.tkopt_report.passes.disabled
        assert not any(n.target == torch.ops.tkopt.fused_attention.default for n in c.graph_module.graph.nodes)
        for b, s in ((2, 4), (3, 6)):
            x = torch.randn(b, s, D)
            assert rel_err(c(x), block(x)) < 1e-5
        assert len(c.specializations) == 2


def test_torch_compile_backend(block, caplog):
    assert importlib.metadata.entry_points(group="torch_dynamo_backends", name="tkopt")
    assert "tkopt" in torch._dynamo.list_backends()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="tkopt", dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tkopt.backends.dynamo"):
        for b, s in ((2, 5), (3, 7)):
            x = torch.randn(b, s, D)
            assert rel_err(compiled(x), block(x)) < 1e-5
    assert "'attention': 1" in caplog.text  # SDPA's bshd-ordered output is reproduced for the view after it


def test_torch_compile_backend_training():
    """The graph is fused before AOTAutograd differentiates it; the fused ops' backward gives the gradients."""
    torch.manual_seed(0)
    model = Block().train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tkopt")
    x = torch.randn(2, 5, D, requires_grad=True)
    compiled(x).sum().backward()
    got, x.grad = x.grad, None
    model(x).sum().backward()
    assert rel_err(got, x.grad) < 1e-5


@pytest.mark.parametrize("name", sorted(EXPECTED_FUSIONS))
def test_compile_reference_models(name):
    """End to end on the reference blocks: the expected fusions, eager numerics, new batch/seq sizes. As
    torch.compile by default: the first export is static, the first new size exports with dynamic dims, and
    that program serves the next one."""
    model, example = REFERENCE_MODELS[name]()
    with torch.no_grad():
        c = tkopt_compile(model, example)
        assert c.tkopt_report.fusions == EXPECTED_FUSIONS[name], c.tkopt_report.passes.refusals
        assert [s.ranges for s in c.specializations] == [{}]  # static
        bigger = tuple(torch.cat([t, t[:1]]).repeat_interleave(2, dim=1) for t in example)  # batch+1, seq*2
        biggest = tuple(torch.cat([t, t]).repeat_interleave(3, dim=1) for t in example)  # batch*2, seq*3
        for args in (example, bigger, biggest):
            assert rel_err(c(*args), model(*args)) < 1e-5
        assert len(c.specializations) == 2 and c.specializations[1].ranges


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 1e-2)])
def test_compile_llama_block_half_precision(dtype, tol):
    """HF attention's softmax(scores, dtype=float32).to(q.dtype) in a half/bf16 model is attention:
    the fused block matches the float32 eager block on the same weights."""
    model, example = REFERENCE_MODELS["llama_block"]()
    with torch.no_grad():
        want = model(*example)
        c = tkopt_compile(model.to(dtype), tuple(t.to(dtype) for t in example))
        assert c.tkopt_report.fusions == EXPECTED_FUSIONS["llama_block"], c.tkopt_report.passes.refusals
        got = c(*(t.to(dtype) for t in example))
    assert got.dtype == dtype and rel_err(got.float(), want) < tol


def test_compile_refuses_float32_probs_times_float32_v():
    """Probabilities kept in float32 times V cast to float32 give a float32 result; FusedAttention
    would return bfloat16, so this is refused and runs as it was."""

    class M(nn.Module):
        def forward(self, q, k, v):
            p = torch.softmax(q @ k.transpose(2, 3) * 0.25, dim=-1, dtype=torch.float32)
            return p @ v.float()

    torch.manual_seed(0)
    args = tuple(torch.randn(2, 4, 9, 16, dtype=torch.bfloat16) for _ in range(3))
    c = tkopt_compile(M(), args)
    assert c.tkopt_report.fusions.get("attention", 0) == 0
    reasons = [r.reason for r in c.tkopt_report.passes.refusals]
    assert any("not cast back to the Q·K^T dtype bfloat16" in r for r in reasons), reasons
    assert torch.equal(c(*args), M()(*args))


class SharedMask(nn.Module):
    """Two self-attention layers reading one key padding mask, as a transformers encoder's layers do."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads, self.width = heads, 64 * heads
        self.projs = nn.ModuleList(nn.Linear(self.width, 3 * self.width) for _ in range(2))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        mask = keep[:, None, None, :]
        for proj in self.projs:
            q, k, v = proj(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, w)
        return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attention_nodes_sharing_a_key_mask_share_its_kept_rows(device, recwarn):
    """The mask's summary per batch row (the derived input `kept`) is computed once in the graph, in aten ops,
    and read by both attention nodes; inductor compiles it with the rest, and AOTAutograd's cache takes the
    program (a Python function's node would make it trace the program again in every warm compile). Rows with
    and without padding, at the example size and another, match eager (on CUDA: the GPU kernels, which skip
    the mask in the rows that keep every key)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    counters.clear()
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = SharedMask(heads=1 if device == "cuda" else 2).eval().to(device, dtype)

    def example(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        keep = torch.ones(b, s, dtype=torch.bool, device=device)
        keep[0, s // 2:] = False  # row 0 padded, the others keep every key
        return torch.randn(b, s, model.width, device=device, dtype=dtype), keep

    with torch.no_grad():
        c = tkopt_compile(model, example(3, 70), select="all", inductor=True)
        nodes = c.graph_module.graph.nodes
        attention = [n for n in nodes if n.target == torch.ops.tkopt.fused_attention.default]
        kept = attention[0].args[4]
        assert len(attention) == 2 and isinstance(kept, torch.fx.Node) and attention[1].args[4] is kept
        assert kept.target == torch.ops.aten._to_copy.default and kept.args[0].target == torch.ops.aten.all.dims
        assert all(isinstance(n.target, torch._ops.OpOverload | str) or n.target is operator.getitem
                   for n in nodes if n.op == "call_function"), [n.target for n in nodes if n.op == "call_function"]
        for b, s in ((3, 70), (2, 129)):
            args = example(b, s)
            assert rel_err(c(*args), model(*args)) < (1e-5 if dtype == torch.float32 else 2e-3)
    assert not [w for w in recwarn if "inductor failed" in str(w.message)]
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0, dict(counters["aot_autograd"])
