"""Symbolic shapes and shape-derived constants, for matching attention in dynamic-shape exports.

ONNX shape inference loses dims through the exporters' Shape/Gather/Concat -> Reshape chains (the
TorchScript exporter's head split comes out as (batch, seq, 4, unk__0)), and the scale, the GQA
expand and the causal mask are computed from those shapes. Here dims are sympy expressions (named
dims become symbols, unknown ones unique symbols) and shape vectors are evaluated symbolically with
canonicalize's evaluators, so "this Reshape merges exactly these two axes" and "the scale is
1/sqrt(16)" can be proven without static shapes. The graph is never changed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np
import sympy
from sympy.parsing.sympy_parser import parse_expr

from tkopt.ir import Node, Value

from .canonicalize import EVALUATORS
from .patterns import GraphIndex, const_array, norm_axis

Shape = tuple[sympy.Expr, ...]
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Cast", "Identity", "Neg", "Where", "Pow", "Sqrt")


def _trilu(n: Node, ins: Sequence[np.ndarray | None]) -> np.ndarray:
    k = int(np.asarray(ins[1]).reshape(-1)[0]) if len(ins) > 1 and ins[1] is not None else int(n.attrs.get("k", 0))
    return np.triu(ins[0], k) if n.attrs.get("upper", 1) else np.tril(ins[0], k)


LOCAL_EVALUATORS = {
    **EVALUATORS, "Trilu": _trilu,
    "aten::scalar_tensor": lambda n, i: np.asarray(n.attrs["s"], dtype=n.attrs.get("dtype") or "float32"),
}


def same(a: sympy.Expr | None, b: sympy.Expr | None) -> bool:
    """Provably equal dims."""
    return a is not None and b is not None and sympy.expand(a - b) == 0


def as_int(d: sympy.Expr | None) -> int | None:
    return int(d) if d is not None and d.is_Integer else None


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
            else _dim(d) if isinstance(d, str) else sympy.Symbol(f"?{v.name}:{i}")
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
        src = self.shape(p.inputs[0]) if p.inputs and p.inputs[0] is not None else None
        if src is None:
            return None
        if p.op == "Split" and p.attrs.get("split") is not None and len(p.attrs["split"]) == len(p.outputs):
            axis = norm_axis(int(p.attrs.get("axis", 0)), len(src))
            size = p.attrs["split"][[id(o) for o in p.outputs].index(id(v))]
            return (*src[:axis], _dim(size) if isinstance(size, str) else sympy.Integer(size), *src[axis + 1:])
        if len(p.outputs) != 1:
            return None
        if p.op == "Squeeze" and p.attrs.get("axes") is not None:
            axes = {norm_axis(int(a), len(src)) for a in p.attrs["axes"]}
            return tuple(d for i, d in enumerate(src) if i not in axes)
        if p.op == "MatMul" and len(src) >= 2 and (other := self.shape(p.inputs[1])) is not None and len(other) >= 2:
            batch = _broadcast([src[:-2], other[:-2]])
            return None if batch is None else (*batch, src[-2], other[-1])
        if p.op == "Transpose" and p.attrs.get("perm") is not None:
            return tuple(src[i] for i in p.attrs["perm"])
        if p.op == "Reshape":
            target = self._target(p)
            return None if target is None else _reshape(src, target, p.attrs.get("allowzero", 0))
        if p.op == "Unsqueeze" and p.attrs.get("axes") is not None:
            out = list(src)
            rank = len(src) + len(p.attrs["axes"])
            for a in sorted(norm_axis(int(a), rank) for a in p.attrs["axes"]):
                out.insert(a, sympy.Integer(1))
            return tuple(out)
        if p.op == "Expand":
            target = self._target(p)
            return None if target is None else _broadcast([src, tuple(sympy.sympify(d) for d in target)])
        if p.op in ELEMENTWISE:
            shapes = [self.shape(i) for i in p.inputs if i is not None]
            return None if any(s is None for s in shapes) else _broadcast(shapes)  # type: ignore[arg-type]
        return None

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
        try:
            out = np.asarray(LOCAL_EVALUATORS[p.op](p, ins))
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, ZeroDivisionError):
            return None
        return out

    def value_at(
        self, v: Value, subs: Sizes, depth: int = 32, memo: dict[int, np.ndarray | None] | None = None
    ) -> np.ndarray | None:
        """The data of `v` with every symbolic dim given a size from `subs` (missing symbols get fresh
        sizes, recorded in `subs`): how a shape-derived mask looks at concrete sizes. None if `v`
        depends on more than constants and shapes."""
        memo = {} if memo is None else memo
        if id(v) not in memo:
            memo[id(v)] = self._value_at(v, subs, depth, memo)
        return memo[id(v)]

    def _value_at(self, v: Value, subs: Sizes, depth: int, memo: dict[int, np.ndarray | None]) -> np.ndarray | None:
        data = const_array(self.ix, v)
        p = self.ix.producer(v)
        if data is not None or p is None or depth == 0 or len(p.outputs) != 1:
            return data
        if p.op == "Shape":
            s = self.shape(p.inputs[0])
            dims = None if s is None else [concrete(d, subs) for d in s]
            return None if dims is None else np.array(dims, dtype=np.int64)[p.attrs.get("start", 0):p.attrs.get("end")]
        if p.op not in LOCAL_EVALUATORS:
            return None
        ins = [None if i is None else self.value_at(i, subs, depth - 1, memo) for i in p.inputs]
        if any(a is None and i is not None for a, i in zip(ins, p.inputs, strict=True)):
            return None
        attrs = {k: _concrete_attr(a, subs) for k, a in p.attrs.items()}
        try:
            out = np.asarray(LOCAL_EVALUATORS[p.op](Node(p.op, p.inputs, p.outputs, attrs), ins))
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, ZeroDivisionError):
            return None
        return None if out.dtype == object else out

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


class Sizes(dict):
    """Concrete sizes for symbolic dims; a symbol not seen yet takes the next size of `pool`."""

    def __init__(self, pool: Sequence[int]) -> None:
        super().__init__()
        self.pool = list(pool)

    def __missing__(self, sym: sympy.Symbol) -> int:
        self[sym] = self.pool[len(self)] if len(self) < len(self.pool) else 31 + len(self)
        return self[sym]


def concrete(d: sympy.Expr, sizes: Sizes) -> int:
    return int(d.subs({s: sizes[s] for s in d.free_symbols}))


def _concrete_attr(a: object, subs: Sizes) -> object:
    if isinstance(a, str) and not a.startswith("torch."):
        try:
            return concrete(_dim(a), subs)
        except (TypeError, ValueError):
            return a
    if isinstance(a, list):
        return [_concrete_attr(x, subs) for x in a]
    return a


@functools.lru_cache(maxsize=4096)
def _dim(text: str) -> sympy.Expr:
    """A symbolic dim: a name ("batch", "unk__3", "s0") or the FX frontend's expression ("4*s77")."""
    names = {n: sympy.Symbol(n) for n in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)}
    try:
        return sympy.sympify(parse_expr(text, local_dict=names, global_dict={"Integer": sympy.Integer}))
    except Exception:  # noqa: BLE001 - any name the parser cannot read is just an opaque symbol
        return sympy.Symbol(text)


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
        out[out.index(None)] = sympy.simplify(sympy.Mul(*src) / known)
    return tuple(out)  # type: ignore[arg-type]


def _broadcast(shapes: Sequence[Shape]) -> Shape | None:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        real = [d for d in dims if d != 1]
        if not real:
            out.append(sympy.Integer(1))
        elif all(same(real[0], d) for d in real[1:]):
            out.append(real[0])
        else:
            return None
    return tuple(out)
