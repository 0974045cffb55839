"""The mask prover (tkopt/passes/masks.py): its index functions against brute force, and what it proves causal,
for every size, from IR graphs with symbolic dims (and what it must not)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tkopt.ir import Graph, Node, Value
from tkopt.passes.masks import Affine, MaskAnalysis, Steps, lift, pointwise, prove_causal, remap, steps
from tkopt.passes.patterns import GraphIndex
from tkopt.passes.shapes import Shapes, _dim

NEG_INF = -math.inf
F32_MIN = float(np.finfo(np.float32).min)


def _at(fn: Affine | Steps, idx: tuple[int, ...]) -> object:
    x = sum(c * i for c, i in zip(fn.coef, idx, strict=True))
    return x + fn.const if isinstance(fn, Affine) else fn.at(x)


def _grid(shape: tuple[int, ...]):
    return itertools.product(*(range(n) for n in shape))


# ---- the abstract domain against brute force ------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_steps_normalization_keeps_the_function(seed: int) -> None:
    """Any coefficients (sign, common factor), cuts and values: the normalized Steps is the same function."""
    rng = np.random.default_rng(seed)
    coef = tuple(int(c) for c in rng.integers(-3, 4, size=3))
    cuts = sorted({int(c) for c in rng.integers(-8, 9, size=4)})
    values = [np.int64(v) for v in rng.integers(0, 3, size=len(cuts) + 1)]

    def raw(idx: tuple[int, ...]) -> object:
        return Steps((), tuple(cuts), tuple(values)).at(sum(c * i for c, i in zip(coef, idx, strict=True)))

    fn = steps(coef, cuts, values)
    assert not any(fn.coef) or next(c for c in fn.coef if c) > 0
    for idx in _grid((5, 6, 4)):
        assert _at(fn, idx) == raw(idx), (coef, cuts, values, idx)


def test_pointwise_and_remap_against_brute_force() -> None:
    a = steps((1, -1), [-2, 0], [np.int64(1), np.int64(5), np.int64(7)])
    b = steps((-1, 1), [1], [np.int64(2), np.int64(3)])  # the same form, negated: merged
    both = pointwise([a, b], np.add, "int64")
    shifted = remap(both, both.coef, shift=3)  # f(x + 3): a slice from offset 3 on the row axis
    for i, j in _grid((7, 7)):
        assert _at(both, (i, j)) == _at(a, (i, j)) + _at(b, (i, j))
        assert _at(shifted, (i, j)) == _at(both, (i + 3, j))
    other = steps((1, 0), [2], [np.int64(0), np.int64(1)])
    assert pointwise([a, other], np.add, "int64") is None  # two different forms: no proof


@pytest.mark.parametrize(
    "array",
    [
        np.tril(np.ones((6, 9), bool)),
        np.triu(np.full((7, 7), F32_MIN, np.float32), 1),
        np.tril(np.ones((8, 8), bool)) & ~np.tril(np.ones((8, 8), bool), -3),  # band
        np.broadcast_to(np.arange(5) < 3, (2, 1, 4, 5)),  # a padding row
        np.arange(10, dtype=np.int64) * 3 + 2,
        np.full((3, 4), 7.0),
    ],
    ids=["tril", "finfo_triu", "band", "padding", "iota", "constant"],
)
def test_lift_describes_the_array_over_its_extent(array: np.ndarray) -> None:
    fn = lift(array)
    assert fn is not None
    for idx in _grid(array.shape):
        assert _at(fn, idx) == array[idx]


def test_lift_refuses_arrays_of_no_single_form() -> None:
    rng = np.random.default_rng(0)
    assert lift(rng.random((5, 5)) > 0.5) is None
    planes = np.stack([np.tril(np.ones((4, 4), bool)), np.triu(np.ones((4, 4), bool))])
    assert lift(planes) is None  # per-batch masks differ


# ---- proofs on graphs with symbolic sizes ----------------------------------------------------------
class _G:
    """A tiny IR graph builder with declared (symbolic) shapes; nothing is evaluated."""

    def __init__(self) -> None:
        self.g = Graph("masks")

    def input(self, name: str, shape: tuple, dtype: str = "float32") -> Value:
        v = Value(name, dtype, shape)
        self.g.inputs.append(v)
        return v

    def const(self, data: object, dtype: str | None = None) -> Value:
        arr = np.asarray(data)
        return Value(self.g.fresh_name("c"), dtype or str(arr.dtype), arr.shape, const=arr)

    def op(self, op: str, *inputs: Value | None, shape: tuple | None, dtype: str = "bool", **attrs: object) -> Value:
        out = Value(self.g.fresh_name(op.lower()), dtype, shape)
        self.g.add_node(Node(op, list(inputs), [out], attrs, name=self.g.fresh_name(op)))
        return out

    def prove(self, mask: Value, kind: str, scores: tuple = ("b", 4, "s", "s")):
        self.g.outputs = [mask]
        ix = GraphIndex(self.g)
        return prove_causal(MaskAnalysis(ix, Shapes(ix)), mask, kind, tuple(_dim(d) if isinstance(d, str) else
                                                                         _dim(str(d)) for d in scores))

    def seq(self, x: Value, axis: int = 1) -> Value:
        """The length of x's `axis`, as an exporter computes it (Shape, Gather)."""
        shape = self.op("Shape", x, shape=(len(x.shape),), dtype="int64")
        return self.op("Gather", shape, self.const(np.int64(axis)), shape=(), dtype="int64", axis=0)

    def iota(self, n: Value, start: int = 0) -> Value:
        return self.op("Range", self.const(np.int64(start)), n, self.const(np.int64(1)), shape=(None,), dtype="int64")


def _iota_pair(b: _G, x: Value) -> tuple[Value, Value]:
    """(rows i as (S, 1), keys j as (1, S)) from Range(0, S)."""
    r = b.iota(b.seq(x))
    return (b.op("Unsqueeze", r, shape=(None, 1), dtype="int64", axes=[1]),
            b.op("Unsqueeze", r, shape=(1, None), dtype="int64", axes=[0]))


@pytest.mark.parametrize(
    ("op", "swap", "kind", "causal"),
    [
        ("LessOrEqual", False, "keep", True),  # j <= i
        ("GreaterOrEqual", True, "keep", True),  # i >= j
        ("Greater", False, "drop", True),  # drop j > i
        ("Less", True, "drop", True),  # drop i < j
        ("Less", False, "keep", False),  # j < i: strict, row 0 fully masked
        ("GreaterOrEqual", False, "keep", False),  # j >= i: anti-causal
        ("Equal", False, "keep", False),  # the diagonal only
    ],
)
def test_iota_comparisons(op: str, swap: bool, kind: str, causal: bool) -> None:
    b = _G()
    x = b.input("x", ("b", "s", 16))
    i, j = _iota_pair(b, x)
    mask = b.op(op, *((i, j) if swap else (j, i)), shape=("s", "s"))
    got = b.prove(mask, kind)
    assert (got is not None) == causal and (got is None or got.fill is None)


@pytest.mark.parametrize(("k", "upper", "causal"), [(0, 0, True), (1, 0, False), (-1, 0, False), (0, 1, False)])
def test_trilu_of_ones(k: int, upper: int, causal: bool) -> None:
    b = _G()
    x = b.input("x", ("b", "s", 16))
    n = b.op("Unsqueeze", b.seq(x), shape=(1,), dtype="int64", axes=[0])
    ones = b.op("ConstantOfShape", b.op("Concat", n, n, shape=(2,), dtype="int64", axis=0), shape=("s", "s"),
                value=np.array([True]))
    mask = b.op("Trilu", ones, b.const(np.int64(k)), shape=("s", "s"), upper=upper)
    assert (b.prove(mask, "keep") is not None) == causal


@pytest.mark.parametrize(
    ("buffer", "start", "causal"),
    [
        (np.tril(np.ones((48, 48), bool)), 0, True),
        (np.tril(np.ones((48, 48), bool)) & ~np.tril(np.ones((48, 48), bool), -32), 0, False),  # band, w=32
        (np.tril(np.ones((48, 48), bool)) & ~np.tril(np.ones((48, 48), bool), -48), 0, True),  # w >= n: tril
        (np.tril(np.ones((48, 48), bool)), 1, False),  # sliced from (1, 1): still causal? no: from row 1 only
        (np.tril(np.ones((1, 1), bool)), 0, False),  # a 1x1 buffer broadcasts
    ],
    ids=["tril", "band32", "band48", "offset_rows", "one_by_one"],
)
def test_buffer_sliced_to_the_length(buffer: np.ndarray, start: int, causal: bool) -> None:
    """A constant buffer sliced to (s, s): causal for every s <= n exactly when it is lower-triangular over its
    whole extent (the defect: a band buffer agreeing with tril at the trial lengths was taken as causal)."""
    b = _G()
    x = b.input("x", ("b", "s", 16))
    end = b.op("Unsqueeze", b.seq(x), shape=(1,), dtype="int64", axes=[0])
    buf = b.const(buffer)
    rows = b.op("Slice", buf, b.const([start]), end, b.const([0]), b.const([1]), shape=("s", buffer.shape[1]))
    mask = b.op("Slice", rows, b.const([0]), end, b.const([1]), b.const([1]), shape=("s", "s"))
    assert (b.prove(mask, "keep") is not None) == causal


def test_slice_from_a_symbolic_offset_is_not_proven() -> None:
    """KV-cache style: rows sliced from (Skv - Sq): bottom-right aligned, not top-left."""
    b = _G()
    x, kv = b.input("x", ("b", "q", 16)), b.input("kv", ("b", "k", 16))
    sq, skv = (b.op("Unsqueeze", b.seq(t), shape=(1,), dtype="int64", axes=[0]) for t in (x, kv))
    off = b.op("Sub", skv, sq, shape=(1,), dtype="int64")
    buf = b.const(np.tril(np.ones((64, 64), bool)))
    rows = b.op("Slice", buf, off, skv, b.const([0]), b.const([1]), shape=("q", 64))
    mask = b.op("Slice", rows, b.const([0]), skv, b.const([1]), b.const([1]), shape=("q", "k"))
    assert b.prove(mask, "keep", scores=("b", 4, "q", "k")) is None


@pytest.mark.parametrize(
    ("fill", "want"),
    [(NEG_INF, NEG_INF), (F32_MIN, F32_MIN), (-1e4, None), (-0.5, None)],
)
def test_additive_fills(fill: float, want: float | None) -> None:
    """Where(j <= i, 0, fill) added to the scores: -inf and finfo.min-like fills mask; -1e4 is a value a large
    score can outweigh, so it is no proof (the mask stays explicit and keeps its arithmetic)."""
    b = _G()
    x = b.input("x", ("b", "s", 16))
    i, j = _iota_pair(b, x)
    keep = b.op("LessOrEqual", j, i, shape=("s", "s"))
    add = b.op("Where", keep, b.const(np.float32(0)), b.const(np.float32(fill)), shape=("s", "s"), dtype="float32")
    got = b.prove(add, "add")
    assert (None if got is None else got.fill) == want


def test_alibi_bias_is_not_a_mask() -> None:
    """-(i - j) * slope: not piecewise constant, a bias: no proof."""
    b = _G()
    x = b.input("x", ("b", "s", 16))
    i, j = _iota_pair(b, x)
    d = b.op("Cast", b.op("Sub", j, i, shape=("s", "s"), dtype="int64"), shape=("s", "s"), dtype="float32",
             to="float32")
    assert b.prove(b.op("Mul", d, b.const(np.float32(0.5)), shape=("s", "s"), dtype="float32"), "add") is None


@pytest.mark.parametrize(("offset", "causal"), [(0, True), (-1, False)])
def test_gather_by_iota_index(offset: int, causal: bool) -> None:
    """aten::index(positions, rows, cols) as transformers' masks read positions: proven when every index is an
    iota over an axis of the indexed size; an offset index (which would wrap around at -1) is not."""
    b = _G()
    x = b.input("x", ("b", "s", 16))
    r = b.op("Add", b.iota(b.seq(x)), b.const(np.int64(offset)), shape=("s",), dtype="int64")
    pos = b.iota(b.seq(x))
    q = b.op("aten::index", pos, b.op("Unsqueeze", r, shape=("s", 1), dtype="int64", axes=[1]), shape=("s", 1),
             dtype="int64")
    k = b.op("aten::index", pos, b.op("Unsqueeze", r, shape=(1, "s"), dtype="int64", axes=[0]), shape=(1, "s"),
             dtype="int64")
    assert (b.prove(b.op("aten::le", k, q, shape=("s", "s")), "keep") is not None) == causal


def test_mask_of_other_lengths_is_not_aligned() -> None:
    """A causal pattern over (t, t) added to scores over (s, s) with t another name: no proof."""
    b = _G()
    x = b.input("x", ("b", "t", 16))
    i, j = _iota_pair(b, x)
    mask = b.op("LessOrEqual", j, i, shape=("t", "t"))
    assert b.prove(mask, "keep") is None
    assert b.prove(mask, "keep", scores=("b", 4, "t", "t")) is not None
