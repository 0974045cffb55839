"""Numpy evaluators of the ONNX ops that shape arithmetic uses, for constant folding and shape proofs.

Canonicalization folds with them and tkopt/passes/shapes.py evaluates local subgraphs with them; they sit
below both so neither has to import the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tkopt.ir import Node

Arrays = Sequence[np.ndarray | None]


def np_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.float32 if dtype == "bfloat16" else dtype)


def _ints(node: Node, key: str, arr: np.ndarray | None) -> list[int] | None:
    """An int-list operand given as attribute (canonical form) or as a constant input."""
    val = node.attr(key)
    if val is None and arr is not None:
        val = arr
    return None if val is None else [int(v) for v in np.asarray(val).reshape(-1)]


def _shape(node: Node, ins: Arrays) -> np.ndarray:
    dims = node.inputs[0].shape  # type: ignore[union-attr]
    start, end = node.attr("start", 0), node.attr("end")
    return np.array(dims[start:end], dtype=np.int64)  # type: ignore[index]


def _slice(node: Node, ins: Arrays) -> np.ndarray:
    x = ins[0]
    starts, ends = _ints(node, "starts", ins[1]), _ints(node, "ends", ins[2])
    axes = _ints(node, "axes", ins[3] if len(ins) > 3 else None) or list(range(len(starts or [])))
    steps = _ints(node, "steps", ins[4] if len(ins) > 4 else None) or [1] * len(axes)
    index = [slice(None)] * x.ndim
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):  # type: ignore[arg-type]
        index[a] = slice(s, e, st)
    return x[tuple(index)]


def _unsqueeze(node: Node, ins: Arrays) -> np.ndarray:
    x = ins[0]
    axes = _ints(node, "axes", ins[1] if len(ins) > 1 else None) or []
    rank = x.ndim + len(axes)
    for a in sorted(a + rank if a < 0 else a for a in axes):
        x = np.expand_dims(x, a)
    return x


def _squeeze(node: Node, ins: Arrays) -> np.ndarray:
    axes = _ints(node, "axes", ins[1] if len(ins) > 1 else None)
    return np.squeeze(ins[0], axis=None if axes is None else tuple(axes))


def _reshape(node: Node, ins: Arrays) -> np.ndarray:
    out = node.outputs[0].shape
    if out is not None and all(isinstance(d, int) for d in out):
        return ins[0].reshape(out)
    shape = _ints(node, "shape", ins[1])
    if not node.attr("allowzero", 0):
        shape = [ins[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]  # type: ignore[arg-type]
    return ins[0].reshape(shape)


def _div(node: Node, ins: Arrays) -> np.ndarray:
    a, b = ins
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer division truncates
    return a / b


def _pow(node: Node, ins: Arrays) -> np.ndarray:
    """x ** y; a float result below float64 is the float64 power rounded once to its dtype, as a correctly rounding
    powf gives it (ONNX Runtime's: glibc's). numpy's own float32 power can be an ulp off: 6 ** -0.5 reads 0.40824828
    there, 0.4082483 in ORT, and a float64 model scaled by that exported float32 constant differed from its
    unfused graph by 7e-8 (fuzz seed 2270)."""
    a, b = ins
    out = np.power(a, b)
    if np.issubdtype(out.dtype, np.floating) and out.dtype.itemsize < 8:
        return np.power(a.astype(np.float64), b.astype(np.float64)).astype(out.dtype)
    return out


EVALUATORS: dict[str, Callable[[Node, Arrays], np.ndarray]] = {
    "Constant": lambda n, i: np.asarray(n.attr("value")),
    "Shape": _shape,
    "Size": lambda n, i: np.array(int(np.prod(n.inputs[0].shape)), dtype=np.int64),  # type: ignore[union-attr]
    "Identity": lambda n, i: i[0],
    "Cast": lambda n, i: i[0].astype(np_dtype(n.attr("to"))),
    "Add": lambda n, i: i[0] + i[1],
    "Sub": lambda n, i: i[0] - i[1],
    "Mul": lambda n, i: i[0] * i[1],
    "Div": _div,
    "Pow": _pow,
    "Neg": lambda n, i: -i[0],
    "Sqrt": lambda n, i: np.sqrt(i[0]),
    "Reciprocal": lambda n, i: 1 / i[0],
    "Max": lambda n, i: np.maximum.reduce(list(i)),
    "Min": lambda n, i: np.minimum.reduce(list(i)),
    "Equal": lambda n, i: np.equal(i[0], i[1]),
    "Less": lambda n, i: np.less(i[0], i[1]),
    "Greater": lambda n, i: np.greater(i[0], i[1]),
    "Not": lambda n, i: np.logical_not(i[0]),
    "And": lambda n, i: np.logical_and(i[0], i[1]),
    "Where": lambda n, i: np.where(i[0], i[1], i[2]),
    "Gather": lambda n, i: np.take(i[0], i[1], axis=n.attr("axis", 0)),
    "Slice": _slice,
    "Concat": lambda n, i: np.concatenate(list(i), axis=n.attr("axis", 0)),
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Expand": lambda n, i: np.broadcast_to(i[0], np.broadcast_shapes(i[0].shape, tuple(_ints(n, "shape", i[1])))),
    "ConstantOfShape": lambda n, i: np.full(
        tuple(int(d) for d in i[0]), np.asarray(n.attr("value", np.zeros(1, np.float32))).reshape(-1)[0]
    ),
    "Range": lambda n, i: np.arange(i[0].item(), i[1].item(), i[2].item()),
}
