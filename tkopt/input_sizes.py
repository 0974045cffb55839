"""Torch inputs at new sizes along the symbolic dims an exported graph admits.

One specialization of an exported graph serves every size its symbolic dims admit, so what is checked on
it (the accuracy check, tkopt.differential) and what is measured for it (measured selection on the torch
targets) runs at sizes other than the example's. Here: each plain symbol of the inputs' shapes with its
example size and admitted range, the example inputs remade at a new assignment of those symbols, and the
checks that keep a size the model cannot take from running (its export's guards; gathers whose indices run
past their tables, which on CUDA end in a device-side assert no Python code survives).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx


@dataclass(frozen=True)
class DimRange:
    """A symbolic dim: its example size and the sizes it admits (hi None: unbounded)."""

    example: int
    lo: int = 1
    hi: int | None = None

    def candidates(self) -> list[int]:
        """The example's size, the smallest admitted, an odd one, and one longer than the example."""
        lo, hi = max(self.lo, 1), self.hi if self.hi is not None else math.inf
        odd = next((v for v in (3, 5, 7, 9, 11, 13) if v != self.example and lo <= v <= hi), self.example)
        return [self.example, lo, odd, int(min(2 * self.example + 3, hi))]

    def scaled(self, factor: float) -> int:
        """The example's size times `factor` (rounded up), within the admitted range."""
        size = math.ceil(self.example * factor)
        return max(self.lo, size if self.hi is None else min(size, self.hi))


def torch_dims(examples: Sequence[Any], flat: Sequence[Any], ranges: Mapping[Any, Any]) -> dict[Any, DimRange]:
    """Each input dim that is a plain symbol in the exported program, with its example size and
    torch.export's range for it (`ranges`: symbol -> ValueRanges). `examples` are the graph's placeholder
    values (FakeTensors with symbolic dims), `flat` the real inputs."""
    dims: dict[Any, DimRange] = {}
    for ex, x in zip(examples, flat, strict=True):
        if not isinstance(ex, torch.Tensor) or not isinstance(x, torch.Tensor):
            continue
        for want, got in zip(ex.shape, x.shape, strict=True):
            if isinstance(want, torch.SymInt) and isinstance(want.node.expr, sympy.Symbol):
                vr = ranges.get(want.node.expr)
                lo = _bound(vr.lower) if vr is not None else None
                hi = _bound(vr.upper) if vr is not None else None
                dims.setdefault(want.node.expr, DimRange(int(got), lo or 1, hi))
    return dims


def shape_ranges(examples: Sequence[Any]) -> Mapping[Any, Any]:
    """The admitted range of every symbol, from the shape environment the examples were traced in (the
    same ranges torch.export reports as range_constraints; Dynamo's for a torch.compile graph)."""
    for ex in examples:
        env = getattr(getattr(ex, "fake_mode", None), "shape_env", None)
        if env is not None:
            return env.var_to_range
    return {}


def _bound(v: Any) -> int | None:
    """A range bound as an int; None for torch's and sympy's infinities."""
    from torch.utils._sympy.numbers import int_oo

    return None if v in (int_oo, -int_oo, sympy.oo, -sympy.oo) else int(v)


def resized(x: torch.Tensor, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    """An input of a new size like `x`: fresh normal values for float data, `x` tiled and cut for
    ids, masks and other data whose values mean something (integers, bools, few distinct floats)."""
    if list(x.shape) == shape:
        return x
    if x.is_floating_point() and x.numel() > 2 and torch.unique(x).numel() > 2:
        # as Python numbers: the generator draws on the CPU, and a CUDA input's statistics would live there
        std, mean = float(x.float().std()), float(x.float().mean())
        return (torch.randn(shape, generator=gen) * std + mean).to(device=x.device, dtype=x.dtype)
    if x.numel() == 0:
        return x.new_zeros(shape)
    reps = [max(1, -(-n // max(o, 1))) for n, o in zip(shape, x.shape, strict=True)]
    return x.repeat(*reps)[tuple(slice(0, n) for n in shape)].clone()


def stand_in(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A tensor of `x`'s dtype at `shape` with no data (meta device): enough for labels and the export's input
    guards, which read sizes only, without building inputs that may never run."""
    return torch.empty(shape, dtype=x.dtype, device="meta")


def size_at(dim: Any, sizes: Mapping[Any, int]) -> int | None:
    """A dim's size where the symbols have `sizes`: an int as it is, a SymInt's expression evaluated there
    (2*s0 follows s0); None where it reads a symbol `sizes` does not set, or is neither."""
    if isinstance(dim, int):
        return dim
    if not isinstance(dim, torch.SymInt):
        return None
    expr = dim.node.expr
    return int(expr.subs(sizes)) if expr.free_symbols <= sizes.keys() else None


def resize_inputs(examples: Sequence[Any], flat: Sequence[Any], sizes: Mapping[Any, int],
                  make: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> list[Any]:
    """`flat` (the real inputs, one per example) with every symbolic dim at its size in `sizes`: tensors remade
    by `make(tensor, shape)` (`resized` with a generator, or `stand_in`), ints traced as symbols set. Shapes
    that are expressions of the symbols (2*s0) follow them."""

    def size(want: Any, got: int) -> int:
        """`want`'s size under `sizes`; `got` (the example's) where it reads a symbol not in `sizes`."""
        new = size_at(want, sizes)
        return got if new is None else new

    out = []
    for ex, x in zip(examples, flat, strict=True):
        if isinstance(ex, torch.Tensor) and isinstance(x, torch.Tensor):
            x = make(x, [size(want, got) for want, got in zip(ex.shape, x.shape, strict=True)])
        elif isinstance(ex, torch.SymInt) and type(x) is int:
            x = size(ex, x)
        out.append(x)
    return out


def guards_refuse(gm: fx.GraphModule, flat: Sequence[Any]) -> str | None:
    """Why the input guards torch.export put in its unlifted module (a `_guards_fn` submodule, where there is
    one) refuse `flat` (one input per placeholder); None if they take it. An export's range can admit a
    size its guards refuse (a causal mask sliced from a 128-row buffer: seq in [2, 128], and seq != 128)."""
    env = dict(zip(gm.graph.find_nodes(op="placeholder"), flat, strict=True))
    for n in gm.graph.find_nodes(op="call_module", target="_guards_fn"):
        try:
            gm.get_submodule(n.target)(*[env.get(a, a) for a in n.args])
        except Exception as e:  # noqa: BLE001 - a failed guard is an AssertionError; any failure refuses
            return next(iter(str(e).splitlines()), type(e).__name__)
    return None


def _indexed(target: Any, args: Sequence[Any]) -> list[tuple[torch.Tensor, int, Any, bool]]:
    """What a gather op indexes: (source, dim, index, negatives allowed) per index tensor; [] for other ops."""
    aten = torch.ops.aten
    if target is aten.embedding.default:
        return [(args[0], 0, args[1], False)]
    if target in (aten.index_select.default, aten.gather.default):
        return [(args[0], args[1], args[2], False)]
    if target is aten.index.Tensor:
        return [(args[0], d, i, True) for d, i in enumerate(args[1]) if isinstance(i, torch.Tensor)]
    return []


def index_out_of_range(target: Any, args: Sequence[Any]) -> str | None:
    """Why gather op `target` would index out of range on `args`, or None. On CUDA that is a device-side
    assert, which leaves the CUDA context unusable for the rest of the process: a model run at a size it was
    never meant for (GPT-2 past its 1024 positions) must fail in Python, before its kernel launches."""
    for src, dim, index, negative in _indexed(target, args):
        if index.dtype == torch.bool or index.numel() == 0:
            continue
        size = src.shape[dim]
        lo, hi = int(index.min()), int(index.max())
        if hi >= size or lo < (-size if negative else 0):
            return f"indices {lo}..{hi} out of range for dim {dim} of size {size}"
    return None


class OutOfRange(IndexError):
    """A gather that would index out of range (index_out_of_range), refused before it ran."""


class CheckedRun(fx.Interpreter):
    """Runs a GraphModule with every gather's indices checked before it runs (OutOfRange)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        why = index_out_of_range(target, args)
        if why is not None:
            raise OutOfRange(f"{target}: {why}")
        return super().call_function(target, args, kwargs)


def gathers_refuse(gm: fx.GraphModule, flat: Sequence[Any]) -> str | None:
    """Why `gm` on `flat` (one input per placeholder) would index out of range, found by running it checked
    (CheckedRun); None where no gather would. Other failures are left to the caller's own run to report."""
    try:
        with torch.no_grad():
            CheckedRun(gm, garbage_collect_values=True).run(*flat)
    except OutOfRange as e:
        return str(e).splitlines()[0]  # without the interpreter's "While executing" lines
    except Exception:  # noqa: BLE001 - not an index out of range: the caller's run meets and names it
        return None
    return None
