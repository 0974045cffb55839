"""The fused ops as torch custom ops (tkopt::fused_gemm, ...), so FX graphs can call them.

Each op has explicit typed arguments (optional tensors, str/int/float attributes), a fake
implementation that gives output shapes and dtypes without computing (so torch.export and
torch.compile can trace through an optimized module, symbolic shapes included), and a real
implementation. Every real body goes through `execute`, the single place that picks how a fused
op runs: today the torch reference; later the TileLang kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tkopt import fused_ops
from tkopt.kernel_dispatch import run_kernel, use_kernels

Tensor = torch.Tensor


def execute(op: str, inputs: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    """Run fused op `op` (a tkopt.fused_ops name) on real tensors. The one dispatch point.

    TileLang kernels for the tensors' device (tkopt.kernel_dispatch), or the torch reference with
    TKOPT_KERNELS=reference. Nodes whose kernel failed its probe were already left unfused.
    """
    if use_kernels():
        outs = run_kernel(op, inputs, attrs)
    else:
        outs = fused_ops.run_reference(op, inputs, attrs)
    # Custom ops must return fresh, contiguous tensors (the fake impls promise contiguous ones);
    # a reference may hand back an input itself (e.g. FusedAddNorm's Sum without a residual).
    ins = [t for t in inputs if t is not None]
    fresh = torch.contiguous_format
    return [o.clone(memory_format=fresh) if any(o is t for t in ins) else o.contiguous() for o in outs]


def _empty(like: Tensor, shape: Sequence[Any]) -> Tensor:
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)


def _gemm_shape(a: Tensor, b: Tensor, trans_b: int) -> list[Any]:
    n = b.shape[-2] if trans_b else b.shape[-1]
    if b.dim() == 2:
        return [*a.shape[:-1], n]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return [*batch, a.shape[-2], n]


# ---- FusedGemm: Y = act(A @ B + bias) + residual ------------------------------------------------
@torch.library.custom_op("tkopt::fused_gemm", mutates_args=())
def fused_gemm(
    A: Tensor, B: Tensor, bias: Tensor | None, residual: Tensor | None, trans_b: int, activation: str
) -> Tensor:
    return execute("FusedGemm", [A, B, bias, residual], {"trans_b": trans_b, "activation": activation})[0]


@fused_gemm.register_fake
def _(A: Tensor, B: Tensor, bias: Tensor | None, residual: Tensor | None, trans_b: int, activation: str) -> Tensor:
    return _empty(A, _gemm_shape(A, B, trans_b))


# ---- FusedGatedMLP: Y = act(X @ Wg + bg) * (X @ Wu + bu) ----------------------------------------
@torch.library.custom_op("tkopt::fused_gated_mlp", mutates_args=())
def fused_gated_mlp(
    X: Tensor, W_gate: Tensor, W_up: Tensor, b_gate: Tensor | None, b_up: Tensor | None, trans_b: int,
    activation: str,
) -> Tensor:
    attrs = {"trans_b": trans_b, "activation": activation}
    return execute("FusedGatedMLP", [X, W_gate, W_up, b_gate, b_up], attrs)[0]


@fused_gated_mlp.register_fake
def _(
    X: Tensor, W_gate: Tensor, W_up: Tensor, b_gate: Tensor | None, b_up: Tensor | None, trans_b: int,
    activation: str,
) -> Tensor:
    return _empty(X, _gemm_shape(X, W_gate, trans_b))


# ---- FusedAttention: O = softmax(Q K^T * scale + mask [causal]) V --------------------------------
@torch.library.custom_op("tkopt::fused_attention", mutates_args=())
def fused_attention(
    Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, scale: float, causal: int, layout: str,
    mask_scale: float, mask_fill: float, guard: str, mask_keeps: int,
) -> Tensor:
    attrs = {"scale": scale, "causal": causal, "layout": layout, "mask_scale": mask_scale, "mask_fill": mask_fill,
             "guard": guard, "mask_keeps": mask_keeps}
    return execute("FusedAttention", [Q, K, V, mask], attrs)[0]


@fused_attention.register_fake
def _(
    Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, scale: float, causal: int, layout: str,
    mask_scale: float, mask_fill: float, guard: str, mask_keeps: int,
) -> Tensor:
    return _empty(Q, [*Q.shape[:-1], V.shape[-1]])


# ---- FusedAddNorm: (Norm(X + residual), X + residual) ---------------------------------------------
@torch.library.custom_op("tkopt::fused_add_norm", mutates_args=())
def fused_add_norm(
    X: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, kind: str, epsilon: float
) -> tuple[Tensor, Tensor]:
    y, s = execute("FusedAddNorm", [X, residual, weight, bias], {"kind": kind, "epsilon": epsilon})
    return y, s


@fused_add_norm.register_fake
def _(
    X: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, kind: str, epsilon: float
) -> tuple[Tensor, Tensor]:
    shape = X.shape if residual is None else torch.broadcast_shapes(X.shape, residual.shape)
    return _empty(X, shape), _empty(X, shape)


# fused op name (tkopt.fused_ops) -> (custom op, its attribute names in signature order)
CUSTOM_OPS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "FusedGemm": (torch.ops.tkopt.fused_gemm.default, ("trans_b", "activation")),
    "FusedGatedMLP": (torch.ops.tkopt.fused_gated_mlp.default, ("trans_b", "activation")),
    "FusedAttention": (torch.ops.tkopt.fused_attention.default,
                       ("scale", "causal", "layout", "mask_scale", "mask_fill", "guard", "mask_keeps")),
    "FusedAddNorm": (torch.ops.tkopt.fused_add_norm.default, ("kind", "epsilon")),
}


# ---- Autograd: each op's backward differentiates its torch reference (tkopt.fused_ops) ----------
def _register_backward(custom_op: Any, op: str, attr_names: tuple[str, ...]) -> None:
    """Backward by recomputation: the reference, re-run under autograd on the saved inputs, gives the
    input gradients. Correct for every op and dtype the reference takes; not a fused backward kernel."""
    n_tensors = len(fused_ops.schema(op).inputs)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = inputs[:n_tensors]
        ctx.present = [t is not None for t in tensors]
        ctx.save_for_backward(*[t for t in tensors if t is not None])
        ctx.attrs = dict(zip(attr_names, inputs[n_tensors:], strict=True))

    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        ins = [next(saved).detach() if present else None for present in ctx.present]
        wants = [t is not None and t.is_floating_point() and need
                 for t, need in zip(ins, ctx.needs_input_grad[:n_tensors], strict=True)]
        for t, want in zip(ins, wants, strict=True):
            if want:
                t.requires_grad_(True)
        with torch.enable_grad():
            outs = fused_ops.run_reference(op, ins, ctx.attrs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=False) if g is not None and o.requires_grad]
        leaves = [t for t, want in zip(ins, wants, strict=True) if want]
        got = iter(torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
                   if pairs and leaves else [None] * len(leaves))
        return (*[next(got) if want else None for want in wants], *[None] * len(attr_names))

    torch.library.register_autograd(custom_op.name(), backward, setup_context=setup_context)


for _op, (_custom_op, _attr_names) in CUSTOM_OPS.items():
    _register_backward(_custom_op, _op, _attr_names)
