"""Attention fusion: softmax(Q K^T * scale + mask [causal]) V, decomposed or canonical, -> FusedAttention.

Two anchors. A decomposed attention is found from its Softmax: backwards through the scores chain
(scale Mul/Div, additive-mask Add, Where(cond, scores, fill) and masked_fill masks, Casts) to Q·K^T,
forwards through Casts, eval-mode Dropout and the guards that zero fully masked rows (decomposed
SDPA's row guard, the dynamo exporter's NaN guard) to ·V. Either MatMul may be the decomposed-FX bmm
form (Reshape to 3-D, bmm, Reshape back), or an einsum that is a 4-D batched matmul ("bhqd,bhkd->bhqk"
reads K as K^T: einsum_matmul). A ScaledDotProductAttention node (aten.scaled_dot_product_
attention) is converted directly. In both, the Q/K/V operands are then "peeled": single-use Transposes
(permutations composed, the net effect checked exactly; also dynamo's 3-D K^T), scale Muls on Q and K,
and the GQA head repeat of K/V (repeat_interleave semantics only) are absorbed, and BSHD inputs with a
transposed-back output become layout "bshd".

The fused node reproduces the chain's arithmetic (docs/LEGALITY.md): the chain is folded in order, so
a scale after a mask scales it (mask_scale), a Where's fill is kept (mask_fill, finite or not) with
which of its condition's values keeps (mask_keeps: False for masked_fill's mask), and the guard says
what a fully masked row gives. A mask proven causal from its structure (tkopt/passes/masks.py),
for every admitted length, becomes causal=1; any other mask becomes the mask input, its producers
staying outside. Q, K, V, the mask and the output must provably share batch, heads and lengths the
way the kernels read them (tkopt/passes/shapes.py).

Dynamic-shape exports are matched with symbolic shapes. ONNX graphs only: Shape reads of absorbed
per-head tensors are rewritten onto the fused node's inputs/output, and a K that exists only as
(B,S,H,D) next to BHSD Q/V/output gets a Transpose (the torch backend re-emits original nodes only,
so FX graphs never get new nodes).

Anything that only looks like attention is refused with the reason (see the tests for each), and so is a
Softmax neither pattern reaches that sits between two matmuls (`_near_miss`: logit soft-capping, ALiBi
inside baddbmm, an op the chains do not follow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from tkopt.fused_ops import FLOAT_DTYPES
from tkopt.ir import Graph, Node, Value

from .base import FusionError, PassResult, fuse
from .masks import MaskAnalysis, aligned, keeps_all, magnitude_bound, prove_causal, split_mask
from .patterns import norm_axes, norm_axis
from .pipeline import register
from .shapes import LOCAL_EVALUATORS, Shape, ShapedIndex, as_int, einsum_terms, same

IDENT = (0, 1, 2, 3)
SWAP = (0, 1, 3, 2)  # K^T from a BHSD K
BSHD = (0, 2, 1, 3)  # BHSD from BSHD, and back
BSHD_KT = (0, 2, 3, 1)  # K^T from a BSHD K
PASS_THROUGH = ("Identity", "aten::clone", "aten::contiguous", "aten::alias")
CHAIN_OPS = ("Cast", "Identity", "Add", "Mul", "Div", "Where", "aten::masked_fill")


class _Miss(Exception):
    """Not matched by the patterns: skipped silently unless `_near_miss` shows it is an attention."""


class _Refuse(Exception):
    """An attention near miss: the message is the reason."""


class _View(ShapedIndex):
    """The graph with producers and users indexed (rebuilt after every fusion), plus constants."""

    def __init__(self, graph: Graph) -> None:
        super().__init__(graph)
        self.masks = MaskAnalysis(self, self.shapes)
        self.pending: dict[int, Node] = {}  # id(Value) -> the node to add if a fusion takes that value

    def only_user(self, v: Value, node: Node) -> bool:
        return self.sole_user(v) is node

    def shape_readers(self, v: Value, node: Node) -> list[Node] | None:
        """The Shape nodes reading `v` besides `node`, when those are its only other readers.

        ONNX exports read shapes of the per-head tensors (to size masks and reshapes). Such a read
        of a value the fusion absorbs is rewritten as a Shape of the value it is a permutation of
        (`_rewrite_shape_reads`): ONNX graphs only, as the torch backend re-emits original nodes only.
        """
        users = self.users(v)
        if node not in users or self.is_output(v) or sum(1 for i in node.inputs if i is v) != 1:
            return None
        others = [u for u in users if u is not node]
        if others and (self.graph.meta.get("onnx_model") is None or any(u.op != "Shape" for u in others)):
            return None
        return others

    def other_user(self, v: Value, node: Node) -> str:
        others = [u.name for u in self.users(v) if u is not node]
        return others[0] if others else "the graph output"

    def const(self, v: Value | None) -> np.ndarray | None:
        """The data of `v` if it is constant or computed from constants and shapes only.

        Canonicalize folds small constant subgraphs with static shapes; causal masks are often
        larger than its limit and scales often come from a symbolic shape, so both are evaluated here.
        """
        return self.shapes.const(v)

    def scalar(self, v: Value | None) -> float | None:
        return self.shapes.scalar(v)


def _compose(net: tuple[int, ...], perm: list[int]) -> tuple[int, ...]:
    """operand = permute(y, net) and y = permute(x, perm)  =>  operand = permute(x, result)."""
    return tuple(perm[i] for i in net)


def _dims_equal(a: object, b: object) -> bool:
    return a is not None and a == b


def _shape_str(v: Value) -> str:
    return "?" if v.shape is None else "(" + ", ".join(str(d) for d in v.shape) + ")"


# ---- GQA head repeat ----------------------------------------------------------------------------
def _strip(view: _View, v: Value, reader: Node, nodes: list[Node]) -> Value:
    """Walk back from `v` through single-use no-op nodes (Identity, clone), collecting them."""
    while True:
        p = view.producer(v)
        if p is None or p.op not in PASS_THROUGH or not view.only_user(v, reader):
            return v
        nodes.append(p)
        v, reader = p.inputs[0], p


def _unsqueeze_expand(view: _View, v: Value, reader: Node, nodes: list[Node]) -> tuple[Value, int, int, Shape] | None:
    """v = Expand(Unsqueeze(x, a)) broadcasting only the new axis a (5-D), read by `reader`:
    (x, a, reps, expanded shape), the nodes appended to `nodes`."""
    x5 = _strip(view, v, reader, nodes)
    exp = view.producer(x5)
    if exp is None or exp.op != "Expand" or not view.only_user(x5, nodes[-1]):
        return None
    nodes.append(exp)
    u_out = _strip(view, exp.inputs[0], exp, nodes)
    unsq = view.producer(u_out)
    if unsq is None or unsq.op != "Unsqueeze" or not view.only_user(u_out, nodes[-1]):
        return None
    nodes.append(unsq)
    x = unsq.inputs[0]
    axes = norm_axes(unsq.attrs.get("axes"), 5)
    src, exp_shape = view.shapes.shape(u_out), view.shapes.shape(x5)
    if x.rank != 4 or not axes or len(axes) != 1 or src is None or exp_shape is None:
        return None
    if len(src) != 5 or len(exp_shape) != 5:
        return None
    a = axes[0]
    if any(i != a and not same(src[i], exp_shape[i]) for i in range(5)):  # only the new axis broadcasts
        return None
    g = as_int(exp_shape[a])
    return None if g is None else (x, a, g, exp_shape)


def _expand_repeat(view: _View, reshape: Node) -> tuple[Value, int, int, int, list[Node]] | None:
    """Reshape(Expand(Unsqueeze(x, a))) folding the new axis into a neighbour: (x, a, merged lo, reps, nodes).

    The reshape merges 5-D axes (lo, lo + 1), one of which is the new axis a. The caller decides
    what that means: new axis right after the head axis is repeat_interleave (head h reads h // g),
    right before it is tile (h reads h % Hkv).
    """
    nodes = [reshape]
    found = _unsqueeze_expand(view, reshape.inputs[0], reshape, nodes)  # type: ignore[arg-type]
    out = view.shapes.shape(reshape.outputs[0])
    if found is None or out is None or len(out) != 4:
        return None
    x, a, g, exp_shape = found
    # The reshape merges axis a with a neighbour (a+1 -> tile order, a-1 -> interleave order).
    for lo in (a - 1, a):
        if lo < 0 or lo + 1 > 4:
            continue
        rest = [*exp_shape[:lo], *exp_shape[lo + 2:]]
        keep = all(same(o, r) for o, r in zip([*out[:lo], *out[lo + 1:]], rest, strict=True))
        if keep and same(out[lo], exp_shape[lo] * exp_shape[lo + 1]):
            return x, a, lo, g, nodes
    return None


def _swap_via_3d(view: _View, r2: Node) -> tuple[Value, list[Node], int] | None:
    """Reshape(Transpose(Reshape(x, (B*H, S, D)), [0, 2, 1]), (B, H, D, S)): x with its last two axes
    swapped, as the dynamo exporter writes K^T for SDPA. Proven on symbolic shapes: (source, nodes, group).

    With static GQA shapes the first Reshape reads the head repeat itself, Expand(Unsqueeze(k, 2)) of shape
    (B, Hkv, g, S, D) flattened to (B*Hkv*g, S, D): repeat_interleave order, so the source is k, group g."""
    nodes = [r2]
    t_out = _strip(view, r2.inputs[0], r2, nodes)
    t = view.producer(t_out)
    if t is None or t.op != "Transpose" or list(t.attrs.get("perm") or ()) != [0, 2, 1]:
        return None
    if not view.only_user(t_out, nodes[-1]):
        return None
    nodes.append(t)
    r1_out = _strip(view, t.inputs[0], t, nodes)
    r1 = view.producer(r1_out)
    if r1 is None or r1.op != "Reshape" or not view.only_user(r1_out, nodes[-1]):
        return _split_3d_source(view, r1_out, r2, nodes)
    x, group = r1.inputs[0], 1
    xs, s1, s2 = view.shapes.shape(x), view.shapes.shape(r1_out), view.shapes.shape(r2.outputs[0])
    if xs is not None and len(xs) == 5:  # the GQA repeat, flattened with the batch
        repeat = [r1]
        found = _unsqueeze_expand(view, x, r1, repeat)  # type: ignore[arg-type]
        if found is None or found[1] != 2:  # not repeat_interleave order: K as the exporter folded it
            return _split_3d_source(view, r1_out, r2, nodes)
        x, group, e = found[0], found[2], found[3]
        xs = (e[0], e[1] * group, e[3], e[4])
        nodes += repeat
    elif xs is not None and len(xs) != 4:
        return _split_3d_source(view, r1_out, r2, nodes)
    else:
        nodes.append(r1)
    if xs is None or s1 is None or s2 is None or (len(xs), len(s1), len(s2)) != (4, 3, 4):
        return None
    b, h, sq, d = xs
    if same(s1[0], b * h) and same(s1[1], sq) and same(s1[2], d) and all(
        same(o, w) for o, w in zip(s2, (b, h, d, sq), strict=True)
    ):
        return x, nodes, group  # type: ignore[return-value]
    return None


def _split_3d_source(view: _View, x3: Value, r2: Node, nodes: list[Node]) -> tuple[Value, list[Node], int] | None:
    """As `_swap_via_3d` when K never exists as (B, H, S, D): the dynamo exporter's static-shape export
    folds Reshape(Reshape(k, (B,H,S,D)), (B*H,S,D)) to k (B*H, S, D) (with GQA, the head repeat's
    (B, Hkv, group, S, D) straight to (B*H, S, D)). K is then Reshape(k, (B,H,S,D)), a new node added
    only if the fusion is made (static ONNX shapes: the torch backend adds no nodes)."""
    xs, s2 = view.shapes.shape(x3), view.shapes.shape(r2.outputs[0])
    if view.graph.meta.get("onnx_model") is None or xs is None or s2 is None or (len(xs), len(s2)) != (3, 4):
        return None
    b, h, d, sq = (as_int(x) for x in s2)
    if None in (b, h, d, sq) or not (same(xs[0], b * h) and same(xs[1], sq) and same(xs[2], d)):
        return None
    graph = view.graph
    shape = Value(graph.fresh_name(f"{x3.name}_bhsd_shape"), "int64", (4,), const=np.array([b, h, sq, d], np.int64))
    k = Value(graph.fresh_name(f"{x3.name}_bhsd"), x3.dtype, (b, h, sq, d))
    view.pending[id(k)] = Node("Reshape", [x3, shape], [k], {"shape": [b, h, sq, d]}, name=graph.fresh_name("Reshape"))
    return k, nodes, 1


# ---- Q/K/V operand peeling ------------------------------------------------------------------------
@dataclass
class _Src:
    """A candidate source of a Q/K/V operand: operand = permute(repeat_heads(value, group), net) * scale."""

    value: Value
    net: tuple[int, ...]
    scale: float = 1.0
    group: int = 1
    nodes: list[Node] = field(default_factory=list)
    reads: list[tuple[Value, tuple[int, ...], list[Node]]] = field(default_factory=list)  # absorbed, net, Shapes


@dataclass
class _Peel:
    states: list[_Src]
    gqa_refusal: str | None = None


def _peel(view: _View, operand: Value, reader: Node, *, allow_scale: bool, net: tuple[int, ...] = IDENT) -> _Peel:
    """Every source reachable from `operand` through single-use layout/scale/head-repeat nodes; `net`: how the
    matmul reads `operand` (SWAP: an einsum that contracts K's last axis reads K as K^T)."""
    st = _Src(operand, net)
    out = _Peel([st])
    while True:
        cur = st.value
        p = view.producer(cur)
        readers = view.shape_readers(cur, reader)
        if p is None or readers is None:
            return out
        if readers:
            st = replace(st, reads=[*st.reads, (cur, st.net, readers)])
        if p.op in PASS_THROUGH or (p.op == "Expand" and _same_shape(view, p.inputs[0], cur)):
            st, reader = replace(st, value=p.inputs[0], nodes=[*st.nodes, p]), p
        elif p.op == "Transpose" and len(p.attrs.get("perm") or ()) == 4:
            net = _compose(st.net, list(p.attrs["perm"]))
            st, reader = replace(st, value=p.inputs[0], net=net, nodes=[*st.nodes, p]), p
        elif p.op in ("Mul", "Div"):
            c, x = view.scalar(p.inputs[1]), p.inputs[0]
            if c is None and p.op == "Mul":
                c, x = view.scalar(p.inputs[0]), p.inputs[1]
            xs, cs = view.shapes.shape(x), view.shapes.shape(cur)
            if c is None or c == 0 or xs is None or cs is None or len(xs) != len(cs):
                return out
            if not all(same(a, b) for a, b in zip(xs, cs, strict=True)):
                return out
            if not allow_scale:
                return out
            factor = c if p.op == "Mul" else 1.0 / c
            st, reader = replace(st, value=x, scale=st.scale * factor, nodes=[*st.nodes, p]), p
        elif p.op == "Reshape" and (sw := _swap_via_3d(view, p)) is not None and (
            sw[2] == 1 or (st.group == 1 and not st.reads)
        ):
            net = _compose(st.net, list(SWAP))
            st = replace(st, value=sw[0], net=net, nodes=[*st.nodes, *sw[1]], group=st.group * sw[2])
            reader = sw[1][-1]
        elif not st.reads and st.group == 1 and (rep := _head_repeat(view, p, st.net[1], out)) is not None:
            x, g, rep_nodes = rep
            st, reader = replace(st, value=x, group=g, nodes=[*st.nodes, *rep_nodes]), rep_nodes[-1]
        else:
            return out
        out.states.append(st)


def _head_repeat(view: _View, p: Node, head_axis: int, out: _Peel) -> tuple[Value, int, list[Node]] | None:
    """An absorbable repeat of the head axis with repeat_interleave semantics: (source, group, nodes).

    Tile semantics (head h reads kv head h % Hkv) is recorded as a refusal and not absorbed.
    """
    tile = None
    if p.op == "Reshape" and (m := _expand_repeat(view, p)) is not None:
        x, a, lo, g, nodes = m
        if a == head_axis + 1 and lo == head_axis:
            return x, g, nodes
        if a == head_axis and lo == a:
            tile = f"Unsqueeze/Expand/Reshape repeats axis {head_axis} as a tile"
    elif p.op == "aten::repeat_interleave":
        reps, dim = p.attrs.get("repeats"), p.attrs.get("dim")
        if isinstance(reps, int) and dim is not None and p.inputs[0].rank == 4 and norm_axis(dim, 4) == head_axis:
            return p.inputs[0], reps, [p]
    elif p.op in ("Tile", "aten::repeat"):
        reps = p.attrs.get("repeats")
        if reps is None and len(p.inputs) > 1:
            reps = view.const(p.inputs[1])
        if reps is not None and len(reps) == 4 and int(reps[head_axis]) > 1:
            tile = f"{p.op} repeats axis {head_axis}"
    if tile:
        out.gqa_refusal = (
            f"K/V heads repeated with tile semantics ({tile}: head h reads kv head h % Hkv), not "
            f"repeat_interleave (h // group) as GQA needs; the repeated K/V are used as they are"
        )
    return None


# ---- the matched attention ------------------------------------------------------------------------
@dataclass
class _Match:
    nodes: list[Node]  # scores chain, softmax, probs chain, both MatMuls (or the SDPA node)
    q: _Peel
    k: _Peel
    v: _Peel
    out: Value  # the ·V result (BHSD)
    scale: float | None  # None: the default 1/sqrt(d)
    masks: _Masks
    k_transposed: bool  # True: K enters as K^T (MatMul form); False: as K (SDPA)
    guard: str  # FusedAttention's guard: what a row with every key masked (or a NaN) gives


Reads = list[tuple[Value, tuple[int, ...], list[Node]]]


def _choose(view: _View, m: _Match) -> tuple[str, _Src, _Src, _Src, list[Node], Value, Reads]:
    """Pick the layout and the deepest consistent Q/K/V sources.

    Returns (layout, q, k, v, output transpose nodes, output, Shape reads of the BHSD output).
    """
    users = view.users(m.out)
    t_out = next((u for u in users if u.op == "Transpose" and tuple(u.attrs.get("perm") or ()) == BSHD), None)
    out_reads = None if t_out is None else view.shape_readers(m.out, t_out)
    bshd_out = out_reads is not None
    k_nets = {"bhsd": SWAP, "bshd": BSHD_KT} if m.k_transposed else {"bhsd": IDENT, "bshd": BSHD}
    for layout in (("bshd", "bhsd") if bshd_out else ("bhsd",)):
        qn = IDENT if layout == "bhsd" else BSHD
        qs = [s for s in m.q.states if s.net == qn and s.group == 1]
        ks = [s for s in m.k.states if s.net == k_nets[layout]]
        if layout == "bhsd" and not ks and view.graph.meta.get("onnx_model") is not None:
            ks = [s for s in m.k.states if s.net == k_nets["bshd"]]  # given a BHSD copy in _fuse_match
        vs = [s for s in m.v.states if s.net == qn]
        pairs = [(k, v) for k in reversed(ks) for v in reversed(vs) if k.group == v.group]
        if qs and pairs:
            k, v = pairs[0]
            if layout == "bhsd":
                return layout, qs[-1], k, v, [], m.out, []
            assert t_out is not None and out_reads is not None
            reads: Reads = [(m.out, IDENT, out_reads)] if out_reads else []  # O (bhsd) = permute(O (bshd), BSHD)
            return layout, qs[-1], k, v, [t_out], t_out.outputs[0], reads
    kt = "K^T" if m.k_transposed else "K"
    want = "a swap of its last two axes" if m.k_transposed else "no permutation"
    if not any(s.net in k_nets.values() for s in m.k.states):
        nets = ", ".join(str(list(s.net)) for s in m.k.states)
        raise _Refuse(
            f"{kt} is not {want} of a (B,H,S,D) or (B,S,H,D) tensor "
            f"(net permutations from its producers: {nets})"
        )
    raise _Refuse("Q, K and V do not share one layout (bhsd or bshd) with consistent K/V head groups")


def _fuse_match(view: _View, m: _Match, result: PassResult, anchor: Node) -> None:
    layout, q, k, v, extra, out, out_reads = _choose(view, m)
    if m.k_transposed:  # decomposed: no scale anywhere means 1 (unscaled attention, as T5's)
        # (S * a + M) * c keeps its order (scale a, mask_scale c): S * a * c + M * c rounds differently where
        # a row's every score is masked by large finite values.
        chain = m.scale if m.masks.mask_scale == 1.0 else m.masks.scale_before
        scale = (1.0 if chain is None else chain) * q.scale * k.scale
        if scale <= 0:
            raise _Refuse(f"attention scale {scale} is not positive")
    else:  # SDPA: None means the default 1/sqrt(d) (attribute 0)
        scale = m.scale
    dim = q.value.shape[-1] if q.value.shape else None
    if scale is not None and isinstance(dim, int) and math.isclose(scale, 1 / math.sqrt(dim), rel_tol=1e-12):
        scale = None  # the default, computed exactly at run time (an ONNX float attribute has 32 bits)
    if m.k.gqa_refusal or m.v.gqa_refusal:
        result.refuse(anchor, m.k.gqa_refusal or m.v.gqa_refusal or "")
    for name, s in (("Q", q), ("K", k), ("V", v)):
        if s.value.rank != 4:
            raise _Refuse(f"{name} {s.value.name} has rank {s.value.rank}; FusedAttention needs 4-D")
    if out.dtype is not None and q.value.dtype is not None and out.dtype != q.value.dtype:
        raise _Refuse(f"output dtype {out.dtype} differs from Q's {q.value.dtype}")
    _check_operands(view, m, q, k, v)
    inputs = [q.value, k.value, v.value, m.masks.mask]
    for x in inputs:
        if x is not None and id(x) in view.pending:
            view.graph.add_node(view.pending.pop(id(x)))
    nodes = _with_constants(view, [*m.nodes, *q.nodes, *k.nodes, *v.nodes, *extra], inputs)
    for s in (q, k, v):
        _rewrite_shape_reads(view.graph, s.reads, s.value, s.net, nodes)
    _rewrite_shape_reads(view.graph, out_reads, out, BSHD, nodes)
    if layout == "bhsd" and k.net == (BSHD_KT if m.k_transposed else BSHD):
        inputs[1] = _bhsd_copy(view.graph, k.value)
    attrs = {
        "scale": 0.0 if scale is None else float(scale), "causal": m.masks.causal, "layout": layout,
        "mask_scale": m.masks.mask_scale, "mask_fill": m.masks.mask_fill, "guard": m.guard,
        "mask_keeps": m.masks.mask_keeps,
    }
    try:
        fuse(view.graph, nodes, "FusedAttention", inputs, [out], attrs)
    except FusionError as e:
        raise _Refuse(str(e)) from None
    result.fused += 1


def _bhsd(view: _View, src: _Src) -> Shape | None:
    """(B, H, S, D) of a peeled source, whichever of BHSD / BSHD it comes in."""
    s = view.shapes.shape(src.value)
    if s is None or len(s) != 4:
        return None
    return s if src.net in (IDENT, SWAP) else (s[0], s[2], s[1], s[3])


def _check_operands(view: _View, m: _Match, q: _Src, k: _Src, v: _Src) -> None:
    """FusedAttention takes one batch, K and V of one shape, and Q heads that K/V heads divide as GQA:
    prove the graph's operands are such, for every admitted size (a MatMul broadcasting a batch or
    head axis of size 1, or dims of different names, are not). The K/V length and the Q/K head dim
    need no proof: Q·K^T and ·V contract them (as SDPA requires them equal), so a run where they differ
    fails in the original too."""
    qs, ks, vs, os = _bhsd(view, q), _bhsd(view, k), _bhsd(view, v), view.shapes.shape(m.out)
    if qs is None or ks is None or vs is None or os is None or len(os) != 4:
        raise _Refuse("Q, K, V or the output have unknown shapes: cannot prove them one batch and head layout")
    names = ("batch", "heads", "length", "head dim")
    for a, b, axes, what in ((qs, ks, (0,), "Q and K"), (qs, vs, (0,), "Q and V"), (ks, vs, (0, 1), "K and V")):
        for axis in axes:
            if not same(a[axis], b[axis]):
                raise _Refuse(f"{names[axis]} of {what} ({a[axis]} vs {b[axis]}) are not provably equal")
    for axis, want in ((0, qs[0]), (1, qs[1]), (2, qs[2]), (3, vs[3])):
        if not same(os[axis], want):
            raise _Refuse(f"the output's {names[axis]} {os[axis]} is not Q's/V's {want} (the graph broadcasts)")
    hq, hk = qs[1], ks[1] * k.group
    if same(hq, hk) or same(hk, 1):
        return
    # SDPA with fewer K/V heads runs only as GQA (enable_gqa, or the backend ops that take it implicitly)
    if not m.k_transposed and as_int(hq) is not None and as_int(ks[1]) is not None and as_int(hq) % as_int(ks[1]) == 0:
        return
    raise _Refuse(f"query heads {hq} are neither key/value heads {hk} nor a GQA multiple of them")


def _bhsd_copy(graph: Graph, k: Value) -> Value:
    """A new Transpose giving K (B,S,H,D) as (B,H,S,D), when only K comes as BSHD (TorchScript's SDPA
    export folds K's head transpose into K^T while Q, V and the output stay BHSD). ONNX graphs only."""
    shape = None if k.shape is None else tuple(k.shape[i] for i in BSHD)
    out = Value(graph.fresh_name(f"{k.name}_bhsd"), k.dtype, shape)
    graph.add_node(Node("Transpose", [k], [out], {"perm": list(BSHD)}, name=graph.fresh_name("Transpose")))
    return out


def _rewrite_shape_reads(graph: Graph, reads: Reads, src: Value, src_net: tuple[int, ...], fused: list[Node]) -> None:
    """Replace Shape(x) of absorbed values x by Gather(Shape(src), p), where x = permute(src, p).

    `reads` holds (x, net, Shape nodes) with operand = permute(x, net); operand = permute(src, src_net).
    """
    for x, net, shapes in reads:
        inv = [net.index(j) for j in range(len(net))]
        perm = [src_net[inv[j]] for j in range(len(net))]
        for sh in (s for s in shapes if all(s is not n for n in fused)):  # absorbed ones read inside
            idx = perm[sh.attrs.get("start", 0):sh.attrs.get("end")]
            full = Value(graph.fresh_name(f"{src.name}_shape"), "int64", (len(perm),))
            index = Value(graph.fresh_name(f"{x.name}_dims"), "int64", (len(idx),), const=np.array(idx, np.int64))
            graph.add_node(Node("Shape", [src], [full], {}, name=graph.fresh_name("Shape")))
            graph.add_node(Node("Gather", [full, index], sh.outputs, {"axis": 0}, name=graph.fresh_name("Gather")))
            graph.remove_nodes([sh])


def _with_constants(view: _View, nodes: list[Node], keep: list[Value | None]) -> list[Node]:
    """Add the constant subgraphs read only inside `nodes` (scales, fills, causal masks) to the match.

    `keep` are the fused node's inputs, which must stay outside.
    """
    inside = {id(n) for n in nodes}
    kept = {id(v) for v in keep if v is not None}
    out = list(nodes)
    for n in out:  # grows while iterating: a breadth-first walk up the constant producers
        for v in n.inputs:
            p = view.producer(v)
            if p is None or id(p) in inside or id(v) in kept or p.op not in LOCAL_EVALUATORS:
                continue
            if any(view.is_output(o) or any(id(u) not in inside for u in view.users(o)) for o in p.outputs):
                continue
            if view.shapes.value(v) is not None:
                inside.add(id(p))
                out.append(p)
    return out


# ---- masks ---------------------------------------------------------------------------------------
@dataclass
class _Term:
    """One mask applied on the way from Q·K^T to softmax, in chain order.

    kind "add": scores + value; "keep": Where(value, scores, fill); "drop": Where(value, fill, scores)
    (and masked_fill). `mult` is the product of the scales applied after it (they scale it too), `before`
    the product of those applied before it (None: none).
    """

    kind: str
    value: Value
    at: int
    fill: float = 0.0
    mult: float = 1.0
    before: float | None = None


@dataclass
class _Masks:
    """What FusedAttention gets for the chain's masks (see fused_ops: mask_scale, mask_fill, mask_keeps)."""

    causal: int = 0
    mask: Value | None = None
    mask_scale: float = 1.0
    scale_before: float | None = None  # with mask_scale != 1: the scores' scale before the mask is added
    mask_fill: float = -math.inf
    mask_keeps: int = 1


def _fold(chain: list[tuple]) -> tuple[float | None, list[_Term]]:
    """The scores chain in forward order -> (product of its scales or None, its mask terms): a scale
    applied after a mask scales the mask too ((S + M) * c = S * c + M * c)."""
    scale, terms = None, []
    for i, step in enumerate(chain):
        if step[0] == "scale":
            scale = (1.0 if scale is None else scale) * step[1]
            for t in terms:
                t.mult *= step[1]
        elif step[0] == "add":
            terms.append(_Term("add", step[1], i, before=scale))
        else:
            terms.append(_Term(step[1], step[2], i, fill=step[3], before=scale))
    return scale, terms


def _finite_fill_ok(fill: float, dtype: str | None) -> bool:
    """A finite causal fill counts as masking when it is finfo.min-like: at least 1/64 of the dtype's
    range (exact for scores below |fill|/2 in magnitude, see docs/LEGALITY.md)."""
    np_dtype = {"float16": np.float16, "float64": np.float64}.get(dtype or "", np.float32)
    return abs(fill) >= float(np.finfo(np_dtype).max) / 64


def _resolve_masks(view: _View, terms: list[_Term], shape: Shape | None, dtype: str | None) -> _Masks:
    """Which terms are provably causal (dropped: causal=1) and which one stays the mask input.

    Causal is proven from structure (tkopt/passes/masks.py) for every admitted size. A -inf causal fill is
    exact beside one other mask; a finite (finfo.min) one only alone, since a row whose every earlier
    key the other mask drops would then weigh the later keys in eager, and no key when fused."""
    causal, explicit = [], []
    for t in terms:
        if t.mult <= 0:
            raise _Refuse(f"mask {t.value.name} is scaled by {t.mult:g} after it is applied: its fill changes sign")
        if _changes_nothing(view, t.value, t.kind, shape):
            continue
        proof = prove_causal(view.masks, t.value, t.kind, shape)
        split = None if proof is not None else split_mask(view.masks, t.value, t.kind, shape)
        if split is not None and split.causal and t.kind != "add" and t.fill * t.mult != -math.inf:
            split = None  # causality comes out of a mask only under a -inf fill (see below for finite ones)
        if split is not None and split.rest.dtype in (None, "bool") and not _broadcast_problem(view, split.rest, shape):
            # causality, factors that keep everything and Expand taken out: causal=1 where a causal factor was,
            # the one mask left the input (where the kernels can read it; else the whole mask stays the input)
            if split.causal:
                causal.append((t, -math.inf))
            fill = -math.inf if t.kind == "add" else t.fill
            explicit.append(replace(t, value=split.rest, kind=split.kind, fill=fill))
            continue
        fill = None
        if proof is not None:
            fill = (proof.fill if t.kind == "add" else t.fill) * t.mult
            if math.isfinite(fill) and not _finite_fill_ok(fill, dtype):
                proof = None  # e.g. -1e4: a large score can outweigh it, so it stays an explicit mask
        if proof is None:
            explicit.append(t)
        else:
            causal.append((t, fill))
    if len(explicit) > 1:
        raise _Refuse(
            f"more than one mask that is not provably causal ({', '.join(t.value.name for t in explicit)}); "
            "FusedAttention takes one"
        )
    for t, fill in causal:
        others = [e for e in terms if e is not t]
        if math.isfinite(fill) and others and not all(_negligible(view, e, fill) for e in others):  # type: ignore[arg-type]
            raise _Refuse(
                f"causal mask {t.value.name} fills with the finite {fill:g} beside another mask: a row whose "
                "earlier keys are all masked would differ (only a -inf causal fill combines)"
            )
        late = [e for e in explicit if e.kind != "add" and e.at > t.at and math.isfinite(e.fill * e.mult)]
        if late:
            raise _Refuse(
                f"Where {late[0].value.name} after the causal mask {t.value.name} overwrites its -inf with the "
                f"finite {late[0].fill * late[0].mult:g}"
            )
    out = _Masks(causal=int(bool(causal)))
    if explicit:
        out.mask, out.mask_scale, out.mask_fill = _mask_input(view, explicit[0], shape)
        out.scale_before = explicit[0].before
        out.mask_keeps = int(explicit[0].kind != "drop")
    return out


def _changes_nothing(view: _View, m: Value, kind: str, scores: Shape | None) -> bool:
    """Whether mask `m` (of `kind`) provably keeps every score at every admitted size and broadcasts into the
    scores without widening them: leaving it out is then the same attention, and the maskless kernels run."""
    return keeps_all(view.masks, m, kind) and _broadcast_problem(view, m, scores) is None


def _negligible(view: _View, t: _Term, fill: float) -> bool:
    """Whether additive term `t` is provably a bias, never a mask, beside a finite causal fill: its magnitude
    is below |fill| / 2**20 for every admitted size (ALiBi's slopes times positions), so no row loses all its
    keys to it and the dropped keys' weights still underflow to exactly 0 (docs/LEGALITY.md)."""
    if t.kind != "add":
        return False
    bound = magnitude_bound(view.masks, t.value)
    return bound is not None and bound * abs(t.mult) <= abs(fill) / 2**20


def _mask_input(view: _View, t: _Term, shape: Shape | None) -> tuple[Value, float, float]:
    """(mask input, mask_scale, mask_fill) for the explicit term: a bool mask with its fill (which of its
    values keeps is the term's kind), or an additive mask with the scale applied after it."""
    m = t.value
    if t.kind != "add" and m.dtype not in (None, "bool"):
        raise _Refuse(f"Where condition {m.name} is {m.dtype}, not bool")
    if t.kind == "add" and m.dtype == "bool":
        raise _Refuse(f"mask {m.name} is bool but added to the scores")
    problem = _broadcast_problem(view, m, shape)
    if problem:
        raise _Refuse(problem)
    _declare_broadcast_dims(view, m)
    if t.kind == "add":
        return m, t.mult, -math.inf
    return m, 1.0, t.fill * t.mult


def _declare_broadcast_dims(view: _View, m: Value) -> None:
    """Write the mask's proven size-1 dims into its declared shape: the kernels (and the native ORT
    library's binding) take their broadcast flags from it."""
    proven = view.shapes.shape(m)
    if m.shape is not None and proven is not None and len(proven) == len(m.shape):
        m.shape = tuple(1 if d == 1 else declared for d, declared in zip(proven, m.shape, strict=True))


def _broadcast_problem(view: _View, m: Value, scores: Shape | None) -> str | None:
    """Why mask `m` may not broadcast to the scores (B,H,Sq,Skv) the way the kernel reads it: each of
    its dims must be declared 1 (broadcast) or provably the scores' (a dim of another name or an
    unknown one could be 1 at run time, which the kernels' static broadcast flags would misread)."""
    ms = view.shapes.shape(m)
    if ms is None or scores is None or m.shape is None or len(ms) != len(m.shape):
        return f"mask {m.name} has an unknown shape"
    if len(ms) > len(scores):
        return f"mask {m.name} of rank {len(ms)} does not broadcast to the rank-{len(scores)} scores"
    for i, (d, declared) in enumerate(zip(ms, m.shape, strict=True)):
        sd = scores[len(scores) - len(ms) + i]
        if declared == 1 or d == 1 or aligned(d, sd):
            continue
        return (
            f"mask {m.name} of shape {_shape_str(m)} does not provably broadcast to (B,H,Sq,Skv) "
            f"({', '.join(map(str, scores))}): its axis {i} is neither 1 nor the scores' {sd}"
        )
    return None


# ---- decomposed attention (anchored at Softmax) ---------------------------------------------------
@dataclass
class _Mm:
    """A 4-D batched MatMul out = a @ b: a MatMul node, the bmm form of decomposed FX (Reshape to 3-D, bmm,
    Reshape back) with the nodes it spans, or an einsum that is one (b_net SWAP where it reads b transposed)."""

    a: Value
    a_reader: Node
    b: Value
    b_reader: Node
    out: Value
    nodes: list[Node]
    b_net: tuple[int, ...] = IDENT


EINSUMS = ("aten::einsum", "Einsum")


def einsum_matmul(n: Node) -> tuple[int, ...] | None:
    """How einsum node `n` reads its second operand if it is a 4-D batched matmul of two operands (IDENT:
    "abcd,abde->abce", a @ b; SWAP: "abcd,abed->abce", a @ b^T), else None: an ellipsis, a broadcast or
    repeated letter, or any other contraction is not one."""
    parsed = einsum_terms(n)
    if parsed is None or len(n.inputs) != 2:
        return None
    terms, out = parsed
    if len(terms) != 2 or not all(len(t) == 4 and t.isalpha() for t in (*terms, out)):
        return None
    (a, b), c = terms, out
    if len(set(a + b)) != 5 or a[:2] != b[:2] or c[:3] != a[:3]:
        return None
    if b[2] == a[3] and c[3] == b[3]:
        return IDENT
    if b[3] == a[3] and c[3] == b[2]:
        return SWAP
    return None


def _unflatten(view: _View, v3: Value, reader: Node) -> tuple[Value, Node, list[Node]] | None:
    """v3 = Reshape(x, (B*H, M, K)) of 4-D x (through no-op Expand/clone): (x, its reader, nodes)."""
    r = view.producer(v3)
    if r is None or r.op != "Reshape" or not view.only_user(v3, reader):
        return None
    nodes, x, rd = [r], r.inputs[0], r
    while (p := view.producer(x)) is not None and view.only_user(x, rd) and (
        p.op in PASS_THROUGH or (p.op == "Expand" and _same_shape(view, p.inputs[0], x))
    ):
        nodes.append(p)
        x, rd = p.inputs[0], p
    s4, s3 = view.shapes.shape(x), view.shapes.shape(v3)
    if s4 is None or s3 is None or len(s4) != 4 or len(s3) != 3:
        return None
    if same(s3[0], s4[0] * s4[1]) and same(s3[1], s4[2]) and same(s3[2], s4[3]):
        return x, rd, nodes
    return None


def _same_shape(view: _View, a: Value, b: Value) -> bool:
    sa, sb = view.shapes.shape(a), view.shapes.shape(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(map(same, sa, sb))


def _as_matmul(view: _View, p: Node | None) -> _Mm | None:
    """`p` as a 4-D batched MatMul, if it is one (MatMul, or Reshape of the decomposed bmm form)."""
    if p is None:
        return None
    if p.op == "MatMul":
        return _Mm(p.inputs[0], p, p.inputs[1], p, p.outputs[0], [p])  # type: ignore[arg-type]
    if (b_net := einsum_matmul(p)) is not None:
        return _Mm(p.inputs[0], p, p.inputs[1], p, p.outputs[0], [p], b_net)  # type: ignore[arg-type]
    if p.op != "Reshape":
        return None
    mm = view.producer(p.inputs[0])
    if mm is None or mm.op != "MatMul" or not view.only_user(p.inputs[0], p):  # type: ignore[arg-type]
        return None
    a, b = _unflatten(view, mm.inputs[0], mm), _unflatten(view, mm.inputs[1], mm)  # type: ignore[arg-type]
    if a is None or b is None:
        return None
    sa, sb, so = view.shapes.shape(a[0]), view.shapes.shape(b[0]), view.shapes.shape(p.outputs[0])
    if sa is None or sb is None or so is None or len(so) != 4:
        return None
    if not (same(sa[0], sb[0]) and same(sa[1], sb[1]) and same(sa[3], sb[2])):
        return None
    if not all(map(same, so, (sa[0], sa[1], sa[2], sb[3]))):
        return None
    return _Mm(a[0], a[1], b[0], b[1], p.outputs[0], [p, mm, *a[2], *b[2]])


def _forward_bmm(view: _View, probs: Value) -> _Mm | None:
    """The decomposed ·V bmm reading `probs` (through no-op Expand/clone and the 3-D Reshape)."""
    v = probs
    for _ in range(4):
        u = view.sole_user(v)
        if u is None:
            return None
        if u.op == "MatMul":
            mm = _as_matmul(view, view.sole_user(u.outputs[0]))
            return mm if mm is not None and mm.a is probs and mm.nodes[1] is u else None
        if u.op not in ("Expand", "Reshape", *PASS_THROUGH):
            return None
        v = u.outputs[0]
    return None


def _leads_to_matmul(view: _View, v: Value | None, depth: int = 8) -> bool:
    p = view.producer(v)
    if p is None or depth == 0:
        return False
    if p.op == "MatMul" or einsum_matmul(p) is not None or (p.op == "Reshape" and _as_matmul(view, p) is not None):
        return True
    return p.op in CHAIN_OPS and any(_leads_to_matmul(view, i, depth - 1) for i in p.inputs[:3] if i is not None)


def _dropout_training(n: Node, view: _View) -> bool | None:
    """None: not a dropout; else whether it is active (training mode with p > 0)."""
    if n.op == "Dropout":
        mode = n.attrs.get("training_mode")
        if mode is None and len(n.inputs) > 2 and n.inputs[2] is not None:
            c = view.const(n.inputs[2])
            mode = True if c is None else bool(c)
        ratio = n.attrs.get("ratio")
        if ratio is None and len(n.inputs) > 1 and n.inputs[1] is not None:
            ratio = view.scalar(n.inputs[1])
        return bool(mode) and ratio != 0
    if n.op in ("aten::dropout", "aten::native_dropout", "aten::feature_dropout"):
        return bool(n.attrs.get("train", n.attrs.get("training", True))) and n.attrs.get("p", 1) != 0
    return None


def _nan_guard(view: _View, p: Value, users: list[Node]) -> list[Node]:
    """Where(IsNaN(p), 0, p): the dynamo exporter's zeroing of NaN probabilities (fully masked rows, and
    rows with a NaN score): FusedAttention's guard "nan". Returns [IsNaN, Where] or []."""
    if len(users) != 2 or view.is_output(p):
        return []
    isnan = next((u for u in users if u.op == "IsNaN"), None)
    where = next((u for u in users if u.op == "Where"), None)
    if isnan is None or where is None or where.inputs[2] is not p or where.inputs[0] is not isnan.outputs[0]:
        return []
    if view.sole_user(isnan.outputs[0]) is not where or view.scalar(where.inputs[1]) != 0:
        return []
    return [isnan, where]


def _row_guard(view: _View, sm: Node) -> list[Node]:
    """Where(Not(any(Not(scores == -inf), -1)), full_like(p, 0), p): decomposed SDPA's zeroing of fully
    masked rows (FusedAttention's guard "masked"). Returns its nodes, the Where last, or []."""
    scores, p = sm.inputs[0], sm.outputs[0]
    users = view.users(p)
    where = next((u for u in users if u.op == "Where" and u.inputs[2] is p), None)
    fill = next((u for u in users if u.op == "aten::full_like"), None)
    if len(users) != 2 or where is None or fill is None or fill.attrs.get("fill_value") != 0:
        return []
    if where.inputs[1] is not fill.outputs[0] or view.sole_user(fill.outputs[0]) is not where:
        return []
    chain, v = [], where.inputs[0]
    for op in ("Not", "aten::any", "Not", "Equal"):
        n = view.producer(v)
        if n is None or n.op != op or view.sole_user(v) is not (chain[-1] if chain else where):
            return []
        chain.append(n)
        v = n.inputs[0]
    anyn, eq = chain[1], chain[3]
    if anyn.attrs.get("dim") not in (-1, 3) or not anyn.attrs.get("keepdim") or v is not scores:
        return []
    if view.scalar(eq.inputs[1]) != float("-inf") or set(map(id, view.users(scores))) != {id(sm), id(eq)}:
        return []
    return [*chain, fill, where]


def _probs_chain(view: _View, sm: Node, start: Value) -> tuple[_Mm, list[Node], bool]:
    """From the softmax output (or `start`, after a row guard) to the ·V MatMul: (MatMul, absorbed nodes,
    whether a NaN guard zeroes NaN probabilities on the way)."""
    cur, nodes, nan_guard = start, [], False
    while True:
        users = view.users(cur)
        guard = _nan_guard(view, cur, users)
        if guard:
            nodes += guard
            cur, nan_guard = guard[-1].outputs[0], True
            continue
        pv = [u for u in users if (u.op == "MatMul" or einsum_matmul(u) is not None) and u.inputs[0] is cur]
        mm = _forward_bmm(view, cur) if len(users) == 1 and not pv else None
        if mm is not None:
            return mm, nodes, nan_guard
        if len(users) != 1 or view.is_output(cur):
            if pv or any(u.op in ("Cast", "Identity", "Dropout") for u in users):
                who = next((u.name for u in users if u not in pv), "the graph output")
                raise _Refuse(f"attention probabilities {cur.name} are also used by {who}")
            raise _Miss
        u = users[0]
        if pv:
            return _as_matmul(view, u), nodes, nan_guard  # type: ignore[return-value]
        training = _dropout_training(u, view)
        if training:
            raise _Refuse(f"dropout {u.name} is active (training mode) between softmax and ·V")
        _check_cast(u, "between softmax and ·V")
        if training is None and u.op not in ("Cast", "Identity") and u.op not in PASS_THROUGH:
            nxt = view.users(u.outputs[0]) if u.outputs else []
            if any(n.op == "MatMul" and n.inputs[0] is u.outputs[0] for n in nxt):
                raise _Refuse(f"{u.op} {u.name} between softmax and the ·V MatMul (e.g. a mask added after softmax)")
            raise _Miss
        nodes.append(u)
        cur = u.outputs[0]


def _check_cast(n: Node, where: str) -> None:
    """A Cast on the scores or probabilities may change precision (FusedAttention computes in float32 or
    float64), never the kind of number: a cast to an integer or bool truncates."""
    if n.op == "Cast" and n.attrs.get("to") not in FLOAT_DTYPES:
        raise _Refuse(f"Cast {n.name} to {n.attrs.get('to')} {where} is not a float cast")


_FLOAT_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def _check_rounding(dtype: str | None, sm: Node, casts: list[Node]) -> None:
    """FusedAttention keeps the scores and probabilities at the Q·K^T dtype's precision or wider; a softmax
    computing in, or a Cast to, a float type that rounds them (float32 in a float64 graph: 1e-8 off) is
    arithmetic it would not reproduce. Casting up (a float16 graph's float32 softmax) and back is fine."""
    steps = [(sm, sm.attrs.get("dtype"), "computes in")] + [(c, c.attrs.get("to"), "casts to") for c in casts]
    for n, to, what in steps:
        if to is not None and to != dtype and _FLOAT_BITS.get(to, 0) <= _FLOAT_BITS.get(dtype or "", 0):
            raise _Refuse(f"{n.op} {n.name} {what} {to}, rounding the {dtype} attention scores or probabilities")


def _scores_chain(view: _View, sm: Node, guard: list[Node]) -> tuple[_Mm, list[Node], list[tuple]]:
    """From the softmax input back to Q·K^T: (MatMul, absorbed nodes, the chain's steps in forward
    order: ("scale", c), ("add", mask) or ("where", "keep" | "drop", condition, fill))."""
    cur, consumer = sm.inputs[0], sm
    nodes: list[Node] = []
    chain: list[tuple] = []
    while True:
        p = view.producer(cur)
        if p is None:
            raise _Miss
        if not view.only_user(cur, consumer) and not (guard and cur is sm.inputs[0]):
            raise _Refuse(f"attention scores {cur.name} are also used by {view.other_user(cur, consumer)}")
        mm = _as_matmul(view, p)
        if mm is not None:
            return mm, nodes, chain[::-1]
        nodes.append(p)
        if p.op in ("Cast", "Identity"):
            _check_cast(p, "between Q·K^T and softmax")
            nxt = p.inputs[0]
        elif p.op == "Add":
            lead = [_leads_to_matmul(view, i) for i in p.inputs]
            if lead[0] == lead[1]:
                raise _Refuse(f"cannot tell the scores from the mask in {p.name}: both or neither come from a MatMul")
            nxt, m = (p.inputs[0], p.inputs[1]) if lead[0] else (p.inputs[1], p.inputs[0])
            chain.append(("add", m))
        elif p.op == "Where":
            cond, a, b = p.inputs
            fa, fb = view.scalar(a), view.scalar(b)
            if fb is not None and _leads_to_matmul(view, a):
                nxt, fill, kind = a, fb, "keep"
            elif fa is not None and _leads_to_matmul(view, b):
                nxt, fill, kind = b, fa, "drop"
            else:
                raise _Refuse(f"Where {p.name} does not select between the scores and a constant fill")
            chain.append(("where", kind, cond, fill))
        elif p.op == "aten::masked_fill" and isinstance(p.attrs.get("value"), int | float):
            nxt = p.inputs[0]
            chain.append(("where", "drop", p.inputs[1], float(p.attrs["value"])))
        elif p.op in ("Mul", "Div"):
            c, nxt = view.scalar(p.inputs[1]), p.inputs[0]
            if c is None and p.op == "Mul":
                c, nxt = view.scalar(p.inputs[0]), p.inputs[1]
            if c is None or c == 0:
                raise _Refuse(f"{p.op} {p.name} on the scores is not by a constant scalar")
            chain.append(("scale", c if p.op == "Mul" else 1.0 / c))
        else:
            raise _Refuse(f"unsupported {p.op} {p.name} between Q·K^T and softmax")
        cur, consumer = nxt, p


def _match_softmax(view: _View, sm: Node) -> _Match:
    if not _leads_to_matmul(view, sm.inputs[0]):
        raise _Miss
    row_guard = _row_guard(view, sm)
    pv, post, nan_guard = _probs_chain(view, sm, row_guard[-1].outputs[0] if row_guard else sm.outputs[0])
    rank = sm.inputs[0].rank
    if rank is not None and rank < 3:
        raise _Miss  # no heads: a classifier head, not attention
    axis = sm.attrs.get("axis", -1)
    if rank is None or norm_axis(int(axis), rank) != rank - 1:
        raise _Refuse(f"softmax over axis {axis}, not the last (key) axis")
    if rank != 4:
        raise _Refuse(f"scores have rank {rank}; FusedAttention needs 4-D (B,H,Sq,Skv)")
    qk, pre, chain = _scores_chain(view, sm, row_guard)
    _check_rounding(qk.out.dtype, sm, [n for n in (*pre, *post) if n.op == "Cast"])
    if sm.attrs.get("dtype") is not None and not qk.out.dtype == pv.a.dtype == pv.out.dtype:
        raise _Refuse(
            f"softmax {sm.name} computes in {sm.attrs['dtype']} and the probabilities reach ·V as "
            f"{pv.a.dtype} (·V result {pv.out.dtype}), not cast back to the Q·K^T dtype {qk.out.dtype}: "
            f"FusedAttention returns {qk.out.dtype}"
        )
    scale, terms = _fold(chain)
    return _Match(
        nodes=[*pre, *qk.nodes, sm, *row_guard, *post, *pv.nodes],
        q=_peel(view, qk.a, qk.a_reader, allow_scale=True),
        k=_peel(view, qk.b, qk.b_reader, allow_scale=True, net=qk.b_net),
        v=_peel(view, pv.b, pv.b_reader, allow_scale=False, net=pv.b_net),
        out=pv.out, scale=scale, masks=_resolve_masks(view, terms, view.shapes.shape(qk.out), qk.out.dtype),
        k_transposed=True,
        guard="nan" if nan_guard else "masked" if row_guard else "none",
    )


# ---- canonical ScaledDotProductAttention ------------------------------------------------------------
def _match_sdpa(view: _View, n: Node) -> _Match:
    """torch's SDPA: softmax(Q K^T * scale + mask) V, a bool mask keeping where True, is_causal top-left,
    rows with every key masked giving 0 (its safe softmax: guard "masked"), fewer K/V heads as GQA. Without a
    mask, guard "sdpa": torch's CPU flash kernel then also decides a row whose every score is NaN, 0 or NaN by the
    row's length (with a mask it gives NaN, as CUDA does either way)."""
    q, k, v, mask = [*n.inputs, None, None][:4]
    if float(n.attrs.get("dropout_p", 0.0) or 0.0) > 0:
        raise _Refuse(f"dropout_p={n.attrs['dropout_p']} (training) in {n.name}")
    scale = n.attrs.get("scale") or 0.0
    masks = _Masks(causal=int(bool(n.attrs.get("is_causal", 0))))
    if mask is not None:
        scores = _sdpa_scores(view, n)
        if scores is None:
            raise _Refuse(f"Q/K of {n.name} are not 4-D with known rank: cannot place the mask")
        found = _resolve_masks(view, [_Term(_sdpa_mask_kind(mask), mask, 0, -math.inf)], scores, q.dtype)
        masks = replace(found, causal=found.causal | masks.causal)
    return _Match(
        nodes=[n],
        q=_peel(view, q, n, allow_scale=False),
        k=_peel(view, k, n, allow_scale=False),
        v=_peel(view, v, n, allow_scale=False),
        out=n.outputs[0], scale=float(scale) if scale > 0 else None, masks=masks, k_transposed=False,
        guard="masked" if mask is not None else "sdpa",
    )


def _sdpa_scores(view: _View, n: Node) -> Shape | None:
    """SDPA node `n`'s scores shape (B, H, Sq, Skv) from its 4-D Q and K; None where either is not 4-D."""
    qs, ks = view.shapes.shape(n.inputs[0]), view.shapes.shape(n.inputs[1])
    if qs is None or ks is None or len(qs) != 4 or len(ks) != 4:
        return None
    return qs[0], qs[1], qs[2], ks[2]


def _sdpa_mask_kind(mask: Value) -> str:
    """How SDPA applies its mask: a bool one keeps where True, any other is added to the scores."""
    return "keep" if mask.dtype == "bool" else "add"


# ---- near misses the patterns do not reach ---------------------------------------------------------
# What computes Q·K^T or ·V in some frontend's spelling; MatMul is the one the patterns take.
MATMUL_LIKE = ("MatMul", "Gemm", "Einsum", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::einsum")
# What the patterns follow between the two matmuls (the scores chain, the probabilities chain, bmm form).
FOLLOWED = (*CHAIN_OPS, *PASS_THROUGH, "aten::masked_fill", "Reshape", "Expand", "Dropout", "aten::dropout",
            "IsNaN", "Not", "Equal", "aten::any", "aten::full_like")
NEAR = 6  # how many ops apart the matmuls may sit from the softmax


def _path_to_matmul(view: _View, v: Value, backward: bool) -> list[Node] | None:
    """The shortest chain of nodes from `v` to a matmul-like node (last), walking producers (`backward`) or
    users, at most NEAR nodes long; None if there is none."""
    frontier: list[tuple[Value, list[Node]]] = [(v, [])]
    seen: set[int] = set()
    for _ in range(NEAR):
        nxt: list[tuple[Value, list[Node]]] = []
        for x, path in frontier:
            nodes = [view.producer(x)] if backward else view.users(x)
            for n in nodes:
                if n is None or id(n) in seen:
                    continue
                seen.add(id(n))
                if n.op in MATMUL_LIKE:
                    return [*path, n]
                ins = n.inputs if backward else n.outputs
                nxt += [(i, [*path, n]) for i in ins if i is not None]
        frontier = nxt
    return None


def _near_miss(view: _View, sm: Node) -> str | None:
    """Why a Softmax the patterns skipped is nonetheless an attention: over the last axis of 3-D or higher
    scores, a matmul near on both sides. None when it is not one (a classifier head, a router)."""
    rank = sm.inputs[0].rank if sm.inputs[0] is not None else None
    if rank is None or rank < 3 or norm_axis(int(sm.attrs.get("axis", -1)), rank) != rank - 1:
        return None
    back, fwd = _path_to_matmul(view, sm.inputs[0], True), _path_to_matmul(view, sm.outputs[0], False)
    if back is None or fwd is None:
        return None
    for path, where in ((back, "between Q·K^T and softmax"), (fwd, "between softmax and ·V")):
        odd = next((n for n in path[:-1] if n.op not in FOLLOWED), None)
        if odd is not None and odd.op == "Tanh":
            return (f"attention logit soft-capping (Tanh {odd.name} {where}: tanh(scores / cap) * cap): "
                    "FusedAttention applies no function to the scores")
        if odd is not None:
            return f"{odd.op} {odd.name} {where}: the attention patterns do not take it"
    for path, what in ((back, "Q·K^T"), (fwd, "·V")):
        mm = path[-1]
        if mm.op == "aten::baddbmm":
            return (f"{what} is aten::baddbmm {mm.name}, a batched matmul with a bias added inside it (ALiBi's "
                    "position bias): the attention patterns take a MatMul with the bias added to its result")
        if mm.op in EINSUMS and einsum_matmul(mm) is None:
            return (f"{what} is the einsum {mm.name} ({mm.attrs.get('equation')!r}), not a 4-D batched matmul of two "
                    "operands: the attention patterns take one")
        if mm.op not in ("MatMul", *EINSUMS):
            return f"{what} is {mm.op} {mm.name}: the attention patterns take a MatMul"
    if rank != 4:
        return f"scores have rank {rank}; FusedAttention needs 4-D (B,H,Sq,Skv)"
    mm = back[-1]
    if mm.inputs[0] is not None and mm.inputs[0].rank == 3:  # the bmm form: each operand a flattened 4-D tensor
        odd = [v for v in mm.inputs if v is not None and _unflatten(view, v, mm) is None]
        if odd:
            made = ", ".join(f"{v.name} (from {p.op if (p := view.producer(v)) else 'outside'})" for v in odd)
            return (f"Q·K^T is the 3-D MatMul {mm.name} whose operands {made} are not 4-D Q / K^T flattened by a "
                    "Reshape (e.g. a scale applied after flattening)")
    ops = ", ".join(f"{n.op} {n.name}" for n in back)
    return f"Q·K^T reaches softmax through {ops}, a form the attention patterns do not take"


@register("drop_keep_all_masks")
def drop_keep_all_masks(graph: Graph, result: PassResult) -> None:
    """Leave out an SDPA's mask where it provably keeps every score (`_changes_nothing`): transformers' encoders
    (BERT, ViT, ...) called without attention_mask trace their mask as q >= 0 expanded to (b, 1, s, s), where
    eager passes none. torch's masked kernels are slower (H100: BERT-base 16x512's masked cuDNN
    attention under torch.compile 0.93 ms a call against eager's maskless 0.44; ViT-B/16's masked SDPA went to
    inductor's fp32 math path). Before the fusion, so fused and unfused SDPA alike run maskless."""
    view = _View(graph)
    for n in graph.nodes:
        if n.op != "ScaledDotProductAttention" or n.domain or len(n.inputs) < 4 or n.inputs[3] is None:
            continue
        mask, scores = n.inputs[3], _sdpa_scores(view, n)
        if scores is not None and _changes_nothing(view, mask, _sdpa_mask_kind(mask), scores):
            n.inputs[3] = None
            result.changed += 1


@register("attention", fusion=True)
def fuse_attention(graph: Graph, result: PassResult) -> None:
    """Fuse every decomposed or canonical scaled-dot-product attention into FusedAttention."""
    anchors = [n for n in graph.nodes if n.op in ("Softmax", "ScaledDotProductAttention") and not n.domain]
    view = _View(graph)
    for anchor in anchors:
        if not any(n is anchor for n in graph.nodes):
            continue
        view.refresh()
        view.pending.clear()
        try:
            m = _match_softmax(view, anchor) if anchor.op == "Softmax" else _match_sdpa(view, anchor)
            _fuse_match(view, m, result, anchor)
        except _Miss:
            reason = _near_miss(view, anchor) if anchor.op == "Softmax" else None
            if reason is not None:
                result.refuse(anchor, reason)
        except _Refuse as e:
            result.refuse(anchor, str(e))
