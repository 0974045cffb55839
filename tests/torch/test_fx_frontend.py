"""FX frontend: real torch.export programs (before and after run_decompositions) and Dynamo graphs
become IR graphs with canonical ops, parameters (live, not constant), symbolic dims and fx origins."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export import Dim

from tkopt.frontends.fx import import_fx, node_val

B, S, D, H = 2, 6, 16, 2


class Block(nn.Module):
    """Touches most mapped ops once: linear, gelu, scalar mul, buffer add, view/transpose, SDPA,
    layer_norm, softmax, silu, mean, pow, rsqrt, cast, cat, unsqueeze, expand, slice, split."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.ln = nn.LayerNorm(D, eps=1e-6)
        self.register_buffer("shift", torch.linspace(0, 1, D))
        self.register_buffer("tilt", torch.linspace(1, 2, D), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        h = F.gelu(self.fc(x), approximate="tanh") * 0.5 + self.shift * self.tilt
        q, k, v = self.qkv(h).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D)
        y = self.ln(a + h).softmax(-1)
        r = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        z = torch.cat([F.silu(r), r.unsqueeze(2).expand(b, s, 2, D)[:, :, 0]], dim=-1)[:, 1:]
        left, right = z.split([D, D], dim=-1)
        return (left + right).to(torch.float64), y


@pytest.fixture(scope="module")
def exported() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    dims = {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=3, max=128)}
    return torch.export.export(Block().eval(), (torch.randn(B, S, D),), dynamic_shapes=({**dims},))


def ops_of(graph) -> dict[str, int]:
    return graph.count_ops()


def only(graph, op):
    nodes = [n for n in graph.nodes if n.op == op]
    assert len(nodes) == 1, (op, nodes)
    return nodes[0]


def test_training_ir_maps_to_canonical_ops(exported):
    g = import_fx(exported)
    ops = ops_of(g)
    for op in ("Linear", "Gelu", "Mul", "Add", "Reshape", "Transpose", "ScaledDotProductAttention",
               "LayerNormalization", "Softmax", "Rsqrt", "Pow", "ReduceMean", "Silu", "Concat", "Unsqueeze",
               "Expand", "Slice", "Split", "Cast"):
        assert ops.get(op), (op, ops)
    assert only(g, "Gelu").attrs == {"approximate": "tanh"}
    assert only(g, "Softmax").attrs == {"axis": -1}
    ln = only(g, "LayerNormalization")
    assert ln.attrs == {"axis": -1, "epsilon": 1e-6}
    assert [v.name for v in ln.inputs[1:]] == ["ln_weight", "ln_bias"]
    sdpa = only(g, "ScaledDotProductAttention")
    assert sdpa.attrs == {"scale": 0.0, "is_causal": 1, "enable_gqa": 0} and sdpa.inputs[3] is None
    assert only(g, "ReduceMean").attrs == {"axes": [2], "keepdims": 1}
    assert only(g, "Cast").attrs == {"to": "float64"}
    perms = sorted(n.attrs["perm"] for n in g.nodes if n.op == "Transpose")
    assert perms == [[0, 2, 1, 3], [2, 0, 3, 1, 4]]  # full permutations, transpose.int included
    pow_node = only(g, "Pow")
    assert pow_node.inputs[1].const.item() == 2 and pow_node.inputs[1].dtype == "float32"
    split = only(g, "Split")
    assert split.attrs == {"axis": 2, "split": [D, D]} and len(split.outputs) == 2
    assert all(o.origin.target.__name__ == "getitem" for o in split.outputs)


def test_symbolic_dims_and_constants(exported):
    g = import_fx(exported)
    (x,) = g.inputs
    batch, seq = x.shape[:2]
    assert isinstance(batch, str) and isinstance(seq, str) and x.shape[2] == D
    reshape = next(n for n in g.nodes if n.op == "Reshape")
    assert reshape.attrs["shape"][0] == batch and reshape.attrs["shape"][2:] == [3, H, D // H]
    mod = exported.module()
    state = dict(mod.named_parameters()) | dict(mod.named_buffers())
    values = {v.name: v for v in g.values()}
    producers = g.producers()
    for name in ("fc_weight", "fc_bias", "qkv_weight", "ln_weight", "shift", "tilt"):
        v, t = values[name], state[name.replace("_", ".", 1) if name.startswith(("fc_", "qkv_", "ln_")) else name]
        assert id(v) not in producers and v not in g.inputs and v.shape == tuple(t.shape)
        if name == "tilt":  # a non-persistent buffer: derived at construction, a constant
            np.testing.assert_array_equal(v.const, t.numpy())
        else:  # parameters and persistent buffers may be trained or loaded after compiling
            assert v.const is None
    assert not any(v.is_const for v in g.inputs)
    mul = next(n for n in g.nodes if n.op == "Mul" and n.inputs[1].is_const)
    assert mul.inputs[1].const.item() == 0.5 and mul.inputs[1].shape == ()


def test_every_ir_value_has_one_fx_node(exported):
    for ep in (exported, exported.run_decompositions()):
        g = import_fx(ep)
        seen = set()
        for n in g.nodes:
            assert isinstance(n.origin, fx.Node)
            for o in n.outputs:
                if o.origin is None:  # an output no getitem reads (native_layer_norm's mean/rstd)
                    continue
                assert o.origin not in seen
                seen.add(o.origin)
                val = node_val(o.origin)
                assert o.dtype == str(val.dtype).removeprefix("torch.") and len(o.shape) == val.dim()


def test_decomposed_ir(exported):
    g = import_fx(exported.run_decompositions())
    ops = ops_of(g)
    assert "Linear" not in ops and ops.get("Gemm") and ops.get("Softmax") and ops.get("LayerNormalization")
    gemm = next(n for n in g.nodes if n.op == "Gemm")
    a, w, bias = gemm.inputs
    assert bias.name == "fc_bias" and a.shape[-1] == D  # addmm(bias, x, w) -> Gemm(x, w, bias)
    wt = g.producer(w)
    assert wt.op == "Transpose" and wt.attrs["perm"] == [1, 0] and wt.inputs[0].name == "fc_weight"
    ln = only(g, "LayerNormalization")
    assert ln.origin.target is torch.ops.aten.native_layer_norm.default and len(ln.outputs) == 3
    assert ln.outputs[0].origin.target.__name__ == "getitem"


def test_unmapped_op_keeps_aten_name():
    class M(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=1) * x.shape[0]

    ep = torch.export.export(M(), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("b")},))
    g = import_fx(ep)
    cumsum = next(n for n in g.nodes if n.op == "aten::cumsum")
    assert cumsum.attrs["dim"] == 1 and cumsum.outputs[0].shape[1] == 4
    mul = next(n for n in g.nodes if n.outputs[0] in g.outputs)
    assert mul.op == "aten::mul" and len(mul.inputs) == 1  # x * SymInt stays aten, the SymInt stays FX-only


def test_dynamo_graph():
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    m = nn.Sequential(nn.Linear(D, D), nn.GELU())
    compiled = torch.compile(m, backend=backend, dynamic=True)
    x = torch.randn(B, S, D)
    torch.testing.assert_close(compiled(x), m(x))
    g = import_fx(captured[0])  # parameters are placeholders, SymInt placeholders stay FX-only
    assert [v.shape for v in g.inputs] == [(D, D), (D,), (g.inputs[2].shape[0], g.inputs[2].shape[1], D)]
    assert isinstance(g.inputs[2].shape[0], str)
    assert [n.op for n in g.nodes] == ["torch::linear", "torch::gelu"]  # torch-level ops: kept as they are


def test_symbolic_trace_needs_example_inputs():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(ValueError, match="example_inputs"):
        import_fx(gm)
    g = import_fx(gm, example_inputs=(torch.randn(2, 4),))
    assert g.inputs[0].shape == (2, 4) and any(n.op == "module::1" for n in g.nodes)


def test_bfloat16_constants_are_float32_numpy():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.linspace(1, 2, 4, dtype=torch.bfloat16), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    g = import_fx(torch.export.export(Scaled(), (torch.randn(2, 4, dtype=torch.bfloat16),)))
    c = next(v for v in g.values() if v.name == "scale")
    assert c.dtype == "bfloat16" and c.const.dtype == np.float32


def test_layout_changing_clone_is_not_identity():
    """A clone that makes a transposed tensor contiguous is what the aten.view after it relies on."""

    class M(nn.Module):
        def forward(self, x):
            y = x.transpose(1, 2).contiguous().view(x.shape[0], -1)
            return y.clone().softmax(-1, dtype=torch.float32)

    g = import_fx(torch.export.export(M(), (torch.randn(2, 3, 4),)).run_decompositions())
    clones = [n for n in g.nodes if n.origin.target is torch.ops.aten.clone.default]
    assert [n.op for n in clones] == ["aten::clone", "Identity"]
    assert any(n.op == "Softmax" for n in g.nodes)  # dtype= its own dtype is a no-op


@pytest.mark.parametrize(
    "softmax",
    [lambda x: x.softmax(-1, dtype=torch.float32), lambda x: torch.ops.aten._softmax(x, -1, True)],
    ids=["dtype_float32", "half_to_float"],
)
def test_upcasting_softmax_is_softmax_with_dtype(softmax):
    """HF attention's softmax of bf16/fp16 scores computed in float32 is Softmax(dtype="float32");
    other dtype changes (here float32 -> float64) stay unmapped."""

    class M(nn.Module):
        def forward(self, x, y):
            return softmax(x), y.softmax(-1, dtype=torch.float64)

    ep = torch.export.export(M(), (torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(2, 3)))
    g = import_fx(ep)
    up = next(n for n in g.nodes if n.op == "Softmax")
    assert up.attrs == {"axis": -1, "dtype": "float32"} and up.outputs[0].dtype == "float32"
    assert sum(n.op == "Softmax" for n in g.nodes) == 1 and any(n.op == "aten::softmax" for n in g.nodes)
