"""Symbolic shapes and shape-derived constants: what lets a rule prove two dims equal.

ONNX shape inference loses dims through the exporters' Shape/Gather/Concat -> Reshape chains (the
TorchScript exporter's head split comes out as (batch, seq, 4, unk__0)), and the scale, the GQA
expand and the masks are computed from those shapes. Here dims are sympy expressions (named dims
become symbols, unknown ones unique symbols) and shape vectors are evaluated symbolically with
canonicalize's evaluators, so "this Reshape merges exactly these two axes", "this residual has the
activation's shape" and "the scale is 1/sqrt(16)" are proven without static shapes. Two dims are
equal only when their expressions are (`same`); a dim of another name, or an unknown one, is not.
The graph is never changed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np
import sympy
from sympy.parsing.sympy_parser import parse_expr

from tkopt.ir import Node, Value

from .evaluators import EVALUATORS
from .patterns import GraphIndex, const_array, norm_axes, norm_axis

Shape = tuple[sympy.Expr, ...]
ELEMENTWISE = (
    "Add", "Sub", "Mul", "Div", "Cast", "Identity", "Neg", "Where", "Pow", "Sqrt", "Not", "And", "Or", "Xor",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Max", "Min", "Trilu",
    "aten::le", "aten::ge", "aten::ne", "aten::bitwise_not", "aten::bitwise_and", "aten::bitwise_or",
    "aten::logical_or", "aten::masked_fill",
)
SAME_SHAPE = (  # ops whose (first) output has their first input's shape
    "Softmax", "Dropout", "IsNaN", "Exp", "Erf", "Tanh", "Sigmoid", "Relu", "Reciprocal", "Gelu", "Silu", "Cos", "Sin",
    "Abs", "Log", "Rsqrt", "Softplus", "Clip", "aten::clamp", "aten::cos", "aten::sin", "LayerNormalization",
    "RMSNormalization", "FusedAddNorm", "aten::full_like", "aten::zeros_like", "aten::ones_like", "aten::dropout",
    "aten::native_dropout",
)
INT64_MAX = 2**63 - 1


def _trilu(n: Node, ins: Sequence[np.ndarray | None]) -> np.ndarray:
    k = int(np.asarray(ins[1]).reshape(-1)[0]) if len(ins) > 1 and ins[1] is not None else int(n.attrs.get("k", 0))
    return np.triu(ins[0], k) if n.attrs.get("upper", 1) else np.tril(ins[0], k)


def _arange(n: Node, ins: Sequence[np.ndarray | None]) -> np.ndarray:
    """aten::arange with numeric bounds (a symbolic one is a TypeError: not evaluated); torch's dtype rule:
    int64 when every bound is an int, else float32."""
    bounds = [n.attrs.get("start", 0), n.attrs["end"], n.attrs.get("step", 1)]
    if not all(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds):
        raise TypeError("symbolic arange bounds")
    dtype = n.attrs.get("dtype") or ("int64" if all(isinstance(b, int) for b in bounds) else "float32")
    return np.arange(*bounds).astype(dtype)


LOCAL_EVALUATORS = {
    **EVALUATORS, "Trilu": _trilu, "aten::arange": _arange,
    "aten::scalar_tensor": lambda n, i: np.asarray(n.attrs["s"], dtype=n.attrs.get("dtype") or "float32"),
}


def einsum_terms(n: Node) -> tuple[list[str], str] | None:
    """An Einsum node's (operand subscripts, output subscripts), spaces dropped; None for another op, an
    implicit output (no "->") or an ellipsis."""
    eq = n.attrs.get("equation") if n.op in ("Einsum", "aten::einsum") else None
    if not isinstance(eq, str) or "." in eq:
        return None
    ins, arrow, out = eq.replace(" ", "").partition("->")
    return (ins.split(","), out) if arrow else None


def same(a: sympy.Expr | None, b: sympy.Expr | None) -> bool:
    """Provably equal dims."""
    return a is not None and b is not None and sympy.expand(a - b) == 0


def as_int(d: sympy.Expr | None) -> int | None:
    return int(d) if d is not None and d.is_Integer else None


class ShapedIndex(GraphIndex):
    """A GraphIndex that also answers symbolic shapes. They are built on first use and stay cached
    across refreshes: a rewrite keeps every Value it leaves in the graph, and a Value's shape does
    not depend on which node produces it."""

    @functools.cached_property
    def shapes(self) -> Shapes:
        return Shapes(self)


class Shapes:
    """Symbolic shapes and values of one graph state (make a new one after the graph changes)."""

    def __init__(self, ix: GraphIndex) -> None:
        self.ix = ix
        self._shapes: dict[int, Shape | None] = {}
        self._values: dict[int, np.ndarray | None] = {}

    # ---- shapes -------------------------------------------------------------------------------
    def _declared(self, v: Value) -> Shape | None:
        if v.shape is None:
            return None
        return tuple(
            sympy.Integer(d) if isinstance(d, int)
            else _dim(d) if isinstance(d, str) else size_symbol(f"?{v.name}:{i}")
            for i, d in enumerate(v.shape)
        )

    def shape(self, v: Value | None) -> Shape | None:
        """The shape of `v`, refined through the producers that ONNX shape inference gives up on."""
        if v is None:
            return None
        if id(v) not in self._shapes:
            self._shapes[id(v)] = None  # cycle guard
            self._shapes[id(v)] = self._infer(v) or self._declared(v)
        return self._shapes[id(v)]

    def _infer(self, v: Value) -> Shape | None:
        p = self.ix.producer(v)
        if p is None:
            return None
        made = self._made_shape(p)
        if made is not None:
            return made
        src = self.shape(p.inputs[0]) if p.inputs and p.inputs[0] is not None else None
        if src is None:
            return None
        if p.op == "Split" and p.attrs.get("split") is not None and len(p.attrs["split"]) == len(p.outputs):
            axis = norm_axis(int(p.attrs.get("axis", 0)), len(src))
            size = p.attrs["split"][[id(o) for o in p.outputs].index(id(v))]
            return (*src[:axis], _dim(size) if isinstance(size, str) else sympy.Integer(size), *src[axis + 1:])
        if p.op in SAME_SHAPE and v is p.outputs[0]:
            return src
        if len(p.outputs) != 1:
            return None
        if p.op == "Squeeze" and p.attrs.get("axes") is not None:
            axes = set(norm_axes(p.attrs["axes"], len(src)) or ())
            return tuple(d for i, d in enumerate(src) if i not in axes)
        if p.op == "MatMul" and len(src) >= 2 and (other := self.shape(p.inputs[1])) is not None and len(other) >= 2:
            batch = _broadcast([src[:-2], other[:-2]])
            return None if batch is None else (*batch, src[-2], other[-1])
        if p.op == "Transpose" and p.attrs.get("perm") is not None:
            return tuple(src[i] for i in p.attrs["perm"])
        if (terms := einsum_terms(p)) is not None:
            return self._einsum_shape(p, *terms)
        if p.op == "Reshape":
            target = self._target(p)
            return None if target is None else _reshape(src, target, p.attrs.get("allowzero", 0))
        if p.op == "Unsqueeze" and p.attrs.get("axes") is not None:
            out = list(src)
            given = norm_axes(p.attrs["axes"], None) or ()
            for a in norm_axes(given, len(src) + len(given)) or ():
                out.insert(a, sympy.Integer(1))
            return tuple(out)
        if p.op == "Expand":
            target = self._target(p)
            if target is None:
                return None
            dims = [sympy.sympify(d) for d in target]
            lead = len(dims) - len(src)
            # aten.expand's -1 keeps the input's size (FX); ONNX Expand has no -1
            dims = [src[i - lead] if d == -1 and i >= lead else d for i, d in enumerate(dims)]
            return _broadcast([src, tuple(dims)])
        if p.op in ELEMENTWISE:
            shapes = [self.shape(i) for i in (p.inputs[:1] if p.op == "Trilu" else p.inputs) if i is not None]
            return None if any(s is None for s in shapes) else _broadcast(shapes)  # type: ignore[arg-type]
        if p.op == "Slice":
            return self._slice_shape(p, src)
        if p.op == "Concat":
            return self._concat_shape(p)
        if p.op in ("FusedGemm", "FusedGatedMLP") and (w := self.shape(p.inputs[1])) is not None and len(w) == 2:
            return (*src[:-1], w[0] if p.attrs.get("trans_b") else w[1])
        if p.op == "FusedAttention" and (vs := self.shape(p.inputs[2])) is not None:
            return (*src[:-1], vs[-1])
        if p.op == "GatherElements":
            return self.shape(p.inputs[1])
        if p.op == "Gather" and (idx := self.shape(p.inputs[1])) is not None:
            axis = norm_axis(int(p.attrs.get("axis", 0)), len(src))
            return (*src[:axis], *idx, *src[axis + 1:])
        return None

    def _einsum_shape(self, p: Node, terms: list[str], out: str) -> Shape | None:
        """Einsum (einsum_terms): each output letter's dim, broadcast over the operands that carry it."""
        shapes = [self.shape(i) for i in p.inputs]
        if len(terms) != len(shapes):
            return None
        dims: dict[str, list[Shape]] = {}
        for term, shape in zip(terms, shapes, strict=True):
            if shape is None or len(shape) != len(term):
                return None
            for letter, d in zip(term, shape, strict=True):
                dims.setdefault(letter, []).append((d,))
        found = [_broadcast(dims[c]) if c in dims else None for c in out]
        return None if any(d is None for d in found) else tuple(d[0] for d in found)  # type: ignore[index]

    def _concat_shape(self, p: Node) -> Shape | None:
        """Concat: the axis sums; every other axis is equal in every run (Concat requires it), so any
        input's dim serves, the first that is not an unknown placeholder preferred."""
        shapes = [self.shape(i) for i in p.inputs if i is not None]
        if not shapes or any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:  # type: ignore[arg-type]
            return None
        rank = len(shapes[0])  # type: ignore[arg-type]
        axis = norm_axis(int(p.attrs.get("axis", 0)), rank)
        out = []
        for a in range(rank):
            dims = [s[a] for s in shapes]  # type: ignore[index]
            if a == axis:
                out.append(sympy.Add(*dims))
            else:
                out.append(next((d for d in dims if not _opaque(d)), dims[0]))
        return tuple(out)

    def _made_shape(self, p: Node) -> Shape | None:
        """Shapes of tensors made from sizes: Range / aten::arange (1-D), ConstantOfShape, aten::full."""
        if p.op in ("Range", "aten::arange"):
            if p.op == "Range":
                start, limit, delta = (self.value(i) for i in p.inputs[:3])
                parts = [None if x is None else x.reshape(-1)[0] for x in (start, limit, delta)]
            else:
                parts = [p.attrs.get("start", 0), p.attrs.get("end"), p.attrs.get("step", 1)]
            if any(x is None for x in parts):
                return None
            start, limit, delta = (_size(x) for x in parts)
            if delta == 1:
                return (sympy.Max(limit - start, 0),) if start != 0 else (limit,)
            return None
        if p.op == "ConstantOfShape":
            dims = self.value(p.inputs[0])
            return None if dims is None else tuple(sympy.sympify(d) for d in dims.reshape(-1))
        if p.op in ("aten::full", "aten::ones", "aten::zeros", "aten::empty") and p.attrs.get("size") is not None:
            return tuple(_dim(d) if isinstance(d, str) else sympy.Integer(d) for d in p.attrs["size"])
        return None

    def slice_params(self, p: Node, rank: int) -> list[tuple[int, sympy.Expr, sympy.Expr, sympy.Expr]] | None:
        """A Slice's (axis, start, end, step) per sliced axis, from its attributes (canonical and FX form)
        or its inputs, symbolically; None when one cannot be read."""
        def operand(key: str, pos: int) -> list[object] | None:
            if p.attrs.get(key) is not None:
                return [_dim(d) if isinstance(d, str) else d for d in p.attrs[key]]
            if pos < len(p.inputs) and p.inputs[pos] is not None:
                data = self.value(p.inputs[pos])
                return None if data is None else list(data.reshape(-1))
            return None

        starts, ends = operand("starts", 1), operand("ends", 2)
        if starts is None or ends is None:
            return None
        axes = operand("axes", 3) or list(range(len(starts)))
        steps = operand("steps", 4) or [1] * len(starts)
        if not len(starts) == len(ends) == len(axes) == len(steps):
            return None
        out = []
        for a, b, e, st in zip(axes, starts, ends, steps, strict=True):
            a = sympy.sympify(a)
            if not a.is_Integer:
                return None
            out.append((norm_axis(int(a), rank), sympy.sympify(b), sympy.sympify(e), sympy.sympify(st)))
        return out

    def keeps_every_element(self, p: Node) -> bool:
        """Whether Slice `p` keeps every element of its input: its output shape (`_slice_shape`: step-1 slices from
        a non-negative start) is provably the input's. A dynamic export keeps the full slices of
        `x[:, :, None, :, :]` (Llama's repeat_kv), which a static one drops, and they hid the GQA repeat."""
        src = self.shape(p.inputs[0]) if p.inputs and p.inputs[0] is not None else None
        out = None if src is None else self._slice_shape(p, src)
        return out is not None and all(same(a, b) for a, b in zip(out, src, strict=True))

    def _slice_shape(self, p: Node, src: Shape) -> Shape | None:
        """Step-1 slices from a non-negative start: an end past the dim clamps, so the size is
        Min(end, dim) - start (sympy keeps Min symbolic: a buffer sliced to the sequence length)."""
        params = self.slice_params(p, len(src))
        if params is None:
            return None
        out = list(src)
        for axis, start, end, step in params:
            if step != 1 or not start.is_Integer or start < 0 or (end.is_Integer and end < 0):
                return None
            n = src[axis]
            top = n if end.is_Integer and end >= INT64_MAX // 2 else sympy.Min(end, n)
            out[axis] = sympy.Max(top - start, 0) if start != 0 else top
        return tuple(out)

    def _target(self, p: Node) -> list[object] | None:
        """A Reshape/Expand target shape: the (symbolically evaluated) input, else the attribute
        (where the FX frontend spells symbolic sizes as strings)."""
        if len(p.inputs) > 1 and p.inputs[1] is not None:
            data = self.value(p.inputs[1])
            return None if data is None else list(data.reshape(-1))
        attr = p.attrs.get("shape")
        return None if attr is None else [_dim(d) if isinstance(d, str) else d for d in attr]

    # ---- values -------------------------------------------------------------------------------
    def value(self, v: Value | None, depth: int = 24) -> np.ndarray | None:
        """The data of `v` if it depends only on constants and shapes; shape entries may be symbolic."""
        if v is None:
            return None
        if id(v) in self._values:
            return self._values[id(v)]
        data = const_array(self.ix, v)
        p = self.ix.producer(v)
        if data is None and p is not None and depth > 0 and len(p.outputs) == 1:
            data = self._evaluate(p, depth)
        self._values[id(v)] = data
        return data

    def _evaluate(self, p: Node, depth: int) -> np.ndarray | None:
        if p.op == "Shape":
            s = self.shape(p.inputs[0])
            if s is None:
                return None
            out = np.empty(len(s), dtype=object)
            out[:] = [int(d) if d.is_Integer else d for d in s]
            return out[p.attrs.get("start", 0):p.attrs.get("end")]
        if p.op not in LOCAL_EVALUATORS:
            return None
        ins = [None if i is None else self.value(i, depth - 1) for i in p.inputs]
        if any(a is None and i is not None for a, i in zip(ins, p.inputs, strict=True)):
            return None
        if p.op == "Cast" and p.attrs.get("to") != "bool" and _symbolic(ins[0]):
            return ins[0]  # a symbolic size cast to a number keeps its value (sizes are below 2**24)
        if p.op in RELATIONS and any(_symbolic(a) for a in ins if a is not None):
            return _decide(RELATIONS[p.op], ins[0], ins[1])
        try:
            out = np.asarray(LOCAL_EVALUATORS[p.op](p, ins))
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, ZeroDivisionError):
            return None
        return out

    def scalar(self, v: Value | None) -> float | None:
        """The value of a (shape-derived) constant whose elements are all equal (a broadcast scalar), else None."""
        c = self.const(v)
        if c is None or c.size == 0 or c.dtype == bool:
            return None
        flat = c.reshape(-1).astype(np.float64)
        return float(flat[0]) if np.all(flat == flat[0]) else None

    def const(self, v: Value | None) -> np.ndarray | None:
        """The numeric data of `v` when it is (shape-derived) constant, else None."""
        data = self.value(v)
        if data is None or data.dtype != object:
            return data
        try:
            if all(isinstance(x, int | float | np.number) or (isinstance(x, sympy.Expr) and x.is_number)
                   for x in data.reshape(-1)):
                return data.astype(np.float64 if any(isinstance(x, float) for x in data.reshape(-1)) else np.int64)
        except (TypeError, ValueError):
            pass
        return None


RELATIONS = {"Equal": sympy.Eq, "Less": sympy.Lt, "Greater": sympy.Gt, "LessOrEqual": sympy.Le,
             "GreaterOrEqual": sympy.Ge}


def _decide(rel: type, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """A comparison of symbolic sizes, elementwise, where it is decided for every size (else None):
    numpy would compare the expressions structurally (s == 1 as False)."""
    out = []
    for x, y in np.broadcast(a, b):
        r = rel(sympy.sympify(x), sympy.sympify(y))
        if r not in (sympy.true, sympy.false):
            return None
        out.append(bool(r))
    return np.array(out, dtype=bool).reshape(np.broadcast_shapes(a.shape, b.shape))


def shape_mismatch(shapes: Shapes, a: Value, b: Value) -> str | None:
    """Why `a` may not have `b`'s shape for some admitted input; None when it provably has. A dim of
    another name or an unknown one may be 1 at run time (ONNX broadcasting), so only equal
    expressions count."""
    sa, sb = shapes.shape(a), shapes.shape(b)
    if sa is None or sb is None:
        return f"the shape of {a.name if sa is None else b.name} is unknown"
    if len(sa) != len(sb):
        return f"{a.name} has rank {len(sa)}, {b.name} rank {len(sb)}"
    for i, (x, y) in enumerate(zip(sa, sb, strict=True)):
        if not same(x, y):
            return f"axis {i} of {a.name} ({x}) is not provably {b.name}'s ({y}): it may broadcast"
    return None


def size_symbol(name: str) -> sympy.Symbol:
    """A symbolic size: a non-negative integer, so that "s == -1" is decidably false and "s == 1" is not."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


def _symbolic(data: np.ndarray) -> bool:
    return data.dtype == object and any(isinstance(x, sympy.Expr) and not x.is_number for x in data.reshape(-1))


def _size(x: object) -> sympy.Expr:
    """A size or index as sympy: integral numbers (numpy floats too) as Integers, names as symbols."""
    if isinstance(x, str):
        return _dim(x)
    if isinstance(x, int | float | np.number) and float(x).is_integer():
        return sympy.Integer(int(x))
    return sympy.sympify(x)


def _opaque(d: sympy.Expr) -> bool:
    """A placeholder for a dim nothing is known about (see Shapes._declared)."""
    return isinstance(d, sympy.Symbol) and d.name.startswith("?")


@functools.lru_cache(maxsize=4096)
def _dim(text: str) -> sympy.Expr:
    """A symbolic dim: a name ("batch", "unk__3", "s0") or the FX frontend's expression ("4*s77")."""
    names = {n: size_symbol(n) for n in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)}
    try:
        return sympy.sympify(parse_expr(text, local_dict=names, global_dict={"Integer": sympy.Integer}))
    except Exception:  # noqa: BLE001 - any name the parser cannot read is just an opaque symbol
        return size_symbol(text)


def _reshape(src: Shape, target: list[object], allowzero: int) -> Shape | None:
    dims = [sympy.sympify(d) for d in target]
    out: list[sympy.Expr | None] = []
    for i, d in enumerate(dims):
        if d == 0 and not allowzero:
            if i >= len(src):
                return None
            out.append(src[i])
        elif d == -1:
            out.append(None)
        else:
            out.append(d)
    if out.count(None) > 1:
        return None
    if None in out:
        known = sympy.Mul(*[d for d in out if d is not None])
        out[out.index(None)] = _simplified(sympy.Mul(*src) / known)
    return tuple(out)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=4096)
def _simplified(expr: sympy.Expr) -> sympy.Expr:
    """sympy.simplify, memoized, and skipped for a monomial (an integer times sizes to positive integer powers),
    which it returns unchanged: a model asks for the same few reshape sizes once per layer (GPT-2: 200
    calls), and simplify is slow (a process's first call ~0.2 s, later ones ~1 ms)."""
    return expr if _monomial(expr) else sympy.simplify(expr)


def _monomial(expr: sympy.Expr) -> bool:
    def factor(f: sympy.Expr) -> bool:
        return f.is_Integer or f.is_Symbol or (f.is_Pow and f.base.is_Symbol and f.exp.is_Integer and f.exp > 0)

    return factor(expr) or (expr.is_Mul and all(factor(f) for f in expr.args))


def _broadcast(shapes: Sequence[Shape]) -> Shape | None:
    """The broadcast shape, where provable. A buffer clamped to a dim (Min(s, n), a slice to the sequence
    length) against s itself gives s: either they are equal or the clamp is 1 (else the graph fails)."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        real = [d for d in dims if d != 1]
        plain = [d for d in real if not isinstance(d, sympy.Min)]
        real = [d for d in real if not (isinstance(d, sympy.Min) and any(same(a, p) for a in d.args for p in plain))]
        if not real:
            out.append(sympy.Integer(1))
        elif all(same(real[0], d) for d in real[1:]):
            out.append(real[0])
        else:
            return None
    return tuple(out)
