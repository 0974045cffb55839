"""The fused ops (domain "tkopt"): their inputs, outputs, attributes, and what they compute.

This is the contract between the passes (which create fused nodes), the backends (which emit them
as torch custom ops or ONNX nodes), the native ORT op library, and the kernels. The math is
`tkopt.kernels.reference`; `run_reference` maps a fused node's positional inputs and attributes
onto it, so there is exactly one statement of each op's semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tkopt.kernels import reference as ref

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid")
# The dtypes every fused op declares (its ONNX type constraints): all tensors one float dtype "T", except
# an input named "mask" ("M": a float dtype of its own, or bool).
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
MASK_DTYPES = (*FLOAT_DTYPES, "bool")


@dataclass(frozen=True)
class FusedOpSchema:
    """Positional inputs (optional ones may be None), outputs (optional ones may be absent), attrs."""

    name: str
    inputs: tuple[str, ...]
    optional_inputs: frozenset[str]
    outputs: tuple[str, ...]
    optional_outputs: frozenset[str]
    attrs: dict[str, Any]  # name -> default
    reference: Callable[[Sequence[torch.Tensor | None], dict[str, Any]], list[torch.Tensor]]

    def dtype_problem(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> str | None:
        """Why tensors of these dtypes (IR Values, or None for an omitted one) cannot be this op's
        inputs and outputs (FLOAT_DTYPES / MASK_DTYPES above), or None."""
        named = [*zip(self.inputs, inputs, strict=True), *zip(self.outputs, outputs, strict=False)]
        shared = {v.dtype for n, v in named if v is not None and n != "mask"}
        if None in shared:
            return f"{self.name}: a tensor's dtype is unknown"
        if len(shared) != 1 or not shared <= set(FLOAT_DTYPES):
            return f"{self.name} takes one float dtype ({', '.join(FLOAT_DTYPES)}) got {sorted(shared)}"
        mask = dict(named).get("mask")
        if mask is not None and mask.dtype not in MASK_DTYPES:
            return f"{self.name}: mask dtype {mask.dtype} is not one of {', '.join(MASK_DTYPES)}"
        return None

    def full_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ValueError(f"{self.name}: unknown attributes {sorted(unknown)}")
        return {**self.attrs, **attrs}


def _act(attrs: dict[str, Any]) -> str | None:
    a = attrs["activation"]
    if a not in ACTIVATIONS:
        raise ValueError(f"unknown activation {a!r}; expected one of {ACTIVATIONS}")
    return None if a == "none" else a


def _gemm(ins: Sequence[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    a, b, bias, residual = ins
    return [ref.gemm_ref(a, b, bias, _act(attrs), residual, b_transposed=bool(attrs["trans_b"]))]


def _gated(ins: Sequence[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    x, wg, wu, bg, bu = ins
    return [ref.gated_mlp_ref(x, wg, wu, _act(attrs), bg, bu, weights_transposed=bool(attrs["trans_b"]))]


def _attention(ins: Sequence[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    q, k, v, mask = ins
    scale = attrs["scale"]
    return [
        ref.flash_attention_ref(
            q, k, v, causal=bool(attrs["causal"]), mask=mask, scale=None if scale <= 0 else scale,
            layout=attrs["layout"], mask_scale=attrs["mask_scale"], mask_fill=attrs["mask_fill"],
            guard=attrs["guard"], mask_keeps=bool(attrs["mask_keeps"]),
        )
    ]


def _add_norm(ins: Sequence[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    x, residual, weight, bias = ins
    if attrs["kind"] == "layer":
        y, s = ref.add_layer_norm_ref(x, residual, weight, bias, attrs["epsilon"])
    elif attrs["kind"] == "rms":
        if bias is not None:
            raise ValueError("FusedAddNorm kind='rms' takes no bias")
        y, s = ref.add_rms_norm_ref(x, residual, weight, attrs["epsilon"])
    else:
        raise ValueError(f"FusedAddNorm kind must be 'layer' or 'rms', got {attrs['kind']!r}")
    return [y, s]


SCHEMAS: dict[str, FusedOpSchema] = {
    s.name: s
    for s in (
        # Y = act(A @ B + bias) + residual; B is (K, N), or (N, K) with trans_b=1 (a linear weight).
        FusedOpSchema(
            "FusedGemm", ("A", "B", "bias", "residual"), frozenset({"bias", "residual"}), ("Y",),
            frozenset(), {"trans_b": 0, "activation": "none"}, _gemm,
        ),
        # Y = act(X @ Wg + bg) * (X @ Wu + bu)  (SwiGLU: silu, GeGLU: gelu / gelu_tanh).
        FusedOpSchema(
            "FusedGatedMLP", ("X", "W_gate", "W_up", "b_gate", "b_up"), frozenset({"b_gate", "b_up"}),
            ("Y",), frozenset(), {"trans_b": 0, "activation": "silu"}, _gated,
        ),
        # O = softmax(T) V with T = Q K^T * scale + mask * mask_scale (float mask), or
        # Where(mask == mask_keeps, Q K^T * scale, mask_fill) (bool mask); causal drops keys after the
        # query (top-left). guard: what a row gives whose every T is -inf ("none": NaN, as softmax;
        # "masked": 0, as SDPA) or that holds a NaN ("nan": 0, as Where(IsNaN(p), 0, p)).
        # layout "bhsd" or "bshd" for Q, K, V and O; K/V may have fewer heads (GQA).
        # scale <= 0 means 1/sqrt(head_dim). Exact definition: kernels.reference.flash_attention_ref.
        FusedOpSchema(
            "FusedAttention", ("Q", "K", "V", "mask"), frozenset({"mask"}), ("O",), frozenset(),
            {"scale": 0.0, "causal": 0, "layout": "bhsd", "mask_scale": 1.0, "mask_fill": float("-inf"),
             "guard": "masked", "mask_keeps": 1}, _attention,
        ),
        # Y = Norm(X + residual) over the last axis; Sum = X + residual (emitted when used later).
        FusedOpSchema(
            "FusedAddNorm", ("X", "residual", "weight", "bias"), frozenset({"residual", "weight", "bias"}),
            ("Y", "Sum"), frozenset({"Sum"}), {"kind": "layer", "epsilon": 1e-5}, _add_norm,
        ),
    )
}


def schema(op: str) -> FusedOpSchema:
    try:
        return SCHEMAS[op]
    except KeyError:
        raise ValueError(f"unknown fused op {op!r}; known: {sorted(SCHEMAS)}") from None


def run_reference(op: str, inputs: Sequence[torch.Tensor | None], attrs: dict[str, Any]) -> list[torch.Tensor]:
    """Execute a fused op with the torch reference (float32 math, cast back to the input dtype)."""
    s = schema(op)
    if len(inputs) != len(s.inputs):
        inputs = list(inputs) + [None] * (len(s.inputs) - len(inputs))
    return s.reference(inputs, s.full_attrs(attrs))
