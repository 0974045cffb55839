"""FusedGemm: Y = act(A @ B + bias) + residual.

B is (K, N), or (N, K) with trans_b=1 (a linear weight); A may have leading batch dims. The kernel
keeps K and N static and the rows dynamic, so one compiled kernel serves every batch and sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid")


def activation(attrs: Mapping[str, Any]) -> str | None:
    """The epilogue activation by name (None for "none"); an unknown name is an error."""
    a = attrs["activation"]
    if a not in ACTIVATIONS:
        raise ValueError(f"unknown activation {a!r}; expected one of {ACTIVATIONS}")
    return None if a == "none" else a


def reference(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt.kernels import reference as ref

    a, b, bias, residual = ins
    return [ref.gemm_ref(a, b, bias, activation(attrs), residual, b_transposed=bool(attrs["trans_b"]))]


def kernel(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt import kernels

    a, b, bias, residual = ins
    return [kernels.gemm(a, b, bias, activation(attrs), residual, b_transposed=bool(attrs["trans_b"]))]


def planned(kind: str, a: Tensor, b: Tensor, has_bias: bool, has_residual: bool, act: str | None, trans_b: bool,
            build: Build) -> list[Compile]:
    """The compiles a `kind` ("gemm" / "gated_mlp") call of A against a 2-D weight B uses (none for a batched B,
    which the kernel refuses)."""
    from tkopt.kernels.gemm_epilogue import planned_kernels

    if b.dim() != 2:
        return []
    n = b.shape[0] if trans_b else b.shape[1]
    return planned_kernels(kind, build, math.prod(a.shape[:-1]), n, a.shape[-1], a.dtype, act, has_bias,
                           has_residual, trans_b, gated=kind == "gated_mlp")


def compiles(specs: Sequence[InputSpec], attrs: dict[str, Any], build: Build) -> list[Compile]:
    a, b, bias, residual = meta_tensors(specs)
    return planned("gemm", a, b, bias is not None, residual is not None, activation(attrs), bool(attrs["trans_b"]),
                   build)


def output_shapes(shapes: Sequence[Shape | None], attrs: dict[str, Any], broadcast: Broadcast) -> list[Shape | None]:
    """(..., M, K) x (K, N) -> (..., M, N); a batched B broadcasts against A's batch dims."""
    a, b = shapes[0], shapes[1]
    if a is None or b is None or len(b) < 2:
        return [None]
    n = b[-2] if attrs["trans_b"] else b[-1]
    if len(b) == 2:
        return [[*a[:-1], n]]
    batch = broadcast(a[:-2], b[:-2])
    return [None if batch is None else [*batch, a[-2], n]]


def gemm_program(node: Node, arch: str, gated: bool) -> ProgramSpec:
    """The GEMM-epilogue program (shared with FusedGatedMLP, whose two weights make it `gated`)."""
    from tkopt.kernels.config import default_config
    from tkopt.kernels.gemm_epilogue import gemm_program as build_program
    from tkopt.kernels.gemm_epilogue import program_pass_configs

    dtype = input_dtype(node)
    check_dtypes(node, dtype, arch, tuple(range(len(node.inputs))))
    a, b = node.inputs[0], node.inputs[1]
    trans_b = bool(node.attrs["trans_b"])
    if b.rank != 2:
        raise Unservable(f"{node.name}: weight {b.name} must be 2-D")
    k = static_dim(a, -1, "A")
    n = static_dim(b, 0 if trans_b else 1, "B")
    if static_dim(b, 1 if trans_b else 0, "B") != k:
        raise Unservable(f"{node.name}: weight {b.name} does not match K={k}")
    act = activation(node.attrs)
    if gated:
        has_bias = node.inputs[3] is not None
        if has_bias != (node.inputs[4] is not None):
            raise Unservable(f"{node.name}: the gated kernel takes both biases or neither")
        has_res = False
        buffers: dict[str, tuple[str, int | str]] = {"A": ("in", 0), "B": ("in", 1), "B2": ("in", 2)}
        if has_bias:
            buffers |= {"Bias": ("in", 3), "Bias2": ("in", 4)}
    else:
        has_bias = node.inputs[2] is not None
        has_res = len(node.inputs) > 3 and node.inputs[3] is not None
        buffers = {"A": ("in", 0), "B": ("in", 1)}
        if has_bias:
            buffers["Bias"] = ("in", 2)
        if has_res:
            buffers["R"] = ("in", 3)
    buffers["C"] = ("out", 0)
    config = default_config(arch, dtype, accumulators=2 if gated else 1)
    key = ("gemm", arch, n, k, dtype, config, trans_b, has_bias, act, has_res, gated)
    return ProgramSpec(
        key,
        lambda: build_program(arch, n, k, dtype, config, b_transposed=trans_b, has_bias=has_bias, act=act,
                              has_residual=has_res, gated=gated),
        buffers,
        {0: last_dim_expr(0, n)},
        program_pass_configs(config),
    )


OP = FusedOp(
    name="FusedGemm",
    torch_name="fused_gemm",
    inputs=("A", "B", "bias", "residual"),
    optional_inputs=frozenset({"bias", "residual"}),
    outputs=("Y",),
    attrs={"trans_b": 0, "activation": "none"},
    reference=reference,
    kernel=kernel,
    output_shapes=output_shapes,
    program=lambda node, arch: gemm_program(node, arch, gated=False),
    compiles=compiles,
)
