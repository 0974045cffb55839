"""Layout copies that exist only so that views can follow: dropped where attention reads the views.

torch.export records torch's slow paths where Dynamo takes the fused fast ones. nn.MultiheadAttention's
(F.multi_head_attention_forward, batch_first): `linear(src.transpose(1, 0))` (a copy of the input, since the
GEMM wants rows), then the packed projection `.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2)
.squeeze(-2).contiguous()` (a copy of all of q, k and v), whose selects are viewed as (L, B*H, D), transposed
and viewed as (B, H, L, D) for SDPA. The copy is there only because the (L, B*H, D) view needs it; the
tensor SDPA reads is a plain strided view of the projection. On the H200 the two copies (with the bias add
inductor folds into them) cost nn.TransformerEncoderLayer(1024, 16) at 8x512 about a tenth of its time.

`drop_layout_copies` rewrites such a chain as views of the projection itself: for each tensor SDPA reads,
the index map from the copy's source through selects, transposes, permutes, (un)squeezes and reshapes is
followed symbolically, as atoms (a size and a stride each) that reshapes split and regroup, and is kept
only where it is proved for every size the graph admits: each split divides exactly (sympy, over the
positive integer sizes), and each dim SDPA reads is atoms that merge in memory. It is then re-emitted as
unflatten -> select -> permute -> flatten/unsqueeze of the source: the same elements, without the copy.
Where the source is `linear` of a transpose that leaves the last dim alone, the transpose moves past the
GEMM (rows are independent), so its input is read as it is. A chain that is not proved is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm, invert_perm

aten = torch.ops.aten
_COPIES = (aten.contiguous.default, aten.clone.default)
_VIEWS = {
    aten.select.int, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unflatten.int,
}
_SDPA = (aten.scaled_dot_product_attention.default,)
_SOURCE_VIEWS = _VIEWS - {aten.select.int, aten._unsafe_view.default}  # what may lie between source and copy


class Unproved(Exception):
    """The chain's index map could not be proved a strided view of its source."""


@dataclass(eq=False)
class Atom:
    """A run of one source dim: `size` elements `stride` apart (sympy, over the graph's size symbols)."""

    size: sympy.Expr
    stride: sympy.Expr


def _expr(d: Any) -> sympy.Expr:
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d))


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.simplify(a - b) == 0


def _quotient(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr | None:
    """a / b where it is an integer for every positive integer value of the symbols, else None."""
    q = sympy.cancel(a / b)
    num, den = sympy.fraction(q)
    if den != 1 or not q.is_polynomial():
        return None
    poly = sympy.Poly(num, *sorted(q.free_symbols, key=str)) if q.free_symbols else None
    if poly is not None and not all(c.is_integer and c > 0 for c in poly.coeffs()):
        return None
    return q if poly is not None or (q.is_integer and q > 0) else None


class Tracked:
    """A view of a source tensor as dims of atoms; `parts` is the source's own dims split into the atoms."""

    def __init__(self, shape: list[sympy.Expr], strides: list[sympy.Expr]) -> None:
        self.parts = [[Atom(n, s)] for n, s in zip(shape, strides, strict=True)]
        self.dims = [list(p) for p in self.parts]
        self.picked: dict[int, int] = {}  # id(atom) -> the index a select took

    def _split(self, atom: Atom, outer: sympy.Expr) -> tuple[Atom, Atom]:
        inner = _quotient(atom.size, outer)
        if inner is None:
            raise Unproved(f"{outer} does not divide {atom.size}")
        a, b = Atom(outer, atom.stride * inner), Atom(inner, atom.stride)
        for seq in (*self.parts, *self.dims):
            for i, x in enumerate(seq):
                if x is atom:
                    seq[i:i + 1] = [a, b]
        return a, b

    def _pick(self, atom: Atom, index: int) -> None:
        self.picked[id(atom)] = index

    def _size(self, dim: list[Atom]) -> sympy.Expr:
        return sympy.Mul(*[a.size for a in dim])

    def apply(self, node: fx.Node) -> None:
        t, a = node.target, node.args
        rank = len(self.dims)
        if t is aten.transpose.int:
            i, j = (d % rank for d in a[1:3])
            self.dims[i], self.dims[j] = self.dims[j], self.dims[i]
        elif t is aten.permute.default:
            self.dims = [self.dims[d % rank] for d in a[1]]
        elif t is aten.unsqueeze.default:
            self.dims.insert(a[1] % (rank + 1), [])
        elif t in (aten.squeeze.dim, aten.squeeze.dims):
            picked = [d % rank for d in (a[1] if isinstance(a[1], (list, tuple)) else [a[1]])]
            for d in sorted(picked, reverse=True):
                if not _same(self._size(self.dims[d]), 1):
                    continue  # squeeze of a dim that is not 1 leaves it
                for atom in self.dims.pop(d):
                    self._pick(atom, 0)
        elif t is aten.select.int:
            d, index = a[1] % rank, a[2]
            atoms = [x for x in self.dims[d] if not _same(x.size, 1)]
            if len(atoms) != 1 or not isinstance(index, int) or not atoms[0].size.is_number:
                raise Unproved("a select of a merged or symbolic dim")
            for x in self.dims.pop(d):
                self._pick(x, index % int(atoms[0].size) if x is atoms[0] else 0)
        else:  # view, reshape, _unsafe_view, unflatten: regroup the atoms into the new shape
            self._reshape([_expr(d) for d in node.meta["val"].shape])

    def _reshape(self, shape: list[sympy.Expr]) -> None:
        queue = [x for dim in self.dims for x in dim]
        dims: list[list[Atom]] = []
        for want in shape:
            dim: list[Atom] = []
            have: sympy.Expr = sympy.Integer(1)
            while not _same(have, want):
                while queue and _same(queue[0].size, 1):
                    self._pick(queue.pop(0), 0)
                if not queue:
                    raise Unproved("a reshape's sizes do not match its input's")
                atom = queue.pop(0)
                rest = _quotient(want, have)
                if rest is None:
                    raise Unproved(f"{have} does not divide {want}")
                if _quotient(rest, atom.size) is None:  # the atom is larger than what is left: split it
                    atom, tail = self._split(atom, rest)
                    queue.insert(0, tail)
                dim.append(atom)
                have = have * atom.size
            dims.append(dim)
        for atom in queue:
            if not _same(atom.size, 1):
                raise Unproved("a reshape's sizes do not match its input's")
            self._pick(atom, 0)
        self.dims = dims


def _source(copy: fx.Node) -> tuple[Any, list[fx.Node]]:
    """The first non-view node behind `copy` through single-use views (where tracking starts), and those views
    from it to `copy`, in order."""
    src, path = copy.args[0], []
    while isinstance(src, fx.Node) and src.target in _SOURCE_VIEWS and len(src.users) == 1:
        path.insert(0, src)
        src = src.args[0]
    return src, path


def _terminals(copy: fx.Node) -> list[list[fx.Node]] | None:
    """Each chain of views from `copy` to a tensor only SDPA's q, k or v read, or None if `copy` has another
    reader."""
    chains: list[list[fx.Node]] = []

    def walk(n: fx.Node, chain: list[fx.Node]) -> bool:
        views = [u for u in n.users if u.target in _VIEWS and u.args[0] is n]
        others = [u for u in n.users if u not in views]
        if others:
            if views or not all(u.target in _SDPA and n in u.args[:3] and n not in u.args[3:] and
                                n not in u.kwargs.values() for u in others):
                return False
            chains.append(chain)
            return True
        return bool(views) and all(walk(u, [*chain, u]) for u in views)

    return chains if walk(copy, []) and chains else None


def _strides(val: torch.Tensor) -> tuple[list[sympy.Expr], list[sympy.Expr]]:
    return [_expr(d) for d in val.shape], [_expr(s) for s in val.stride()]


def _transposed_linear(src: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(the linear, the transpose's dims) for `linear(x.transpose(i, j))` over the rows of a 3-D x, its
    output read by the chain alone: the transpose can follow the GEMM instead."""
    if src.target is not aten.linear.default or len(src.users) != 1:
        return None
    t = src.args[0]
    if not isinstance(t, fx.Node) or t.target is not aten.transpose.int or len(t.users) != 1:
        return None
    rank = t.meta["val"].dim()
    i, j = sorted(d % rank for d in t.args[1:3])
    return (src, i, j) if j < rank - 1 else None


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
    return node


def _emit(graph: fx.Graph, base: fx.Node, tracked: Tracked) -> fx.Node:
    """base (the source) viewed as `tracked`'s final dims: unflatten each source dim into its atoms, select the
    picked ones, permute the rest into order, merge each dim's atoms (flatten) and add its size-1 dims."""
    out = base
    offset = 0
    for d, part in enumerate(tracked.parts):
        if len(part) > 1:  # at most one symbolic atom (`_emittable`), which -1 stands for
            sizes = [int(a.size) if a.size.is_number else -1 for a in part]
            out = _call(graph, aten.unflatten.int, out, d + offset, sizes)
        offset += len(part) - 1
    atoms = [a for part in tracked.parts for a in part]
    for pos in sorted((i for i, a in enumerate(atoms) if id(a) in tracked.picked), reverse=True):
        out = _call(graph, aten.select.int, out, pos, tracked.picked[id(atoms[pos])])
    kept = [a for a in atoms if id(a) not in tracked.picked]
    order = [kept.index(a) for dim in tracked.dims for a in dim]
    if order != list(range(len(kept))):
        out = _call(graph, aten.permute.default, out, order)
    pos = 0
    for dim in tracked.dims:
        if not dim:
            out = _call(graph, aten.unsqueeze.default, out, pos)
        elif len(dim) > 1:
            out = _call(graph, aten.flatten.using_ints, out, pos, pos + len(dim) - 1)
        pos += 1
    return out


def _merges(dim: list[Atom]) -> bool:
    return all(_same(a.stride, b.size * b.stride) for a, b in zip(dim, dim[1:], strict=False))


def _emittable(tracked: Tracked) -> bool:
    """Whether `_emit` can spell the splits: each source dim split into at most one symbolic atom."""
    return all(len(p) == 1 or sum(not a.size.is_number for a in p) <= 1 for p in tracked.parts)


def _rewrite(graph: fx.Graph, copy: fx.Node) -> bool:
    chains = _terminals(copy)
    if chains is None:
        return False
    src, pre = _source(copy)
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
        return False
    moved = _transposed_linear(src)
    base_val = src.meta["val"]
    if moved is not None:  # track from linear(x) itself: the chain starts with the transpose
        lin, i, j = moved
        x = lin.args[0].args[0]
        base_val = aten.linear.default(x.meta["val"], *[a.meta["val"] if isinstance(a, fx.Node) else a
                                                        for a in lin.args[1:]])
    plans: list[tuple[list[fx.Node], Tracked]] = []
    try:
        for chain in chains:
            tracked = Tracked(*_strides(base_val))
            if moved is not None:
                tracked.dims[i], tracked.dims[j] = tracked.dims[j], tracked.dims[i]
            for n in [*pre, *chain]:
                tracked.apply(n)
            if not all(_merges([a for a in dim if not _same(a.size, 1)]) for dim in tracked.dims):
                raise Unproved("a dim attention reads is not one run in memory")
            if not _emittable(tracked):
                raise Unproved("a symbolic dim split into more than one symbolic part")
            plans.append((chain, tracked))
    except Unproved:
        return False
    with graph.inserting_before(copy):
        base = src if moved is None else _call(graph, aten.linear.default, x, *moved[0].args[1:])
        ends = [(chain[-1] if chain else copy, _emit(graph, base, tracked)) for chain, tracked in plans]
    for old, new in ends:
        want, got = old.meta["val"], new.meta["val"]
        if not (want.dim() == got.dim() and all(_same(_expr(a), _expr(b)) for a, b in zip(want.shape, got.shape,
                                                                                        strict=True))):
            raise AssertionError(f"layout_copies: {new} has shape {got.shape}, {old} {want.shape}")
        old.replace_all_uses_with(new)
    for sdpa in {u for _, new in ends for u in new.users if u.target in _SDPA}:
        _keep_output_layout(graph, sdpa)
    return True


def _keep_output_layout(graph: fx.Graph, sdpa: fx.Node) -> None:
    """SDPA's output follows q's memory order on CUDA, and the graph after it was traced on the order it had: a
    reshape there may have become a view that only that order allows. So where the order changed, the output is
    put back in it (one copy of the output, which a reshape on the new order would make anyway)."""
    old = sdpa.meta["val"]
    new = sdpa.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in sdpa.args],
                      **{k: v.meta["val"] if isinstance(v, fx.Node) else v for k, v in sdpa.kwargs.items()})
    sdpa.meta["val"] = new
    if all(_same(_expr(a), _expr(b)) for a, b in zip(old.stride(), new.stride(), strict=True)):
        return
    users = list(sdpa.users)
    with graph.inserting_before(sdpa.next):
        restored = restride(graph, sdpa, old)
    for u in users:
        u.replace_input_with(sdpa, restored)


def restride(graph: fx.Graph, node: fx.Node, val: torch.Tensor) -> fx.Node:
    """`node` (its value in `node.meta["val"]`) in `val`'s dense memory order, at the graph's insertion point:
    permute into that order, copy contiguous, permute back. Each new node records its value."""
    perm, _ = compute_elementwise_output_logical_to_physical_perm(val)
    phys = _call(graph, aten.permute.default, node, perm)
    dense = graph.call_function(aten.clone.default, (phys,), {"memory_format": torch.contiguous_format})
    dense.meta["val"] = aten.clone.default(phys.meta["val"], memory_format=torch.contiguous_format)
    out = _call(graph, aten.permute.default, dense, invert_perm(perm))
    out.meta["val"] = val
    return out


def drop_layout_copies(gm: fx.GraphModule) -> int:
    """Rewrite, in place, every layout copy whose views only attention reads (module docstring); the number."""
    graph = gm.graph
    copies = [n for n in graph.nodes if n.op == "call_function" and n.target in _COPIES
              and n.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format]
    done = sum(_rewrite(graph, c) for c in copies)
    if done:
        graph.eliminate_dead_code()
        gm.recompile()
    return done

