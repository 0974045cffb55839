"""The fused ops as torch custom ops (tkopt::fused_gemm, ...), so FX graphs can call them.

Derived from the definitions in tkopt.fused_ops, one op each: the schema (tensors, optional tensors,
then the attributes, typed by their defaults), a fake implementation from the op's shape rule (so
torch.export and torch.compile trace through an optimized module, symbolic shapes included), the real
implementation (`tkopt.fused_ops.execute`: the kernel, or the reference with TKOPT_KERNELS=reference),
and a backward that differentiates the reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tkopt import fused_ops
from tkopt.fused_ops import FusedOp

Tensor = torch.Tensor
_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


def _schema(op: FusedOp) -> str:
    tensors = [f"Tensor{'?' if n in op.optional_inputs else ''} {n}" for n in op.inputs]
    attrs = [f"{_SCHEMA_TYPES[type(d)]} {k}" for k, d in op.attrs.items()]
    returns = "Tensor" if len(op.outputs) == 1 else f"({', '.join(['Tensor'] * len(op.outputs))})"
    return f"({', '.join(tensors + attrs)}) -> {returns}"


def attr_args(op: str, attrs: Mapping[str, Any]) -> list[Any]:
    """A fused node's attributes as its custom op's trailing arguments (IR attrs may be bool or numpy)."""
    d = fused_ops.schema(op)
    full = d.full_attrs(attrs)
    return [type(default)(full[k]) for k, default in d.attrs.items()]


def _split(op: FusedOp, args: Sequence[Any]) -> tuple[list[Tensor | None], dict[str, Any]]:
    n = len(op.inputs)
    return list(args[:n]), dict(zip(op.attrs, args[n:], strict=True))


def _returns(op: FusedOp, outs: Sequence[Tensor]) -> Tensor | tuple[Tensor, ...]:
    return outs[0] if len(op.outputs) == 1 else tuple(outs)


def _define(op: FusedOp) -> Any:
    def impl(*args: Any) -> Tensor | tuple[Tensor, ...]:
        ins, attrs = _split(op, args)
        outs = fused_ops.execute(op.name, ins, attrs)
        # Custom ops must return fresh, contiguous tensors (the fake impl promises contiguous ones);
        # a reference may hand back an input itself (e.g. FusedAddNorm's Sum without a residual).
        given = [t for t in ins if t is not None]
        fresh = [o.clone(memory_format=torch.contiguous_format) if any(o is t for t in given) else o.contiguous()
                 for o in outs]
        return _returns(op, fresh)

    def fake(*args: Any) -> Tensor | tuple[Tensor, ...]:
        ins, attrs = _split(op, args)
        first = ins[0]
        shapes = [None if t is None else t.shape for t in ins]
        out_shapes = op.output_shapes(shapes, attrs, torch.broadcast_shapes)
        return _returns(op, [torch.empty(tuple(s), dtype=first.dtype, device=first.device) for s in out_shapes])

    custom = torch.library.custom_op(f"tkopt::{op.torch_name}", impl, mutates_args=(), schema=_schema(op))
    custom.register_fake(fake)
    overload = getattr(torch.ops.tkopt, op.torch_name).default
    _register_backward(overload, op)
    return overload


def _register_backward(custom_op: Any, op: FusedOp) -> None:
    """Backward by recomputation: the reference, re-run under autograd on the saved inputs, gives the
    input gradients. Correct for every op and dtype the reference takes; not a fused backward kernel."""
    n_tensors = len(op.inputs)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = inputs[:n_tensors]
        ctx.present = [t is not None for t in tensors]
        ctx.save_for_backward(*[t for t in tensors if t is not None])
        ctx.attrs = dict(zip(op.attrs, inputs[n_tensors:], strict=True))

    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        ins = [next(saved).detach() if present else None for present in ctx.present]
        wants = [t is not None and t.is_floating_point() and need
                 for t, need in zip(ins, ctx.needs_input_grad[:n_tensors], strict=True)]
        for t, want in zip(ins, wants, strict=True):
            if want:
                t.requires_grad_(True)
        with torch.enable_grad():
            outs = fused_ops.run_reference(op.name, ins, ctx.attrs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=False) if g is not None and o.requires_grad]
        leaves = [t for t, want in zip(ins, wants, strict=True) if want]
        got = iter(torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
                   if pairs and leaves else [None] * len(leaves))
        return (*[next(got) if want else None for want in wants], *[None] * len(op.attrs))

    torch.library.register_autograd(custom_op.name(), backward, setup_context=setup_context)


# fused op name -> its torch custom op (positional: the op's inputs, then its attributes in definition order)
CUSTOM_OPS: dict[str, Any] = {name: _define(op) for name, op in fused_ops.SCHEMAS.items()}
