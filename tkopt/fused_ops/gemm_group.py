"""FusedGemmGroup: Y_g = A @ B_g + bias_g for two or three weights B_g that read the same A (Q/K/V projections).

Each B_g is (K, N_g), or (N_g, K) with trans_b=1 (linear weights); the biases come all or not at all. With two
weights B2 and bias2 are absent and Y2 is an empty (..., 0) tensor. One kernel launch computes every output
(tkopt.kernels.gemm_group), each its own contiguous tensor as the separate GEMMs give it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tkopt.ir import Node
from tkopt.kernels.arch import Build
from tkopt.kernels.workers import Compile

from .base import (
    Broadcast,
    FusedOp,
    InputSpec,
    ProgramSpec,
    Shape,
    Tensor,
    Unservable,
    check_dtypes,
    input_dtype,
    last_dim_expr,
    meta_tensors,
    static_dim,
)


def _groups(ins: Sequence[Any]) -> tuple[Any, list[Any], list[Any]]:
    """(A, the weights, their biases) of the inputs, B2 and bias2 left out where absent."""
    a, b0, b1, b2, *biases = ins
    weights = [b0, b1] if b2 is None else [b0, b1, b2]
    return a, weights, biases[:len(weights)]


def _with_empty_third(a: Tensor, outs: list[Tensor]) -> list[Tensor]:
    return outs if len(outs) == 3 else [*outs, a.new_empty((*a.shape[:-1], 0))]


def reference(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt.kernels import reference as ref

    a, weights, biases = _groups(ins)
    return _with_empty_third(a, ref.gemm_group_ref(a, weights, biases, b_transposed=bool(attrs["trans_b"])))


def kernel(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt import kernels

    a, weights, biases = _groups(ins)
    has_bias = biases[0] is not None
    return _with_empty_third(a, kernels.gemm_group(a, weights, biases if has_bias else None,
                                                   b_transposed=bool(attrs["trans_b"])))


def _widths(weights: Sequence[Any], trans_b: bool) -> list[Any]:
    return [w.shape[0] if trans_b else w.shape[1] for w in weights]


def compiles(specs: Sequence[InputSpec], attrs: dict[str, Any], build: Build) -> list[Compile]:
    from tkopt.kernels.gemm_epilogue import planned_kernels

    a, weights, biases = _groups(meta_tensors(specs))
    trans_b = bool(attrs["trans_b"])
    ns = tuple(_widths(weights, trans_b))
    return planned_kernels("gemm_group", build, math.prod(a.shape[:-1]), sum(ns), a.shape[-1], a.dtype, None,
                           biases[0] is not None, False, trans_b, groups=ns)


def output_shapes(shapes: Sequence[Shape | None], attrs: dict[str, Any], broadcast: Broadcast) -> list[Shape | None]:
    """(..., M, K) against each (K, N_g): (..., M, N_g); an absent third weight gives (..., M, 0)."""
    a, weights, _ = _groups(shapes)
    if a is None:
        return [None, None, None]
    outs = [None if w is None or len(w) != 2 else [*a[:-1], w[0] if attrs["trans_b"] else w[1]] for w in weights]
    return outs if len(outs) == 3 else [*outs, [*a[:-1], 0]]


def program(node: Node, arch: str) -> ProgramSpec:
    """The grouped GEMM program (tkopt.kernels.gemm_epilogue, groups=the weights' widths)."""
    from tkopt.kernels.config import default_config
    from tkopt.kernels.gemm_epilogue import gemm_program, group_default, group_problem, program_pass_configs

    dtype = input_dtype(node)
    check_dtypes(node, dtype, arch, tuple(range(len(node.inputs))))
    a, weights, biases = _groups(node.inputs)
    trans_b = bool(node.attrs["trans_b"])
    k = static_dim(a, -1, "A")
    ns = tuple(static_dim(w, 0 if trans_b else 1, f"B{g}") for g, w in enumerate(weights))
    for g, w in enumerate(weights):
        if w.rank != 2 or static_dim(w, 1 if trans_b else 0, f"B{g}") != k:
            raise Unservable(f"{node.name}: weight {w.name} is not 2-D with K={k}")
    has_bias = biases[0] is not None
    config = group_default(arch, dtype, None, sum(ns), None, "ieee", default_config(arch, dtype))
    problem = group_problem(arch, sum(ns), ns, config, config.math(arch, dtype))
    if problem:
        raise Unservable(f"{node.name}: {problem}")
    buffers: dict[str, tuple[str, int | str]] = {"A": ("in", 0)}
    buffers |= {f"B{g}": ("in", 1 + g) for g in range(len(ns))}
    if has_bias:
        buffers |= {f"Bias{g}": ("in", 4 + g) for g in range(len(ns))}
    buffers |= {f"C{g}": ("out", g) for g in range(len(ns))}
    key = ("gemm_group", arch, ns, k, dtype, config, trans_b, has_bias)
    return ProgramSpec(
        key,
        lambda: gemm_program(arch, sum(ns), k, dtype, config, b_transposed=trans_b, has_bias=has_bias, groups=ns),
        buffers,
        {g: last_dim_expr(0, n) for g, n in enumerate(ns)},
        program_pass_configs(config),
    )


OP = FusedOp(
    name="FusedGemmGroup",
    torch_name="fused_gemm_group",
    inputs=("A", "B0", "B1", "B2", "bias0", "bias1", "bias2"),
    optional_inputs=frozenset({"B2", "bias0", "bias1", "bias2"}),
    outputs=("Y0", "Y1", "Y2"),
    optional_outputs=frozenset({"Y2"}),
    attrs={"trans_b": 0},
    reference=reference,
    kernel=kernel,
    output_shapes=output_shapes,
    program=program,
    compiles=compiles,
)
