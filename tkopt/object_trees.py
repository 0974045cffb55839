"""Python objects holding tensors (a KV cache, a model's own output class) as pytrees, for torch.export.

torch.export flattens a model's inputs and outputs with torch's pytree, which knows tuples, lists,
dicts and the classes registered with it (transformers registers its ModelOutputs), and nothing else:
transformers' DynamicCache and its layers, or any user class holding tensors, stop the export.
`Boxer.box` replaces each such object by a `Boxed` node (tkopt's own registered pytree node; the
user's class is not registered globally): the class and the attributes holding no tensor or number
are the node's context, part of the tree spec, so another value re-specializes; the attributes
holding tensors or numbers (not bools) are its children, traced as graph inputs and outputs.
`unbox` rebuilds the objects (`cls.__new__` plus their attributes), or, for an object the caller
passed in, writes the new attributes into that very object: a cache the model updates in place is
updated in place, as in eager.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

_TRACED = (torch.Tensor, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)  # bool: a static flag


@dataclass
class Boxed:
    """An object as a pytree node: `dynamic` (its tensor- or number-holding attributes) are children."""

    cls: type
    static: dict[str, Any]  # attributes without tensors or numbers: compared, not traced
    dynamic: dict[str, Any]
    source: int | None = None  # the caller's input object (by box order) this one is, if any


def _flatten(b: Boxed) -> tuple[list[Any], Any]:
    return [b.dynamic], (b.cls, b.static, b.source)


def _unflatten(children: Sequence[Any], context: Any) -> Boxed:
    cls, static, source = context
    return Boxed(cls, static, children[0], source)


def _flatten_with_keys(b: Boxed) -> tuple[list[tuple[Any, Any]], Any]:
    return [(pytree.GetAttrKey("dynamic"), b.dynamic)], (b.cls, b.static, b.source)


pytree.register_pytree_node(
    Boxed, _flatten, _unflatten, serialized_type_name="tkopt.object_trees.Boxed",
    flatten_with_keys_fn=_flatten_with_keys,
)


def _holds_traced(x: Any, stack: tuple[int, ...] = ()) -> bool:
    """Whether `x` holds a tensor or a number somewhere (pytree containers and object attributes)."""
    if isinstance(x, _TRACED) and not isinstance(x, bool):
        return True
    if _boxable(x):
        _check_acyclic(x, stack)
        return any(_holds_traced(v, (*stack, id(x))) for v in vars(x).values())
    if pytree.tree_is_leaf(x):
        return False
    return any(_holds_traced(v, stack) for v in pytree.tree_leaves(x))


def _check_acyclic(x: Any, stack: tuple[int, ...]) -> None:
    if id(x) in stack:
        raise ValueError(f"tkopt: cannot flatten a {type(x).__name__}: it refers back to itself")


def _boxable(x: Any) -> bool:
    """An object pytree treats as an opaque leaf but whose attributes we can read and restore."""
    return (
        pytree.tree_is_leaf(x) and hasattr(x, "__dict__") and not callable(x)
        and not isinstance(x, (*_TRACED, nn.Module, type, enum.Enum))
    )


class Boxer:
    """One direction of one call: boxes objects in order, remembering them (`objects`) by that order."""

    def __init__(self, sources: dict[int, int] | None = None) -> None:
        self.objects: list[Any] = []
        self.sources = sources or {}  # id(object) -> index of the caller's input object it is
        self.stack: tuple[int, ...] = ()  # the objects being boxed, outermost first

    def box(self, tree: Any) -> Any:
        """`tree` with every object pytree does not know replaced by a Boxed node."""
        return pytree.tree_map(lambda x: self.box_object(x) if _boxable(x) else x, tree)

    def box_object(self, x: Any) -> Boxed:
        """`x` (boxable) as a Boxed node."""
        _check_acyclic(x, self.stack)
        self.objects.append(x)
        static, dynamic = {}, {}
        self.stack = outer = (*self.stack, id(x))
        for k, v in vars(x).items():
            (dynamic if _holds_traced(v, outer) else static)[k] = v
        boxed = Boxed(type(x), static, self.box(dynamic), self.sources.get(id(x)))
        self.stack = outer[:-1]
        return boxed


def unbox(tree: Any, targets: Sequence[Any] = ()) -> tuple[Any, list[Any]]:
    """`tree` with its Boxed nodes rebuilt as objects, and those objects in box order.

    A node whose `source` indexes `targets` updates that object in place and stands for it.
    """
    made: list[Any] = []

    def build(b: Any) -> Any:
        if not isinstance(b, Boxed):
            return b
        if b.source is not None and b.source < len(targets):
            obj = targets[b.source]
        else:
            obj = b.cls.__new__(b.cls)
        made.append(obj)
        attrs = {**b.static, **pytree.tree_map(build, b.dynamic, is_leaf=lambda x: isinstance(x, Boxed))}
        obj.__dict__.clear()
        obj.__dict__.update(attrs)
        return obj

    return pytree.tree_map(build, tree, is_leaf=lambda x: isinstance(x, Boxed)), made
