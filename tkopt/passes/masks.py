"""Proving a mask causal from the graph's structure, for every size the graph admits.

A mask computed from constants and shapes only (iota comparisons, Trilu, a constant buffer sliced from
its corner, Where between constant fills, masked_fill) is interpreted abstractly: each tensor becomes a
function of its element index, either integer-affine (`Affine`: Range / arange and sums of them) or
piecewise constant in one integer linear form of the index (`Steps`: a comparison of affine values,
Trilu's diagonal, a constant buffer that is constant along its diagonals or along an axis) with integer
cut points. Every transfer rule below is exact for all sizes, and a piecewise-constant function is
equal to another everywhere once it is equal at every cut point and its neighbours, so "keeps exactly
j <= i over its last two axes" is a proof, not a sample. Anything else (a symbolic cut such as a
KV-cache offset, an op without a rule, a buffer that is no function of one diagonal or axis) gives no
proof, and the caller keeps the mask as an explicit input. See docs/LEGALITY.md.

A constant buffer is described only over its own extent; that is enough because slices read inside it,
and a mask whose last two axes are provably the scores' (Sq, Skv), or a buffer clamped to them
(Min(Sq, n), n >= 2), is read at index (i, j) for query i and key j.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy

from tkopt.ir import Node, Value

from .patterns import GraphIndex, norm_axes
from .shapes import Shape, Shapes, _dim, same

MAX_DEPTH = 48
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "float64": np.float64,
             "int64": np.int64, "int32": np.int32, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


@dataclass(frozen=True)
class Affine:
    """f(index) = sum(coef[a] * index[a]) + const, integers (an iota and what is added to it)."""

    coef: tuple[int, ...]
    const: int


@dataclass(frozen=True)
class Steps:
    """f(index) = values[k] for x = sum(coef[a] * index[a]) in region k: (-inf, cuts[0]], (cuts[0], cuts[1]],
    ..., (cuts[-1], inf). `coef` is primitive with its first nonzero positive, or all zero (a constant)."""

    coef: tuple[int, ...]
    cuts: tuple[int, ...]
    values: tuple[Any, ...]

    def at(self, x: int) -> Any:
        return self.values[bisect.bisect_left(self.cuts, x)]


Fn = Affine | Steps


def steps(coef: Sequence[int], cuts: Sequence[int], values: Sequence[Any]) -> Steps:
    """A normalized Steps: equal neighbours merged, the form made primitive with a positive lead."""
    g = math.gcd(*coef) if any(coef) else 0
    if g == 0:
        return Steps(tuple(0 for _ in coef), (), (Steps((), tuple(cuts), tuple(values)).at(0),))
    sign = 1 if next(c for c in coef if c) > 0 else -1
    pairs = list(zip(cuts, values, strict=False)) + [(None, values[-1])]
    if sign < 0:  # x_old = -x_new: (c0, c1] becomes [-c1, -c0) = (-c1 - 1, -c0 - 1]
        rev = [(-c - 1, v) for c, v in zip(cuts, values[1:], strict=True)][::-1]
        pairs = [*rev, (None, values[0])]
    if g > 1:  # x_old = g * x_new: the cut c becomes floor(c / g); regions left empty drop out
        pairs = [(None if c is None else c // g, v) for c, v in pairs]
    merged: list[tuple[int | None, Any]] = []
    for c, v in pairs:
        if merged and merged[-1][0] is not None and c is not None and merged[-1][0] >= c:
            continue  # empty region
        if merged and _equal(merged[-1][1], v):
            merged[-1] = (c, v)
            continue
        merged.append((c, v))
    if len(merged) == 1:  # no cut left: a constant
        return Steps(tuple(0 for _ in coef), (), (merged[0][1],))
    new_coef = tuple(c // (sign * g) for c in coef)
    return Steps(new_coef, tuple(c for c, _ in merged[:-1]), tuple(v for _, v in merged))  # type: ignore[misc]


def constant(value: Any, rank: int) -> Steps:
    return Steps((0,) * rank, (), (value,))


def _equal(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (bool(a == b) or (_isnan(a) and _isnan(b)))


def _isnan(a: Any) -> bool:
    return isinstance(a, np.floating | float) and bool(np.isnan(a))


def _cast(value: Any, dtype: str | None) -> Any:
    np_dtype = NP_DTYPES.get(dtype or "")
    return np.asarray(value) if np_dtype is None else np.asarray(value).astype(np_dtype)[()]


# ---- combining functions --------------------------------------------------------------------------
def pointwise(fns: Sequence[Steps], op: Callable[..., Any], dtype: str | None) -> Steps | None:
    """op applied elementwise to functions of one rank; None when two vary along different forms."""
    forms = {f.coef for f in fns if any(f.coef)}
    if len(forms) > 1:
        return None
    coef = forms.pop() if forms else fns[0].coef
    cuts = sorted(set().union(*(f.cuts for f in fns)))
    reps = [*cuts, cuts[-1] + 1] if cuts else [0]  # one point per region: its right end, and past the last
    with np.errstate(all="ignore"):
        values = [_cast(op(*(f.at(x) for f in fns)), dtype) for x in reps]
    return steps(coef, cuts, values)


def _as_steps(fn: Fn) -> Steps | None:
    if isinstance(fn, Steps):
        return fn
    return constant(np.int64(fn.const), len(fn.coef)) if not any(fn.coef) else None


def _le_zero(coef: tuple[int, ...], k: int) -> Steps:
    """Truth of sum(coef * index) + k <= 0."""
    if not any(coef):
        return constant(np.bool_(k <= 0), len(coef))
    g = math.gcd(*coef)
    t = g if next(c for c in coef if c) > 0 else -g  # sum = t * x, x the primitive form
    prim = tuple(c // t for c in coef)
    if t > 0:
        return Steps(prim, ((-k) // t,), (np.True_, np.False_))  # x <= floor(-k / t)
    return Steps(prim, (-((-k) // (-t)) - 1,), (np.False_, np.True_))  # x >= ceil(k / -t)


COMPARE = {
    "le": lambda c, k: _le_zero(c, k),
    "lt": lambda c, k: _le_zero(c, k + 1),
    "ge": lambda c, k: _le_zero(tuple(-x for x in c), -k),
    "gt": lambda c, k: _le_zero(tuple(-x for x in c), -k + 1),
}
COMPARE_OPS = {"LessOrEqual": "le", "aten::le": "le", "Less": "lt", "Greater": "gt", "GreaterOrEqual": "ge",
               "aten::ge": "ge", "Equal": "eq", "aten::ne": "ne"}
NUMPY_COMPARE = {"le": np.less_equal, "lt": np.less, "ge": np.greater_equal, "gt": np.greater, "eq": np.equal,
                 "ne": np.not_equal}


def _compare(a: Fn, b: Fn, how: str) -> Steps | None:
    """a <how> b for affine (or constant) operands; pointwise for piecewise-constant ones."""
    sa, sb = _as_steps(a), _as_steps(b)
    if isinstance(a, Affine) or isinstance(b, Affine):
        la = a if isinstance(a, Affine) else _affine_const(sa, len(a.coef))
        lb = b if isinstance(b, Affine) else _affine_const(sb, len(b.coef))
        if la is None or lb is None:
            return None
        coef = tuple(x - y for x, y in zip(la.coef, lb.coef, strict=True))
        k = la.const - lb.const
        if how in COMPARE:
            return COMPARE[how](coef, k)
        eq = pointwise([_le_zero(coef, k), _le_zero(tuple(-x for x in coef), -k)], np.logical_and, "bool")
        return eq if how == "eq" or eq is None else pointwise([eq], np.logical_not, "bool")
    if sa is None or sb is None:
        return None
    return pointwise([sa, sb], NUMPY_COMPARE[how], "bool")


def _affine_const(s: Steps | None, rank: int) -> Affine | None:
    """A constant integer as an Affine of `rank` (comparing an iota with a number)."""
    if s is None or any(s.coef) or not isinstance(s.values[0], np.integer | int | np.floating | float):
        return None
    v = s.values[0]
    if not float(v).is_integer():
        return None
    return Affine((0,) * rank, int(v))


# ---- index maps ---------------------------------------------------------------------------------
def remap(fn: Fn, coef: Sequence[int], shift: int = 0) -> Fn:
    """`fn` with a new coefficient vector (the same axes reindexed) and x shifted: f(x + shift)."""
    if isinstance(fn, Affine):
        return Affine(tuple(coef), fn.const + shift)
    return steps(coef, [c - shift for c in fn.cuts], fn.values)


def broadcast_to(fn: Fn, src: Shape | None, out: Shape | None) -> Fn | None:
    """`fn` of a tensor of shape `src` read as broadcast to `out`: an axis of size 1 is read at index 0
    (its coefficient drops); an axis that varies must provably keep its size."""
    rank = len(fn.coef)
    if out is None or len(out) < rank:
        return None
    coef = [0] * (len(out) - rank) + list(fn.coef)
    if not any(coef):
        return remap(fn, coef)
    if src is None or len(src) != rank:
        return None
    for a, (d_in, d_out) in enumerate(zip(src, out[len(out) - rank:], strict=True)):
        ax = a + len(out) - rank
        if coef[ax] == 0 or same(d_in, d_out):
            continue
        if d_in == 1:
            coef[ax] = 0
            continue
        return None
    return remap(fn, coef)


# ---- lifting constants --------------------------------------------------------------------------
def lift(c: np.ndarray) -> Fn | None:
    """A constant array as an index function: constant, an arithmetic progression along one axis, or
    piecewise constant along one axis or along the diagonals of its last two axes (same in every
    leading plane). Described over the array's own extent; None for anything else."""
    if c.size == 0 or c.dtype == object:
        return None
    r = c.ndim
    flat = c.reshape(-1)
    if np.all(flat == flat[0]) or (flat.dtype.kind == "f" and np.all(np.isnan(flat))):
        return constant(flat[0], r)
    for axis in range(r):  # a function of one axis
        line = np.moveaxis(c, axis, -1).reshape(-1, c.shape[axis])
        if np.array_equal(line, np.broadcast_to(line[:1], line.shape), equal_nan=c.dtype.kind == "f"):
            return _lift_line(line[0], tuple(int(a == axis) for a in range(r)))
    if r < 2:
        return None
    planes = c.reshape(-1, *c.shape[-2:])
    if not np.array_equal(planes, np.broadcast_to(planes[:1], planes.shape), equal_nan=c.dtype.kind == "f"):
        return None
    plane = planes[0]
    n, m = plane.shape
    seq = []  # x = i - j from -(m - 1) to n - 1
    for x in range(-(m - 1), n):
        diag = np.diagonal(plane, offset=-x)
        if not np.all((diag == diag[0]) | (np.isnan(diag) & np.isnan(diag[0]) if diag.dtype.kind == "f" else False)):
            return None
        seq.append(diag[0])
    cuts = [x for x, (a, b) in enumerate(zip(seq, seq[1:], strict=False), start=-(m - 1)) if not _equal(a, b)]
    values = [seq[0], *(seq[x + m] for x in cuts)]
    return steps((0,) * (r - 2) + (1, -1), cuts, values)


def _lift_line(line: np.ndarray, coef: tuple[int, ...]) -> Fn:
    if line.dtype.kind in "iu" and len(line) > 1:
        d = np.diff(line)
        if np.all(d == d[0]) and d[0] != 0:
            return Affine(tuple(int(d[0]) * c for c in coef), int(line[0]))
    cuts = [t for t in range(len(line) - 1) if not _equal(line[t], line[t + 1])]
    return steps(coef, cuts, [line[0], *(line[t + 1] for t in cuts)])


# ---- the interpreter ----------------------------------------------------------------------------
class MaskAnalysis:
    """Index functions of values computed from constants and shapes (memoized per graph state)."""

    def __init__(self, ix: GraphIndex, shapes: Shapes) -> None:
        self.ix = ix
        self.shapes = shapes
        self._memo: dict[int, Fn | None] = {}

    def fn(self, v: Value | None, depth: int = MAX_DEPTH) -> Fn | None:
        if v is None or depth == 0:
            return None
        if id(v) not in self._memo:
            self._memo[id(v)] = None  # cycle guard
            self._memo[id(v)] = self._fn(v, depth)
        return self._memo[id(v)]

    def _fn(self, v: Value, depth: int) -> Fn | None:
        data = self.shapes.const(v)
        if data is not None:
            return lift(np.asarray(data))
        p = self.ix.producer(v)
        if p is None or len(p.outputs) != 1:
            return None
        rule = RULES.get(p.op)
        return None if rule is None else rule(self, p, depth - 1)

    # helpers for the rules
    def shape(self, v: Value | None) -> Shape | None:
        return self.shapes.shape(v)

    def rank(self, v: Value) -> int | None:
        s = self.shapes.shape(v)
        return None if s is None else len(s)

    def operand(self, p: Node, i: int, depth: int) -> Fn | None:
        """Input i of p as a function over p's output index (broadcast to the output shape); an aten op's
        scalar second operand (aten::ge.Scalar's `other`) is a constant."""
        out = self.shape(p.outputs[0])
        if i >= len(p.inputs) or p.inputs[i] is None:
            x = p.attrs.get("other")
            if out is None or not isinstance(x, int | float | bool):
                return None
            return constant(np.asarray(x)[()], len(out))
        v = p.inputs[i]
        fn = self.fn(v, depth)
        return None if fn is None else broadcast_to(fn, self.shape(v), out)

    def int_scalar(self, v: Value | None, attr: object = None) -> int | None:
        if attr is not None:
            d = _dim(attr) if isinstance(attr, str) else sympy.sympify(attr)
            return int(d) if d.is_Integer else None
        data = None if v is None else self.shapes.value(v)
        if data is None or data.size != 1:
            return None
        d = sympy.sympify(data.reshape(-1)[0])
        return int(d) if d.is_Integer else None


Rule = Callable[[MaskAnalysis, Node, int], "Fn | None"]


def _unary(op: Callable[[Any], Any]) -> Rule:
    def rule(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
        fn = ma.fn(p.inputs[0], depth)
        s = None if fn is None else _as_steps(fn)
        return None if s is None else pointwise([s], op, p.outputs[0].dtype)

    return rule


def _binary(op: Callable[[Any, Any], Any]) -> Rule:
    def rule(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
        a, b = ma.operand(p, 0, depth), ma.operand(p, 1, depth)
        if a is None or b is None:
            return None
        if isinstance(a, Affine) or isinstance(b, Affine):
            return _affine_arith(a, b, op)
        return pointwise([a, b], op, p.outputs[0].dtype)

    return rule


def _affine_arith(a: Fn, b: Fn, op: Callable[[Any, Any], Any]) -> Affine | None:
    """Integer-affine + - * with affine or integer-constant operands (what iota arithmetic needs)."""
    la = a if isinstance(a, Affine) else _affine_const(a, len(b.coef))
    lb = b if isinstance(b, Affine) else _affine_const(b, len(a.coef))
    if la is None or lb is None:
        return None
    if op is np.add or op is np.subtract:
        sign = 1 if op is np.add else -1
        return Affine(tuple(x + sign * y for x, y in zip(la.coef, lb.coef, strict=True)), la.const + sign * lb.const)
    if op is np.multiply:
        if not any(lb.coef):
            return Affine(tuple(x * lb.const for x in la.coef), la.const * lb.const)
        if not any(la.coef):
            return Affine(tuple(x * la.const for x in lb.coef), la.const * lb.const)
    return None


def _compare_rule(how: str) -> Rule:
    def rule(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
        a, b = ma.operand(p, 0, depth), ma.operand(p, 1, depth)
        return None if a is None or b is None else _compare(a, b, how)

    return rule


def _where(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    fns = [ma.operand(p, i, depth) for i in range(3)]
    parts = [None if f is None else _as_steps(f) for f in fns]
    if any(s is None for s in parts):
        return None
    return pointwise(parts, lambda c, a, b: a if c else b, p.outputs[0].dtype)  # type: ignore[arg-type]


def _masked_fill(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """aten::masked_fill(x, mask; value) = Where(mask, value, x)."""
    x, m = ma.operand(p, 0, depth), ma.operand(p, 1, depth)
    sx, sm = (None if f is None else _as_steps(f) for f in (x, m))
    if sx is None or sm is None or "value" not in p.attrs:
        return None
    fill = p.attrs["value"]
    return pointwise([sm, sx], lambda c, a: fill if c else a, p.outputs[0].dtype)


def _cast_rule(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    fn = ma.fn(p.inputs[0], depth)
    to = p.attrs.get("to", p.outputs[0].dtype)
    if isinstance(fn, Affine):
        if to == "bool":
            return _compare(fn, constant(np.int64(0), len(fn.coef)), "ne")
        return fn  # integer indices are exact in every float type up to 2**24 elements per axis
    return None if fn is None else pointwise([fn], lambda a: a, to)


def _identity(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    return ma.fn(p.inputs[0], depth)


def _expand(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    return ma.operand(p, 0, depth)


def _unsqueeze(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    fn = ma.fn(p.inputs[0], depth)
    given = norm_axes(p.attrs.get("axes"), None)
    if fn is None or given is None:
        return None
    coef = list(fn.coef)
    for a in norm_axes(given, len(coef) + len(given)) or ():
        coef.insert(a, 0)
    return remap(fn, coef)


def _squeeze(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    fn = ma.fn(p.inputs[0], depth)
    src = ma.shape(p.inputs[0])
    axes = p.attrs.get("axes")
    if fn is None or src is None:
        return None
    rank = len(src)
    drop = set(norm_axes(axes, rank) or ()) if axes is not None else {a for a, d in enumerate(src) if d == 1}
    if any(src[a] != 1 for a in drop):
        return None
    return remap(fn, [c for a, c in enumerate(fn.coef) if a not in drop])


def _transpose(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    fn = ma.fn(p.inputs[0], depth)
    perm = p.attrs.get("perm")
    if fn is None or perm is None or len(perm) != len(fn.coef):
        return None
    return remap(fn, [fn.coef[a] for a in perm])


def _reshape(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """Only reshapes that add or remove size-1 axes: the varying axes keep their order and sizes."""
    fn = ma.fn(p.inputs[0], depth)
    src, out = ma.shape(p.inputs[0]), ma.shape(p.outputs[0])
    if fn is None or src is None or out is None:
        return None
    keep_in = [a for a, d in enumerate(src) if d != 1]
    keep_out = [a for a, d in enumerate(out) if d != 1]
    if len(keep_in) != len(keep_out) or not all(same(src[a], out[b]) for a, b in zip(keep_in, keep_out, strict=True)):
        return None
    coef = [0] * len(out)
    for a, b in zip(keep_in, keep_out, strict=True):
        coef[b] = fn.coef[a]
    return remap(fn, coef)


def _slice(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """Index a of the slice reads index start + step * a of its input (starts read as given: a
    non-negative integer, or a negative one on a static axis)."""
    fn = ma.fn(p.inputs[0], depth)
    src = ma.shape(p.inputs[0])
    if fn is None or src is None:
        return None
    params = ma.shapes.slice_params(p, len(src))
    if params is None:
        return None
    coef, shift = list(fn.coef), 0
    for axis, start, _end, step in params:
        if coef[axis] == 0:
            continue
        if not (start.is_Integer and step.is_Integer and int(step) > 0):
            return None
        s = int(start)
        if s < 0:
            if not src[axis].is_Integer:
                return None
            s = max(0, int(src[axis]) + s)
        if isinstance(fn, Steps) and int(step) != 1:
            return None
        shift += coef[axis] * s
        coef[axis] *= int(step)
    return remap(fn, coef, shift)


def _trilu(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """Trilu keeps j - i <= k (lower) or j - i >= k (upper) of its last two axes, zero elsewhere."""
    x = ma.fn(p.inputs[0], depth)
    given = len(p.inputs) > 1 and p.inputs[1] is not None
    k = ma.int_scalar(p.inputs[1]) if given else ma.int_scalar(None, p.attrs.get("k", 0))
    sx = None if x is None else _as_steps(x)
    if sx is None or k is None or len(sx.coef) < 2:
        return None
    r = len(sx.coef)
    j_minus_i = tuple(0 for _ in range(r - 2)) + (-1, 1)
    keep = COMPARE["ge" if p.attrs.get("upper", 1) else "le"](j_minus_i, -k)
    zero = _cast(0, p.outputs[0].dtype)
    return pointwise([keep, sx], lambda c, a: a if c else zero, p.outputs[0].dtype)


def _range(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    if p.op == "Range":
        start, delta = ma.int_scalar(p.inputs[0]), ma.int_scalar(p.inputs[2])
    else:
        start, delta = ma.int_scalar(None, p.attrs.get("start", 0)), ma.int_scalar(None, p.attrs.get("step", 1))
    if start is None or delta is None or delta == 0:
        return None
    return Affine((delta,), start)


def _gather_index(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """aten::index(x, idx_0, ..., idx_r-1) with one index tensor per axis of x (no skipped axis, so the
    flattened operands are unambiguous): out[o] = x[idx_0(o), ...]. Each index must be an iota over one
    output axis that provably has the indexed axis' size (0 <= index < size: no negative wrap-around)."""
    src = ma.shape(p.inputs[0])
    out = ma.shape(p.outputs[0])
    fn = ma.fn(p.inputs[0], depth)
    idx = p.inputs[1:]
    if fn is None or src is None or out is None or len(idx) != len(src) or any(i is None for i in idx):
        return None
    form, const = [0] * len(out), 0
    for a, i in enumerate(idx):
        g = ma.fn(i, depth)
        g = None if g is None else broadcast_to(g, ma.shape(i), out)
        if not isinstance(g, Affine) or g.const != 0 or sorted(g.coef) != [0] * (len(out) - 1) + [1]:
            return None
        axis = g.coef.index(1)
        if not same(out[axis], src[a]):
            return None
        form[axis] += fn.coef[a]
    if isinstance(fn, Affine):
        return Affine(tuple(form), fn.const + const)
    return steps(form, fn.cuts, fn.values)


def _cumsum(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """aten::cumsum of a constant c along `dim`: c * (index + 1) (0 for c = 0, a bool False)."""
    fn = ma.fn(p.inputs[0], depth)
    rank = ma.rank(p.outputs[0])
    if not isinstance(fn, Steps) or any(fn.coef) or rank is None or "dim" not in p.attrs:
        return None
    c = fn.values[0]
    if not isinstance(c, np.integer | np.bool_ | int | bool):
        return None
    axis = norm_axes(p.attrs["dim"], rank)[0]  # type: ignore[index]
    return Affine(tuple(int(c) if a == axis else 0 for a in range(rank)), int(c))


def _diff(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """aten::diff(x, n=1, dim, prepend=pre) of an affine x: x[j] - x[j-1] for j >= 1 (the coefficient of
    `dim`), x[0] - pre at j = 0 (a constant when the affine parts cancel)."""
    x = ma.fn(p.inputs[0], depth)
    rank = ma.rank(p.outputs[0])
    if not isinstance(x, Affine) or rank is None or p.attrs.get("n", 1) != 1 or p.attrs.get("append") is not None:
        return None
    if len(p.inputs) != 2 or "dim" not in p.attrs:
        return None
    pre = ma.fn(p.inputs[1], depth)
    axis = norm_axes(p.attrs["dim"], rank)[0]  # type: ignore[index]
    if not isinstance(pre, Affine) or len(pre.coef) != rank:
        return None
    first = [c - d if a != axis else 0 for a, (c, d) in enumerate(zip(x.coef, pre.coef, strict=True))]
    if any(first):
        return None
    step, start = x.coef[axis], x.const - pre.const
    dtype = p.outputs[0].dtype
    return steps(tuple(int(a == axis) for a in range(rank)), [0], [_cast(start, dtype), _cast(step, dtype)])


def _filled(ma: MaskAnalysis, p: Node, depth: int) -> Fn | None:
    """A tensor of one value: ConstantOfShape, aten::full/ones/zeros (and their _like forms)."""
    rank = ma.rank(p.outputs[0])
    if rank is None:
        return None
    if p.op == "ConstantOfShape":
        value = np.asarray(p.attrs.get("value", np.zeros(1, np.float32))).reshape(-1)[0]
    elif p.op in ("aten::full", "aten::full_like", "aten::new_full", "aten::scalar_tensor"):
        value = p.attrs.get("fill_value", p.attrs.get("s"))
    else:
        value = 1 if "ones" in p.op else 0
    return None if value is None else constant(_cast(value, p.outputs[0].dtype), rank)


AND_OPS = ("And", "aten::bitwise_and", "aten::logical_and", "aten::__and__")
NOT_OPS = ("Not", "aten::bitwise_not", "aten::logical_not")
OR_OPS = ("Or", "aten::bitwise_or", "aten::logical_or", "aten::__or__")
RULES: dict[str, Rule] = {
    "Identity": _identity, "aten::clone": _identity, "aten::contiguous": _identity, "aten::alias": _identity,
    "aten::detach": _identity, "aten::lift_fresh_copy": _identity,
    "Cast": _cast_rule, "Expand": _expand, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze, "Transpose": _transpose,
    "Reshape": _reshape, "Slice": _slice, "Trilu": _trilu, "Where": _where, "aten::masked_fill": _masked_fill,
    "Range": _range, "aten::arange": _range, "aten::index": _gather_index, "aten::cumsum": _cumsum,
    "aten::diff": _diff,
    **{op: _filled for op in ("ConstantOfShape", "aten::full", "aten::ones", "aten::zeros", "aten::full_like",
                              "aten::ones_like", "aten::zeros_like", "aten::new_ones", "aten::new_zeros",
                              "aten::new_full", "aten::scalar_tensor")},
    **{op: _unary(np.logical_not) for op in NOT_OPS},
    "Neg": _unary(np.negative),
    **{op: _binary(fn) for op, fn in {
        "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Max": np.maximum,
        "Min": np.minimum, "Xor": np.logical_xor,
        **{op: np.logical_and for op in AND_OPS}, **{op: np.logical_or for op in OR_OPS},
    }.items()},
    **{op: _compare_rule(how) for op, how in COMPARE_OPS.items()},
}


# ---- the question the attention rule asks ----------------------------------------------------------
@dataclass(frozen=True)
class Causal:
    """A mask proven to drop exactly the keys after each query (top-left), with the value it gives them:
    -inf, a finite fill (an additive finfo.min mask), or None for a bool mask (the Where decides)."""

    fill: float | None


def aligned(mask_dim: sympy.Expr, score_dim: object) -> bool:
    """The mask axis is the scores' axis for every admitted size: the same dim, or a buffer of n >= 2
    clamped to it (Min(S, n): if S > n the mask could not broadcast, and S = 1 reads index 0 either way)."""
    if score_dim is None:
        return False
    if same(mask_dim, score_dim):  # type: ignore[arg-type]
        return True
    if isinstance(mask_dim, sympy.Min):
        rest = [a for a in mask_dim.args if not same(a, score_dim)]  # type: ignore[arg-type]
        return len(rest) < len(mask_dim.args) and all(a.is_Integer and a >= 2 for a in rest)
    return False


def prove_causal(ma: MaskAnalysis, mask: Value, kind: str, scores: Shape | None) -> Causal | None:
    """Whether `mask` (kind "keep": a bool keeping where True, "drop": a bool dropping where True, "add":
    added to the scores) keeps exactly key j <= query i (top-left) for every admitted (Sq, Skv): a
    Causal with its fill, or None (no proof: the caller keeps the mask as an input)."""
    fn = ma.fn(mask)
    shape = ma.shape(mask)
    if not isinstance(fn, Steps) or shape is None or scores is None or len(shape) < 2 or len(fn.coef) != len(shape):
        return None
    if fn.coef != (0,) * (len(shape) - 2) + (1, -1):  # x = i - j over the last two axes
        return None
    if not (aligned(shape[-2], scores[-2]) and aligned(shape[-1], scores[-1])):
        return None
    fills = set()
    points = {p for c in fn.cuts for p in (c - 1, c, c + 1)} | {-1, 0, 1}
    for x in sorted(points):
        v = fn.at(x)
        if kind == "add":
            keep, fill = _additive(v, mask.dtype)
            if keep is None:
                return None  # a value that is neither 0 nor a masking fill: a bias, not a mask
        else:
            keep, fill = bool(v) if kind == "keep" else not bool(v), None
        if keep != (x >= 0):
            return None
        if not keep:
            fills.add(fill)
    if len(fills) != 1:
        return None
    return Causal(fills.pop())


def keeps_everywhere(ma: MaskAnalysis, v: Value, kind: str) -> bool:
    """Whether bool mask `v` (kind "keep" or "drop") keeps every score at every admitted size: a structural
    mask whose value is the same keep at every index combination it can reach (indices are >= 0, so a form
    with no negative coefficient reaches x >= 0 only). transformers' bidirectional masks And such a factor
    (q_idx >= 0) with the padding."""
    values = _reachable(ma.fn(v))
    return values is not None and all(bool(x) == (kind == "keep") for x in values)


def _reachable(fn: Fn | None) -> list[Any] | None:
    """The values a structural mask takes at the index combinations it can reach (indices are >= 0, so a form
    with no negative coefficient reaches x >= 0 only); None where `fn` is no such mask."""
    if not isinstance(fn, Steps) or not fn.values:
        return None
    reach_from = 0 if all(c >= 0 for c in fn.coef) else None
    return [fn.values[k] for k in range(len(fn.values))
            if reach_from is None or k == len(fn.cuts) or fn.cuts[k] >= reach_from]


def keeps_all(ma: MaskAnalysis, v: Value, kind: str) -> bool:
    """Whether mask `v` (kind as in prove_causal) changes no score at any admitted size: a bool mask that keeps
    everywhere (keeps_everywhere), or an additive one that is 0 at every index it can reach, itself or as a
    bool mask that keeps everywhere (bool_of_additive). transformers' encoders trace such a mask (q >= 0,
    expanded; torch's ONNX exporter makes it Where(that, 0, finfo.min)) where their eager call passes none."""
    if kind != "add":
        return keeps_everywhere(ma, v, kind)
    values = _reachable(ma.fn(v))
    if values is not None and all(float(x) == 0.0 for x in values):
        return True
    found = bool_of_additive(ma, v)
    return found is not None and keeps_everywhere(ma, *found)


@dataclass(frozen=True)
class Split:
    """A mask as causality (`causal`) and one bool mask (`rest`, of kind "keep" or "drop") that together keep
    exactly where it keeps."""

    rest: Value
    kind: str
    causal: bool


def split_mask(ma: MaskAnalysis, mask: Value, kind: str, scores: Shape | None) -> Split | None:
    """For a mask no causal proof covers whole (kind as in prove_causal): the one bool mask left once its
    provably causal factors (then `causal`) and its factors that keep everything (keeps_everywhere) are taken
    out, and any Expand (a broadcast, which the kernels do themselves) is seen through. A keep mask's factors
    are those of its And, a drop mask's of its Or; an additive mask must be made of such a bool mask
    (bool_of_additive). Keeping is then causality (if any) and the
    rest, elementwise for every admitted size, so causal=1 with the rest as the mask input is the same
    attention. The decoders' masks are this: a traced transformers model builds its causal mask And the
    attention_mask's padding, where eager, seeing no padding, passes none; an encoder's (BERT's) is the
    padding, (B, 1, 1, S), And q >= 0, expanded to (B, 1, S, S). None if nothing comes out: no factor taken
    out and no Expand seen through, or more than one factor left."""
    if kind == "add":
        found = bool_of_additive(ma, mask)
        if found is None:
            return None
        mask, kind = found
        if prove_causal(ma, mask, kind, scores) is not None:
            return None  # causal whole: no other mask to keep
    ops = AND_OPS if kind == "keep" else OR_OPS
    causal, peeled, rest, todo = 0, 0, [], [mask]
    while todo:
        v = todo.pop()
        p = ma.ix.producer(v)
        while p is not None and p.op == "Expand" and len(p.outputs) == 1:
            v, p, peeled = p.inputs[0], ma.ix.producer(p.inputs[0]), peeled + 1
        if v is not mask and prove_causal(ma, v, kind, scores) is not None:
            causal += 1
        elif v is not mask and keeps_everywhere(ma, v, kind):
            peeled += 1
        elif p is not None and p.op in ops and len(p.inputs) == 2 and len(p.outputs) == 1:
            todo += p.inputs
        else:
            rest.append(v)
    if len(rest) != 1 or rest[0] is None or not (causal or peeled):
        return None
    return Split(rest[0], kind, causal=bool(causal))


def bool_of_additive(ma: MaskAnalysis, v: Value) -> tuple[Value, str] | None:
    """The bool mask an additive mask is made of, and its kind ("keep" or "drop"), where every element of the
    additive mask is 0 where that mask keeps and -inf where it drops: Where(keep, 0, -inf), Where(drop, -inf,
    0), or masked_fill(zeros, drop, -inf) (SDPA's conversion of a bool mask: the CPU and math paths use Where,
    CUDA's efficient and cuDNN paths masked_fill), seen through Expand and through a Slice that takes back
    exactly what a constant_pad_nd appended (the efficient kernel's bias alignment); a Not of the bool mask
    flips its kind. None for anything else."""
    p = ma.ix.producer(v)
    while p is not None and len(p.outputs) == 1:
        if p.op == "Expand":
            v = p.inputs[0]
        elif p.op == "Slice" and (inner := _unpadded(ma, p)) is not None:
            v = inner
        else:
            break
        p = ma.ix.producer(v)
    if p is None:
        return None
    if p.op == "Where" and len(p.inputs) == 3:
        bool_mask, fills = p.inputs[0], (_uniform(ma, p.inputs[1]), _uniform(ma, p.inputs[2]))
    elif p.op == "aten::masked_fill" and len(p.inputs) == 2 and "value" in p.attrs:
        bool_mask, fills = p.inputs[1], (p.attrs["value"], _uniform(ma, p.inputs[0]))
    else:
        return None
    kind = "keep" if fills == (0.0, -math.inf) else "drop" if fills == (-math.inf, 0.0) else ""
    if not kind or bool_mask is None or bool_mask.dtype != "bool":
        return None
    q = ma.ix.producer(bool_mask)
    while q is not None and q.op in NOT_OPS and len(q.inputs) == 1 and len(q.outputs) == 1:
        bool_mask, kind = q.inputs[0], "drop" if kind == "keep" else "keep"
        q = ma.ix.producer(bool_mask)
    return bool_mask, kind


def _uniform(ma: MaskAnalysis, v: Value | None) -> float | None:
    """The one value every element of `v` has at every admitted size (a constant or a fill), else None."""
    if v is None:
        return None
    scalar = ma.shapes.scalar(v)
    if scalar is not None:
        return scalar
    fn = ma.fn(v)
    if isinstance(fn, Steps) and not any(fn.coef) and len(fn.values) == 1:
        return float(fn.values[0])
    return None


def _unpadded(ma: MaskAnalysis, p: Node) -> Value | None:
    """What a Slice reads, where it is constant_pad_nd(x) (or F.pad's constant mode) sliced back to exactly x
    (each sliced axis padded at its end only and read from 0 to x's size, step 1; no other axis padded): x,
    else None."""
    pad = ma.ix.producer(p.inputs[0])
    constant = pad is not None and (pad.op == "aten::constant_pad_nd"
                                    or (pad.op == "aten::pad" and pad.attrs.get("mode") == "constant"))
    if pad is None or not constant or len(pad.outputs) != 1 or pad.inputs[0] is None:
        return None
    x = pad.inputs[0]
    shape, out, widths = ma.shape(x), ma.shape(p.outputs[0]), pad.attrs.get("pad")
    if (shape is None or out is None or not isinstance(widths, list | tuple) or len(widths) % 2
            or len(widths) > 2 * len(shape)):
        return None
    params = ma.shapes.slice_params(p, len(shape))
    if params is None:
        return None
    sliced = {axis: (start, end, step) for axis, start, end, step in params}
    for k in range(len(widths) // 2):
        axis = len(shape) - 1 - k
        before, after = (sympy.sympify(w) for w in widths[2 * k: 2 * k + 2])
        if before != 0:
            return None
        if after == 0:
            continue
        if axis not in sliced:
            return None
        start, end, step = sliced.pop(axis)
        # The slice's extent is x's: a negative width (a crop) would leave it shorter.
        if not (start == 0 and step == 1 and same(end, shape[axis]) and same(out[axis], shape[axis])):
            return None
    if sliced:  # a slice of an axis the pad left alone
        return None
    return x


def _additive(v: Any, dtype: str | None) -> tuple[bool | None, float | None]:
    """(keeps, fill) of an additive mask value: 0 keeps; -inf, or a finite value at or below half the
    dtype's lowest (finfo.min style), drops; anything else is None."""
    f = float(v)
    if f == 0:
        return True, None
    if f == -math.inf:
        return False, -math.inf
    np_dtype = NP_DTYPES.get(dtype or "", np.float32)
    if np.issubdtype(np_dtype, np.floating) and f <= float(np.finfo(np_dtype).min) / 2:
        return False, f
    return None, None


# ---- magnitude bounds ----------------------------------------------------------------------------
# Ops whose output elements are some of their first input's elements (layout, selection, repetition).
_SAME_ELEMENTS = ("Identity", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Transpose", "Slice", "Gather",
                  "aten::repeat", "aten::clone", "aten::contiguous", "aten::alias")
INT64_BOUND = 2.0**63  # what any integer index or size can reach


def magnitude_bound(ma: MaskAnalysis, v: Value | None, depth: int = MAX_DEPTH) -> float | None:
    """An upper bound on |element| of `v` for every admitted size, or None: constants by their data, an
    iota by its range (a symbolic end by the int64 range), layout ops by their input, + - * by the rules of
    intervals. ALiBi's position bias is slopes times an iota: bounded, unlike a padding mask's fill."""
    if v is None or depth == 0:
        return None
    data = ma.shapes.const(v)
    if data is not None:
        arr = np.asarray(data, dtype=np.float64)
        top = float(np.max(np.abs(arr))) if arr.size else 0.0
        return top if np.isfinite(top) else None
    p = ma.ix.producer(v)
    if p is None or len(p.outputs) != 1:
        return None
    if p.op in _SAME_ELEMENTS or (p.op == "Cast" and p.attrs.get("to") != "bool"):
        return magnitude_bound(ma, p.inputs[0], depth - 1)
    if p.op == "aten::arange":
        ends = [p.attrs.get(k, 0) for k in ("start", "end")]
        return max(abs(e) if isinstance(e, int | float) else INT64_BOUND for e in ends)
    if p.op in ("Neg", "Add", "Sub", "Mul") and all(i is not None for i in p.inputs):
        bounds = [magnitude_bound(ma, i, depth - 1) for i in p.inputs]
        if any(b is None for b in bounds):
            return None
        return float(np.prod(bounds)) if p.op == "Mul" else float(sum(bounds))  # type: ignore[arg-type]
    return None
