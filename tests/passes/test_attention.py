"""Attention fusion on hand-built IR graphs: every form fires, every near miss is refused with its reason,
and the fused node's reference matches the original subgraph evaluated with torch.

Graphs are built eagerly (`_Builder` runs each op with torch as it is added), so every Value has its
real shape and the original outputs are known before the pass rewrites the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from tkopt.backends.onnx_model import export_onnx
from tkopt.frontends.onnx import import_onnx
from tkopt.fused_ops import run_reference
from tkopt.ir import FUSED_DOMAIN, Graph, Node, Value
from tkopt.onnx_runtime_ref import run_model
from tkopt.passes.attention import fuse_attention
from tkopt.passes.base import PassResult
from tkopt.passes.canonicalize import drop_identity, fold_constants
from tkopt.passes.pipeline import run_passes

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bool: "bool", torch.int64: "int64"}
TORCH = {v: k for k, v in DTYPES.items()}
NEG_INF = float("-inf")


def _expand(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return torch.broadcast_to(x, torch.broadcast_shapes(x.shape, tuple(shape)))


def _unsqueeze(x: torch.Tensor, axes: list[int]) -> torch.Tensor:
    for a in sorted(a + x.dim() + len(axes) if a < 0 else a for a in axes):
        x = x.unsqueeze(a)
    return x


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, **a: Any):
    scale = a.get("scale", 0.0)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=bool(a.get("is_causal", 0)), scale=scale or None,
        enable_gqa=bool(a.get("enable_gqa", 0)),
    )


OPS: dict[str, Callable[..., torch.Tensor]] = {
    "MatMul": lambda a, b, **_: a @ b,
    "Transpose": lambda x, perm, **_: x.permute(*perm),
    "Add": lambda a, b, **_: a + b,
    "Sub": lambda a, b, **_: a - b,
    "Mul": lambda a, b, **_: a * b,
    "Div": lambda a, b, **_: a / b,
    "Where": lambda c, a, b, **_: torch.where(c, a, b),
    "Not": lambda x, **_: ~x,
    "Softmax": lambda x, axis=-1, **_: torch.softmax(x, axis),
    "Cast": lambda x, to, **_: x.to(TORCH[to]),
    "Identity": lambda x, **_: x,
    "Dropout": lambda x, *rest, **_: x,
    "Unsqueeze": lambda x, axes, **_: _unsqueeze(x, axes),
    "Expand": lambda x, dims=None, shape=None, **_: _expand(x, dims.tolist() if dims is not None else shape),
    "Concat": lambda *xs, axis=0, **_: torch.cat(xs, axis),
    "Trilu": lambda x, upper=1, k=0, **_: torch.triu(x, k) if upper else torch.tril(x, k),
    "Reshape": lambda x, shape, **_: x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(shape)]),
    "Tile": lambda x, repeats, **_: x.repeat(*repeats),
    "Constant": lambda value, **_: torch.from_numpy(np.asarray(value)),
    "aten::repeat_interleave": lambda x, repeats, dim, **_: x.repeat_interleave(repeats, dim),
    "ScaledDotProductAttention": _sdpa,
    "IsNaN": lambda x, **_: torch.isnan(x),
    "Equal": lambda a, b, **_: a == b,
    "Shape": lambda x, start=0, end=None, **_: torch.tensor(x.shape[start:end], dtype=torch.int64),
    "Gather": lambda x, i, axis=0, **_: torch.index_select(x, axis, i.reshape(-1)).reshape(i.shape),
    "Sqrt": lambda x, **_: torch.sqrt(x),
    "Reciprocal": lambda x, **_: 1 / x,
    "aten::any": lambda x, dim, keepdim, **_: x.any(dim, keepdim=keepdim),
    "aten::full_like": lambda x, fill_value, **_: torch.full_like(x, fill_value),
    "Tanh": lambda x, **_: torch.tanh(x),
    "aten::baddbmm": lambda c, a, b, beta=1.0, alpha=1.0, **_: torch.baddbmm(c, a, b, beta=beta, alpha=alpha),
}


def _run(node: Node, ins: list[torch.Tensor | None]) -> torch.Tensor:
    if node.domain == FUSED_DOMAIN:
        return run_reference(node.op, ins, node.attrs)[0]
    if node.op == "Constant":
        return OPS["Constant"](**node.attrs)
    return OPS[node.op](*[t for t in ins], **node.attrs)


def evaluate(graph: Graph, feeds: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    env = dict(feeds)
    for n in graph.nodes:
        ins = [None if v is None else env[id(v)] if id(v) in env else torch.from_numpy(v.const) for v in n.inputs]
        env[id(n.outputs[0])] = _run(n, ins)
    return [env[id(v)] for v in graph.outputs]


class _Builder:
    """Builds a Graph while computing every value with torch (shapes come from the real tensors)."""

    def __init__(self) -> None:
        self.g = Graph("t")
        self.env: dict[int, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(0)

    def _value(self, name: str, t: torch.Tensor, const: bool = False) -> Value:
        v = Value(self.g.reserve(name), DTYPES[t.dtype], tuple(t.shape), const=t.numpy() if const else None)
        self.env[id(v)] = t
        return v

    def input(self, name: str, *shape: int) -> Value:
        v = self._value(name, torch.randn(*shape, generator=self.gen))
        self.g.inputs.append(v)
        return v

    def bool_input(self, name: str, *shape: int) -> Value:
        t = torch.rand(*shape, generator=self.gen) > 0.3
        t[..., 0] = True  # no fully masked row (those are NaN in torch, 0 in the reference)
        v = self._value(name, t)
        self.g.inputs.append(v)
        return v

    def const(self, name: str, data: Any) -> Value:
        return self._value(name, torch.as_tensor(np.asarray(data)), const=True)

    def op(self, op: str, *inputs: Value | None, **attrs: Any) -> Value:
        ins = [None if v is None else self.env[id(v)] for v in inputs]
        node = Node(op, list(inputs), [], attrs, name=self.g.fresh_name(op))
        out = self._value(self.g.fresh_name(op.lower().replace("::", "_")), _run(node, ins))
        node.outputs.append(out)
        self.g.add_node(node)
        return out

    def constant_node(self, data: Any) -> Value:
        return self.op("Constant", value=np.asarray(data, dtype=np.float32))

    def run(self, *outputs: Value) -> tuple[PassResult, list[Node]]:
        """Fuse, then check the rewritten graph computes what the original did."""
        self.g.outputs = list(outputs)
        want = [self.env[id(v)] for v in outputs]
        result = PassResult("attention")
        fuse_attention(self.g, result)
        got = evaluate(self.g, {id(v): self.env[id(v)] for v in self.g.inputs})
        for w, o in zip(want, got, strict=True):
            torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)
        return result, [n for n in self.g.nodes if n.op == "FusedAttention"]


# ---- building blocks -----------------------------------------------------------------------------
B, H, D = 2, 4, 8


def _qkv(b: _Builder, sq: int = 13, skv: int | None = None, hkv: int = H, dv: int = D) -> tuple[Value, Value, Value]:
    skv = sq if skv is None else skv
    return b.input("q", B, H, sq, D), b.input("k", B, hkv, skv, D), b.input("v", B, hkv, skv, dv)


def _attend(b: _Builder, scores: Value, v: Value, axis: int = -1) -> Value:
    return b.op("MatMul", b.op("Softmax", scores, axis=axis), v)


def _scores(b: _Builder, q: Value, k: Value) -> Value:
    return b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2]))


def _one(result: PassResult, fused: list[Node], **attrs: Any) -> Node:
    assert result.fused == 1 and len(fused) == 1, result.refusals
    node = fused[0]
    for key, want in attrs.items():
        got = node.attrs[key]
        assert (math.isclose(got, want, rel_tol=1e-6) if isinstance(want, float) else got == want), (key, got)
    return node


def _refused(result: PassResult, fused: list[Node], reason: str) -> None:
    assert result.fused == 0 and not fused
    assert any(reason in r.reason for r in result.refusals), [r.reason for r in result.refusals]


# ---- forms that fire -----------------------------------------------------------------------------
def test_div_after_qk_bhsd() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    out = _attend(b, b.op("Div", _scores(b, q, k), b.const("d", np.float32(math.sqrt(D)))), v)
    node = _one(*b.run(out), scale=1 / math.sqrt(D), causal=0, layout="bhsd")
    assert node.inputs == [q, k, v, None, None]  # no mask, and kept (the torch backend derives it)
    assert [n.op for n in b.g.nodes] == ["FusedAttention"]


def test_mul_after_qk_cross_lengths_padding_mask() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=7, skv=19, dv=5)
    mask = b.input("mask", B, 1, 1, 19)
    s = b.op("Mul", _scores(b, q, k), b.constant_node(0.3))
    node = _one(*b.run(_attend(b, b.op("Add", s, mask), v)), scale=0.3)
    assert node.inputs[3] is mask


def test_no_scale_means_one() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    _one(*b.run(_attend(b, _scores(b, q, k), v)), scale=1.0)


def test_scale_on_q_before() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    qs = b.op("Mul", q, b.const("c", np.float32(0.25)))
    node = _one(*b.run(_attend(b, _scores(b, qs, k), v)), scale=0.25)
    assert node.inputs[0] is q


def test_sqrt_scale_on_q_and_kt_dynamo_sdpa_form() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=5, skv=17)
    c = b.const("sqrt_scale", np.float32(math.sqrt(1 / math.sqrt(D))))
    kt = b.op("Mul", b.op("Transpose", k, perm=[0, 1, 3, 2]), c)
    scores = b.op("MatMul", b.op("Mul", q, c), kt)
    out = b.op("MatMul", b.op("Dropout", b.op("Softmax", scores, axis=-1)), v)
    node = _one(*b.run(out), scale=1 / math.sqrt(D))
    assert node.inputs[:3] == [q, k, v]


@pytest.mark.parametrize("fill", [NEG_INF, float(np.finfo(np.float32).min)])
def test_causal_additive_constant(fill: float) -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=21)
    causal = np.triu(np.full((21, 21), fill, np.float32), 1)
    causal[np.tril_indices(21)] = 0.0
    s = b.op("Div", _scores(b, q, k), b.const("d", np.float32(math.sqrt(D))))
    node = _one(*b.run(_attend(b, b.op("Add", s, b.const("causal", causal[None, None])), v)), causal=1)
    assert node.inputs[3] is None


@pytest.mark.parametrize("fill", [NEG_INF, float(np.finfo(np.float32).min)])
def test_causal_where_tril_buffer_plus_padding_mask_gpt2_form(fill: float) -> None:
    """A -inf causal Where beside a padding mask: causal=1 plus the mask. A finite (finfo.min) one is refused:
    a row whose earlier keys the padding all drops weighs the later keys in eager (tests/passes/
    test_attention_legality.py shows the difference)."""
    b = _Builder()
    q, k, v = _qkv(b, sq=11)
    tril = b.const("bias", np.tril(np.ones((11, 11), bool))[None, None])
    pad = b.input("pad", B, 1, 1, 11)
    s = b.op("Div", _scores(b, q, k), b.const("d", np.float32(math.sqrt(D))))
    s = b.op("Where", tril, s, b.const("minval", np.float32(fill)))
    result, fused = b.run(_attend(b, b.op("Add", s, pad), v))
    if fill == NEG_INF:
        assert _one(result, fused, causal=1).inputs[3] is pad
    else:
        _refused(result, fused, "causal mask bias fills with the finite -3.40282e+38 beside another mask")


@pytest.mark.parametrize("slope", [0.5, 2.0**110])
def test_finite_causal_fill_beside_a_bounded_bias(slope: float) -> None:
    """ALiBi (MPT): a bias of slopes times key positions beside a finfo.min causal Where. Bounded far below the
    fill, it is a bias and never masks a row: causal=1 plus the bias as the mask input. A bias as large as the
    fill could mask whole rows: refused as a padding mask is."""
    b = _Builder()
    q, k, v = _qkv(b, sq=11)
    tril = b.const("bias", np.tril(np.ones((11, 11), bool))[None, None])
    positions = b.op("Cast", b.const("pos", np.arange(-10, 1, dtype=np.int64).reshape(1, 1, 1, 11)), to="float32")
    alibi = b.op("Mul", positions, b.const("slopes", np.float32(slope) / 2.0 ** np.arange(1, H + 1, dtype=np.float32)
                                           .reshape(1, H, 1, 1)))
    s = b.op("Div", _scores(b, q, k), b.const("d", np.float32(math.sqrt(D))))
    s = b.op("Where", tril, s, b.const("minval", np.float32(np.finfo(np.float32).min)))
    result, fused = b.run(_attend(b, b.op("Add", s, alibi), v))
    if slope < 1:
        assert _one(result, fused, causal=1).inputs[3] is alibi
    else:
        _refused(result, fused, "causal mask bias fills with the finite -3.40282e+38 beside another mask")


def test_causal_from_computed_constant_is_absorbed() -> None:
    """A causal mask computed from constants (too large for canonicalize to fold) is evaluated, not read."""
    b = _Builder()
    q, k, v = _qkv(b, sq=9)
    ones = b.const("ones", np.ones((9, 9), bool))
    keep = b.op("Unsqueeze", b.op("Not", b.op("Not", b.const("tril", np.tril(np.ones((9, 9), bool))))), axes=[0, 1])
    keep = b.op("Where", ones, keep, ones)
    s = b.op("Where", keep, _scores(b, q, k), b.const("ninf", np.float32(NEG_INF)))
    _one(*b.run(_attend(b, s, v)), causal=1)
    assert [n.op for n in b.g.nodes] == ["FusedAttention"]


def test_causal_from_shapes_dynamic() -> None:
    """The exporters' causal mask from the sequence length (Trilu of ones sized by Shape(q)): evaluated at
    trial sizes for the symbolic dims, found causal, and not read by the fused node."""
    b = _Builder()
    q, k, v = _qkv(b, sq=10)
    s = b.op("Unsqueeze", b.op("Gather", b.op("Shape", q), b.const("i2", np.int64(2)), axis=0), axes=[0])
    ones = b.op("Expand", b.const("one", np.float32(1)), b.op("Concat", s, s, axis=0))
    zero, ninf = b.const("zero", np.float32(0)), b.const("ninf", np.float32(NEG_INF))
    causal = b.op("Where", b.op("Equal", b.op("Trilu", ones, upper=0), zero), ninf, zero)
    out = _attend(b, b.op("Add", _scores(b, q, k), causal), v)
    for x in (q, k, v):
        x.shape = ("batch", H, "seq", D)
    node = _one(*b.run(out), causal=1)
    assert node.inputs[3] is None


def test_not_causal_constant_stays_a_mask() -> None:
    """Bottom-right (KV-cache style) causal is not top-left causal: it becomes the mask input."""
    b = _Builder()
    q, k, v = _qkv(b, sq=4, skv=10)
    keep = b.const("keep", np.tril(np.ones((4, 10), bool), 6))
    s = b.op("Where", keep, _scores(b, q, k), b.const("ninf", np.float32(NEG_INF)))
    node = _one(*b.run(_attend(b, s, v)), causal=0)
    assert node.inputs[3] is keep


def test_bool_mask_where() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=6, skv=15)
    cond = b.bool_input("cond", B, 1, 6, 15)
    s = b.op("Where", cond, _scores(b, q, k), b.const("ninf", np.float32(NEG_INF)))
    node = _one(*b.run(_attend(b, s, v)))
    assert node.inputs[3] is cond


@pytest.mark.parametrize("negated", [True, False])
def test_masked_fill_form_keeps_where_the_mask_is_false(negated: bool) -> None:
    """Where(m, -inf, scores) (masked_fill): the mask input is m itself, mask_keeps=0 (m == 0 from a padding
    input, or Not(keep), need no new node)."""
    b = _Builder()
    q, k, v = _qkv(b)
    keep = b.bool_input("keep", B, 1, 1, 13)
    m = b.op("Not", keep) if negated else b.op("Equal", b.op("Cast", keep, to="float32"), b.const("z", np.float32(0)))
    s = b.op("Where", m, b.const("ninf", np.float32(NEG_INF)), _scores(b, q, k))
    node = _one(*b.run(_attend(b, s, v)), mask_keeps=0)
    assert node.inputs[3] is m


def test_casts_around_softmax_llama_form() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Cast", b.op("Mul", _scores(b, q, k), b.const("c", np.float32(0.125))), to="float64")
    p = b.op("Cast", b.op("Softmax", s, axis=3), to="float32")
    _one(*b.run(b.op("MatMul", p, v)), scale=0.125)


def _bshd(b: _Builder, sq: int = 10, skv: int | None = None, hkv: int = H) -> tuple[Value, Value, Value]:
    skv = sq if skv is None else skv
    return b.input("q", B, sq, H, D), b.input("k", B, skv, hkv, D), b.input("v", B, skv, hkv, D)


def test_bshd_direct_k_perm() -> None:
    b = _Builder()
    q, k, v = _bshd(b, sq=10, skv=23)
    s = b.op("MatMul", b.op("Transpose", q, perm=[0, 2, 1, 3]), b.op("Transpose", k, perm=[0, 2, 3, 1]))
    o = _attend(b, b.op("Mul", s, b.const("c", np.float32(0.2))), b.op("Transpose", v, perm=[0, 2, 1, 3]))
    out = b.op("Reshape", b.op("Transpose", o, perm=[0, 2, 1, 3]), shape=[B, 10, H * D])
    node = _one(*b.run(out), layout="bshd", scale=0.2)
    assert node.inputs[:3] == [q, k, v]
    assert [n.op for n in b.g.nodes] == ["FusedAttention", "Reshape"]


def test_bshd_composed_k_transposes() -> None:
    b = _Builder()
    q, k, v = _bshd(b)
    kt = b.op("Transpose", b.op("Transpose", k, perm=[0, 2, 1, 3]), perm=[0, 1, 3, 2])
    s = b.op("MatMul", b.op("Transpose", q, perm=[0, 2, 1, 3]), kt)
    o = _attend(b, s, b.op("Transpose", v, perm=[0, 2, 1, 3]))
    node = _one(*b.run(b.op("Transpose", o, perm=[0, 2, 1, 3])), layout="bshd")
    assert node.inputs[:3] == [q, k, v]


def test_bshd_transpose_used_elsewhere_falls_back_to_bhsd() -> None:
    """The K cache (B,H,S,D) is also returned (GPT-2 `present`): that transpose stays, layout bhsd."""
    b = _Builder()
    q, k, v = _bshd(b)
    kb = b.op("Transpose", k, perm=[0, 2, 1, 3])
    s = b.op("MatMul", b.op("Transpose", q, perm=[0, 2, 1, 3]), b.op("Transpose", kb, perm=[0, 1, 3, 2]))
    o = _attend(b, s, b.op("Transpose", v, perm=[0, 2, 1, 3]))
    out = b.op("Transpose", o, perm=[0, 2, 1, 3])
    node = _one(*b.run(out, kb), layout="bhsd")
    assert node.inputs[1] is kb


def _repeat_kv(b: _Builder, x: Value, g: int) -> Value:
    """HF repeat_kv: x[:, :, None].expand(B, Hkv, g, S, D).reshape(B, Hkv * g, S, D)."""
    bb, hkv, s, d = x.shape  # type: ignore[misc]
    e = b.op("Expand", b.op("Unsqueeze", x, axes=[2]), shape=[bb, hkv, g, s, d])
    return b.op("Reshape", e, shape=[bb, hkv * g, s, d])


def test_gqa_expand_reshape_llama_form() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=7, skv=7, hkv=2)
    s = b.op("Mul", _scores(b, q, _repeat_kv(b, k, 2)), b.const("c", np.float32(1 / math.sqrt(D))))
    mask = b.input("mask", B, 1, 7, 7)
    node = _one(*b.run(_attend(b, b.op("Add", s, mask), _repeat_kv(b, v, 2))))
    assert node.inputs == [q, k, v, mask, None]  # kept: the torch backend derives it
    assert k.shape[1] == 2


def test_gqa_repeat_interleave_fx_form() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=9, skv=14, hkv=1)
    kr = b.op("aten::repeat_interleave", k, repeats=4, dim=1)
    vr = b.op("aten::repeat_interleave", v, repeats=4, dim=1)
    node = _one(*b.run(_attend(b, _scores(b, q, kr), vr)))
    assert node.inputs[:3] == [q, k, v]


def test_sdpa_canonical_node() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=6, skv=11)
    mask = b.input("mask", B, 1, 6, 11)
    out = b.op("ScaledDotProductAttention", q, k, v, mask, scale=0.0, is_causal=0, enable_gqa=0)
    node = _one(*b.run(out), scale=0.0, causal=0, layout="bhsd", guard="masked")
    assert node.inputs == [q, k, v, mask, None]  # kept: the torch backend derives it


def test_sdpa_bshd_gqa_causal() -> None:
    b = _Builder()
    q, k, v = _bshd(b, sq=17, hkv=2)
    t = [b.op("Transpose", x, perm=[0, 2, 1, 3]) for x in (q, k, v)]
    o = b.op("ScaledDotProductAttention", *t, None, scale=0.5, is_causal=1, enable_gqa=1)
    # no mask: guard "sdpa", as torch's CPU flash kernel zeroes a row of NaN scores only then
    node = _one(*b.run(b.op("Transpose", o, perm=[0, 2, 1, 3])), scale=0.5, causal=1, layout="bshd", guard="sdpa")
    assert node.inputs == [q, k, v, None, None]  # no mask, and kept (the torch backend derives it)


def test_sdpa_bool_mask() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=5, skv=13)
    mask = b.bool_input("mask", 5, 13)
    node = _one(*b.run(b.op("ScaledDotProductAttention", q, k, v, mask)))
    assert node.inputs[3] is mask


# ---- near misses ---------------------------------------------------------------------------------
def test_refuse_k_not_transposed() -> None:
    b = _Builder()
    q, _, v = _qkv(b)
    kt = b.input("kt", B, H, D, 13)  # already (B,H,D,S): there is no K to give the kernel
    _refused(*b.run(_attend(b, b.op("MatMul", q, kt), v)), "not a swap of its last two axes")


@pytest.mark.parametrize(("perm", "shape"), [([0, 3, 1, 2], (B, D, 13, H)), ([1, 0, 3, 2], (H, B, 13, D))])
def test_refuse_k_other_permutation(perm: list[int], shape: tuple[int, ...]) -> None:
    b = _Builder()
    q, _, v = _qkv(b)
    kt = b.op("Transpose", b.input("kx", *shape), perm=perm)
    _refused(*b.run(_attend(b, b.op("MatMul", q, kt), v)), f"net permutations from its producers: [0, 1, 2, 3], {perm}")


def test_refuse_softmax_other_axis() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    _refused(*b.run(_attend(b, _scores(b, q, k), v, axis=2)), "softmax over axis 2, not the last")


def test_refuse_mask_after_softmax() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    p = b.op("Add", b.op("Softmax", _scores(b, q, k), axis=-1), b.input("mask", B, 1, 13, 13))
    _refused(*b.run(b.op("MatMul", p, v)), "a mask added after softmax")


def test_refuse_logit_soft_capping() -> None:
    """Gemma 2: tanh(scores / cap) * cap before the mask. No FusedAttention computes it: refused, saying why."""
    b = _Builder()
    q, k, v = _qkv(b)
    capped = b.op("Mul", b.op("Tanh", b.op("Div", _scores(b, q, k), b.const("cap", np.float32(50.0)))),
                  b.const("cap2", np.float32(50.0)))
    _refused(*b.run(_attend(b, b.op("Add", capped, b.input("mask", B, 1, 13, 13)), v)),
             "attention logit soft-capping (Tanh")


def test_refuse_alibi_inside_baddbmm() -> None:
    """Bloom: Q·K^T as baddbmm(alibi, q, k^T) on (B*H, S, D), reshaped to 4-D, then masked."""
    b = _Builder()
    q3, kt3, v = b.input("q", B * H, 13, D), b.input("kt", B * H, D, 13), b.input("v", B, H, 13, D)
    scores = b.op("aten::baddbmm", b.input("alibi", B * H, 1, 13), q3, kt3, beta=1.0, alpha=0.25)
    s4 = b.op("Reshape", scores, shape=[B, H, 13, 13])
    _refused(*b.run(_attend(b, b.op("Add", s4, b.input("mask", B, 1, 13, 13)), v)),
             "Q·K^T is aten::baddbmm aten::baddbmm_0, a batched matmul with a bias added inside it (ALiBi")


def test_refuse_scale_inside_the_bmm_form() -> None:
    """DeBERTa: K flattened to 3-D, transposed, then divided by the scale before the bmm."""
    b = _Builder()
    q, k, v = _qkv(b)
    q3 = b.op("Reshape", q, shape=[B * H, 13, D])
    kt3 = b.op("Div", b.op("Transpose", b.op("Reshape", k, shape=[B * H, 13, D]), perm=[0, 2, 1]),
               b.const("scale", np.float32(math.sqrt(D))))
    s3 = b.op("MatMul", q3, kt3)
    s4 = b.op("Reshape", s3, shape=[B, H, 13, 13])
    mm = b.g.nodes[-2].name
    _refused(*b.run(_attend(b, s4, v)), f"Q·K^T is the 3-D MatMul {mm} whose operands {kt3.name} (from Div)")


def test_softmax_that_is_not_attention_gets_no_reason() -> None:
    """A classifier's softmax (2-D), and a 3-D one that no matmul reads: not attention, no refusal."""
    b = _Builder()
    x = b.input("x", B, 13, D)
    logits = b.op("MatMul", b.input("h", B, D), b.input("w", D, 5))
    result, fused = b.run(b.op("Softmax", logits, axis=-1), b.op("Softmax", b.op("MatMul", x, b.input("w2", D, 7))))
    assert result.fused == 0 and not result.refusals


def test_unscaled_with_scale_on_v_keeps_it_outside() -> None:
    """Unscaled attention (T5) whose V is scaled: scale 1, and the Mul on V stays a node of its own."""
    b = _Builder()
    q, k, v = _qkv(b)
    vs = b.op("Mul", v, b.const("c", np.float32(0.35)))
    node = _one(*b.run(_attend(b, _scores(b, q, k), vs)), scale=1.0)
    assert node.inputs[2] is vs


def test_unscaled_with_scale_on_output_keeps_it_outside() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    out = b.op("Div", _attend(b, _scores(b, q, k), v), b.const("c", np.float32(2.8)))
    _one(*b.run(out), scale=1.0)
    assert [n.op for n in b.g.nodes] == ["FusedAttention", "Div"]


def test_refuse_scores_used_elsewhere() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Mul", _scores(b, q, k), b.const("c", np.float32(0.3)))
    _refused(*b.run(_attend(b, s, v), s), f"attention scores {s.name} are also used by the graph output")


def test_refuse_probs_returned() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    p = b.op("Softmax", _scores(b, q, k), axis=-1)
    _refused(*b.run(b.op("MatMul", p, v), p), f"attention probabilities {p.name} are also used")


def test_refuse_mask_not_broadcastable() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=1, skv=13)  # a (13, 1) mask broadcasts the scores up to (B, H, 13, 13)
    s = b.op("Add", _scores(b, q, k), b.input("mask", 13, 1))
    _refused(*b.run(_attend(b, s, v)), "its axis 0 is neither 1 nor the scores' 1")


def test_refuse_training_dropout() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    p = b.op("Softmax", _scores(b, q, k), axis=-1)
    d = b.op("Dropout", p, b.const("ratio", np.float32(0.1)), b.const("train", np.array(True)))
    _refused(*b.run(b.op("MatMul", d, v)), "active (training mode)")


def test_refuse_sdpa_dropout() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    node_out = b.op("ScaledDotProductAttention", q, k, v, None, is_causal=1)
    b.g.nodes[-1].attrs["dropout_p"] = 0.1
    _refused(*b.run(node_out), "dropout_p=0.1")


def test_where_fill_zero_is_reproduced() -> None:
    """Where(c, scores, 0): masked scores are 0, not -inf; FusedAttention's mask_fill says so."""
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Where", b.bool_input("c", B, 1, 1, 13), _scores(b, q, k), b.const("zero", np.float32(0)))
    _one(*b.run(_attend(b, s, v)), mask_fill=0.0)


@pytest.mark.parametrize("after_softmax", [False, True])
def test_refuse_integer_cast_of_scores_or_probabilities(after_softmax: bool) -> None:
    """Cast to int64 and back truncates: not a precision change the fused op could absorb."""
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Mul", _scores(b, q, k), b.const("c", np.float32(3.0)))
    if not after_softmax:
        s = b.op("Cast", b.op("Cast", s, to="int64"), to="float32")
    p = b.op("Softmax", s, axis=-1)
    if after_softmax:
        p = b.op("Cast", b.op("Cast", p, to="int64"), to="float32")
    _refused(*b.run(b.op("MatMul", p, v)), "to int64")


def test_refuse_float32_softmax_in_a_float64_graph() -> None:
    """F.softmax(dtype=float32) in a float64 model, as the exporters write it (Cast down, Softmax, Cast
    back): the fused op would keep float64 scores, 1e-8 off the graph's float32 probabilities."""
    b = _Builder()
    q, k, v = (b.op("Cast", x, to="float64") for x in _qkv(b))
    p = b.op("Cast", b.op("Softmax", b.op("Cast", _scores(b, q, k), to="float32"), axis=-1), to="float64")
    _refused(*b.run(b.op("MatMul", p, v)), "casts to float32, rounding the float64 attention scores")


def test_refuse_two_masks() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Add", b.op("Add", _scores(b, q, k), b.input("m1", B, 1, 1, 13)), b.input("m2", 1, 1, 13, 13))
    _refused(*b.run(_attend(b, s, v)), "more than one mask that is not provably causal (m1, m2)")


def test_scale_after_additive_mask_scales_the_mask() -> None:
    """(S + M) * c: the mask is scaled too, and after it is added (scale 1, mask_scale c), not S * c + M."""
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Mul", b.op("Add", _scores(b, q, k), b.input("m", B, 1, 1, 13)), b.const("c", np.float32(0.3)))
    _one(*b.run(_attend(b, s, v)), scale=1.0, mask_scale=0.3)


def test_scales_around_an_additive_mask_fold_in_order() -> None:
    """(S * a + M) * b: scale a, then the sum scaled by b (mask_scale), in the graph's order."""
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Mul", _scores(b, q, k), b.const("a", np.float32(0.5)))
    s = b.op("Div", b.op("Add", s, b.input("m", B, 1, 1, 13)), b.const("c", np.float32(4.0)))
    _one(*b.run(_attend(b, s, v)), scale=0.5, mask_scale=0.25)


def test_refuse_mask_scaled_by_a_negative_factor() -> None:
    """(-S + M) * -0.1: positive overall, but the mask flips sign (-inf becomes +inf): not a mask any more."""
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Add", b.op("Mul", _scores(b, q, k), b.const("n", np.float32(-1))), b.input("m", B, 1, 1, 13))
    _refused(*b.run(_attend(b, b.op("Mul", s, b.const("c", np.float32(-0.1))), v)), "its fill changes sign")


def test_refuse_finite_where_after_causal_mask() -> None:
    """Where(keep, S + causal, -1e4): the Where's finite fill replaces the causal -inf where keep is False."""
    b = _Builder()
    q, k, v = _qkv(b, sq=9)
    causal = np.triu(np.full((9, 9), NEG_INF, np.float32), 1)
    s = b.op("Add", _scores(b, q, k), b.const("causal", causal))
    s = b.op("Where", b.bool_input("keep", B, 1, 1, 9), s, b.const("f", np.float32(-1e4)))
    _refused(*b.run(_attend(b, s, v)), "after the causal mask causal overwrites its -inf with the finite -10000")


@pytest.mark.parametrize("form", ["tile", "expand_tile_order"])
def test_gqa_tile_semantics_not_absorbed(form: str) -> None:
    """Tile order (h reads h % Hkv) is not GQA: refused as such; the repeated K/V are used as they are."""
    b = _Builder()
    q, k, v = _qkv(b, hkv=2)

    def rep(x: Value) -> Value:
        if form == "tile":
            return b.op("Tile", x, repeats=[1, 2, 1, 1])
        e = b.op("Expand", b.op("Unsqueeze", x, axes=[1]), shape=[B, 2, 2, 13, D])
        return b.op("Reshape", e, shape=[B, 4, 13, D])

    kr, vr = rep(k), rep(v)
    result, fused = b.run(_attend(b, _scores(b, q, kr), vr))
    node = _one(result, fused)
    assert node.inputs[1] is kr and node.inputs[2] is vr
    assert any("tile semantics" in r.reason for r in result.refusals)


def test_not_attention_is_silent() -> None:
    b = _Builder()
    x = b.input("x", 3, 10)
    out = b.op("MatMul", b.op("Softmax", b.op("MatMul", x, b.input("w", 10, 10)), axis=-1), b.input("w2", 10, 4))
    result, fused = b.run(out)
    assert result.fused == 0 and not result.refusals


# ---- exporter and decomposition forms ------------------------------------------------------------
def _bmm(b: _Builder, a4: Value, b4: Value) -> Value:
    """Decomposed FX 4-D matmul: expand (no-op), view to 3-D, bmm, view back."""
    (bb, h, m, k), n = a4.shape, b4.shape[3]  # type: ignore[misc]
    a3 = b.op("Reshape", b.op("Expand", a4, shape=list(a4.shape)), shape=[bb * h, m, k])
    b3 = b.op("Reshape", b.op("Expand", b4, shape=list(b4.shape)), shape=[bb * h, k, n])
    return b.op("Reshape", b.op("MatMul", a3, b3), shape=[bb, h, m, n])


def test_decomposed_fx_bmm_form() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=9, skv=12)
    s = b.op("Mul", _bmm(b, q, b.op("Transpose", k, perm=[0, 1, 3, 2])), b.const("c", np.float32(0.3)))
    node = _one(*b.run(_bmm(b, b.op("Softmax", s, axis=-1), v)), scale=0.3)
    assert node.inputs[:3] == [q, k, v] and [n.op for n in b.g.nodes] == ["FusedAttention"]


def test_dynamo_3d_k_transpose_form() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=6, skv=10)
    kt = b.op("Reshape", b.op("Transpose", b.op("Reshape", k, shape=[-1, 10, D]), perm=[0, 2, 1]), shape=[B, H, D, 10])
    node = _one(*b.run(_attend(b, b.op("MatMul", q, kt), v)), scale=1.0)
    assert node.inputs[1] is k


def test_dynamo_nan_guard_after_softmax() -> None:
    """Where(IsNaN(p), 0, p) is FusedAttention's own definition for fully masked rows: absorbed."""
    b = _Builder()
    q, k, v = _qkv(b)
    zero, ninf = b.const("z", np.float32(0)), b.const("n", np.float32(NEG_INF))
    m = b.op("Where", b.bool_input("keep", B, 1, 13, 13), zero, ninf)
    p = b.op("Softmax", b.op("Add", _scores(b, q, k), m), axis=-1)
    p = b.op("Where", b.op("IsNaN", p), b.const("zero", np.float32(0)), p)
    node = _one(*b.run(b.op("MatMul", p, v)))
    assert node.inputs[3] is m


def test_decomposed_sdpa_row_guard() -> None:
    b = _Builder()
    q, k, v = _qkv(b)
    s = b.op("Add", _scores(b, q, k), b.input("mask", B, 1, 1, 13))
    p = b.op("Softmax", s, axis=-1)
    empty = b.op("Not", b.op("aten::any", b.op("Not", b.op("Equal", s, b.const("ninf", np.float32(NEG_INF)))),
                                dim=-1, keepdim=True))
    p = b.op("Where", empty, b.op("aten::full_like", p, fill_value=0), p)
    _one(*b.run(b.op("MatMul", p, v)))
    assert [n.op for n in b.g.nodes] == ["FusedAttention"]


def test_scale_from_symbolic_shape() -> None:
    """The TorchScript exporter's 1/sqrt(head_dim) from Shape(q): evaluated though batch/seq are symbolic."""
    b = _Builder()
    q, k, v = _qkv(b)
    d = b.op("Gather", b.op("Shape", q), b.const("i3", np.int64(3)), axis=0)
    c = b.op("Reciprocal", b.op("Sqrt", b.op("Cast", d, to="float32")))
    out = _attend(b, b.op("Mul", _scores(b, q, k), c), v)
    for x in (q, k, v):
        x.shape = ("batch", H, "seq", D)
    _one(*b.run(out), scale=1 / math.sqrt(D))
    assert [n.op for n in b.g.nodes] == ["FusedAttention"]


def test_gqa_symbolic_shapes() -> None:
    b = _Builder()
    q, k, v = _qkv(b, sq=5, hkv=2)
    kr, vr = _repeat_kv(b, k, 2), _repeat_kv(b, v, 2)
    q.shape = ("batch", H, "seq", D)
    for x in (k, v):
        x.shape = ("batch", 2, "seq", D)
    for x in (kr, vr):
        x.shape = ("batch", H, "seq", D)
        reshape = b.g.producer(x)
        reshape.attrs["shape"] = [0, H, -1, D]  # type: ignore[union-attr]
        expand = b.g.producer(reshape.inputs[0])  # type: ignore[union-attr]
        expand.outputs[0].shape = ("batch", 2, 2, "seq", D)  # type: ignore[union-attr]
        expand.attrs["shape"] = ["batch", 2, 2, "seq", D]  # type: ignore[union-attr]
        expand.inputs[0].shape = ("batch", 2, 1, "seq", D)  # type: ignore[union-attr]
    node = _one(*b.run(_attend(b, _scores(b, q, kr), vr)))
    assert node.inputs[1:3] == [k, v]


# ---- real exports ----------------------------------------------------------------------------------
class _SdpaBlock(torch.nn.Module):
    """Q, K, V heads split from one input; SDPA with a padding mask; heads merged back."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bb, s, _ = x.shape
        q, k, v = (t.view(bb, s, H, D).transpose(1, 2) for t in (x, x * 0.5, x - 1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return o.transpose(1, 2).reshape(bb, s, H * D)


class _RepeatKV(torch.nn.Module):
    """Llama's attention as transformers writes it: K/V heads repeated by `x[:, :, None, :, :].expand(...).reshape`
    (repeat_kv), then SDPA, causal."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, hkv, s, d = k.shape
        k, v = (t[:, :, None, :, :].expand(b, hkv, 2, s, d).reshape(b, hkv * 2, s, d) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_export_repeat_kv_is_gqa(dynamic: bool) -> None:
    """A dynamic export keeps repeat_kv's full slices (`t[:, :, None, :, :]`) that a static one drops: they are
    dropped as no-ops (canonicalize.drop_identity), and the attention reads the K/V heads unrepeated, as GQA. They
    hid the repeat, and the Llama-style model served at 1x8192 ran its attention on K/V repeated 4x."""
    from torch.export import Dim

    from tkopt.frontends.fx import import_fx

    q, k, v = torch.randn(1, 4, 9, D), torch.randn(1, 2, 9, D), torch.randn(1, 2, 9, D)
    seq = {2: Dim.AUTO}
    ep = torch.export.export(_RepeatKV(), (q, k, v), dynamic_shapes=(seq, seq, seq) if dynamic else None)
    if dynamic:
        assert any(n.target == torch.ops.aten.slice.Tensor for n in ep.graph.nodes)
    graph = import_fx(ep)
    run_passes(graph, ())
    [node] = [n for n in graph.nodes if n.op == "FusedAttention"]
    assert [x.shape[1] for x in node.inputs[:3]] == [4, 2, 2]
    got = run_reference(node.op, [q, k, v, None], node.attrs)[0]
    torch.testing.assert_close(got, _RepeatKV()(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_export_sdpa_block(dynamo: bool, tmp_path) -> None:
    x, mask = torch.randn(2, 11, H * D), torch.rand(2, 11) > 0.3
    mask[:, 0] = True
    path = tmp_path / "m.onnx"
    torch.onnx.export(_SdpaBlock(), (x, mask), str(path), dynamo=dynamo, input_names=["x", "mask"],
                      dynamic_axes=None if dynamo else {"x": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}},
                      dynamic_shapes=({0: "b", 1: "s"}, {0: "b", 1: "s"}) if dynamo else None)
    g = import_onnx(path)
    for fn in (fold_constants, drop_identity):
        fn(g, PassResult("canonicalize"))
    result = PassResult("attention")
    fuse_attention(g, result)
    assert result.fused == 1, result.refusals
    feeds = {"x": x.numpy(), "mask": mask.numpy()}
    want, got = run_model(onnx.load(path), feeds), run_model(export_onnx(g), feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("disable", [(), ("attention",)])
def test_pipeline_switch(disable: tuple[str, ...]) -> None:
    """The user-facing switch "attention" turns the whole family off."""
    b = _Builder()
    q, k, v = _qkv(b)
    b.g.outputs = [_attend(b, b.op("Div", _scores(b, q, k), b.const("d", np.float32(math.sqrt(D)))), v)]
    report = run_passes(b.g, disable)
    fused = [n for n in b.g.nodes if n.op == "FusedAttention"]
    assert len(fused) == report.fusions.get("attention", 0) == (0 if disable else 1)
