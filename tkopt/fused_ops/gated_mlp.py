"""FusedGatedMLP: Y = act(X @ Wg + bg) * (X @ Wu + bu)  (SwiGLU: silu; GeGLU: gelu / gelu_tanh).

Both weights are (K, N), or (N, K) with trans_b=1; the biases come both or not at all. It runs on
the GEMM-epilogue kernel with two accumulators.

packed=1 is one projection producing both halves (Phi-3's gate_up_proj, then chunk(2, -1)): W_gate holds
[Wg | Wu] stacked along N (its 2N rows with trans_b=1, columns otherwise), b_gate likewise, and W_up and
b_up are absent. The halves are sliced from the weight at every call, so a weight that changes after
compiling (a parameter being trained or loaded) is read as it is then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tkopt.ir import Node
from tkopt.kernels.arch import Build
from tkopt.kernels.workers import Compile

from .base import Broadcast, FusedOp, InputSpec, ProgramSpec, Shape, Tensor, Unservable, meta_tensors
from .gemm import activation, gemm_program, planned
from .gemm import output_shapes as gemm_shapes


def _unpacked(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> tuple:
    """(X, Wg, Wu, bg, bu), the halves of a packed weight and bias taken as torch.chunk takes them."""
    x, wg, wu, bg, bu = ins
    if not attrs["packed"]:
        return x, wg, wu, bg, bu
    wg, wu = (w.contiguous() for w in wg.chunk(2, dim=0 if attrs["trans_b"] else 1))
    if bg is not None:
        bg, bu = bg.chunk(2)
    return x, wg, wu, bg, bu


def reference(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt.kernels import reference as ref

    x, wg, wu, bg, bu = _unpacked(ins, attrs)
    return [ref.gated_mlp_ref(x, wg, wu, activation(attrs), bg, bu, weights_transposed=bool(attrs["trans_b"]))]


def kernel(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt import kernels

    x, wg, wu, bg, bu = _unpacked(ins, attrs)
    return [kernels.gated_mlp(x, wg, wu, activation(attrs) or "silu", bg, bu,
                              weights_transposed=bool(attrs["trans_b"]))]


def compiles(specs: Sequence[InputSpec], attrs: dict[str, Any], build: Build) -> list[Compile]:
    x, wg, _, bg, _ = _unpacked(meta_tensors(specs), attrs)
    return planned("gated_mlp", x, wg, bg is not None, False, activation(attrs) or "silu", bool(attrs["trans_b"]),
                   build)


def output_shapes(shapes: Sequence[Shape | None], attrs: dict[str, Any], broadcast: Broadcast) -> list[Shape | None]:
    """X against W_gate, as a GEMM; a packed W_gate's N is both halves."""
    (out,) = gemm_shapes(shapes, attrs, broadcast)
    if not attrs["packed"] or out is None:
        return [out]
    n = out[-1]
    return [[*out[:-1], n // 2] if isinstance(n, int) else None]


def program(node: Node, arch: str) -> ProgramSpec:
    if node.attrs["packed"]:
        raise Unservable(f"{node.name}: a packed gate/up weight; the native library's program takes the two apart")
    return gemm_program(node, arch, gated=True)


OP = FusedOp(
    name="FusedGatedMLP",
    torch_name="fused_gated_mlp",
    inputs=("X", "W_gate", "W_up", "b_gate", "b_up"),
    optional_inputs=frozenset({"W_up", "b_gate", "b_up"}),
    outputs=("Y",),
    attrs={"trans_b": 0, "activation": "silu", "packed": 0},
    reference=reference,
    kernel=kernel,
    output_shapes=output_shapes,
    program=program,
    compiles=compiles,
)
