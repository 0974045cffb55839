"""FusedGatedMLP: Y = act(X @ Wg + bg) * (X @ Wu + bu)  (SwiGLU: silu; GeGLU: gelu / gelu_tanh).

Both weights are (K, N), or (N, K) with trans_b=1; the biases come both or not at all. It runs on
the GEMM-epilogue kernel with two accumulators.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import FusedOp, Tensor
from .gemm import activation, gemm_program, output_shapes


def reference(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt.kernels import reference as ref

    x, wg, wu, bg, bu = ins
    return [ref.gated_mlp_ref(x, wg, wu, activation(attrs), bg, bu, weights_transposed=bool(attrs["trans_b"]))]


def kernel(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt import kernels

    x, wg, wu, bg, bu = ins
    return [kernels.gated_mlp(x, wg, wu, activation(attrs) or "silu", bg, bu,
                              weights_transposed=bool(attrs["trans_b"]))]


OP = FusedOp(
    name="FusedGatedMLP",
    torch_name="fused_gated_mlp",
    inputs=("X", "W_gate", "W_up", "b_gate", "b_up"),
    optional_inputs=frozenset({"b_gate", "b_up"}),
    outputs=("Y",),
    attrs={"trans_b": 0, "activation": "silu"},
    reference=reference,
    kernel=kernel,
    output_shapes=output_shapes,  # X against W_gate, as a GEMM
    program=lambda node, arch: gemm_program(node, arch, gated=True),
)
