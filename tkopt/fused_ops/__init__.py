"""The fused ops (domain "tkopt"): one module per op, and the registry every other layer derives from.

A fused op is one unit. Its module (`gemm.py`, `gemm_group.py`, `gated_mlp.py`, `attention.py`, `add_norm.py`) defines
one `FusedOp` (base.py), named `OP`: its positional inputs and outputs (optional ones named), its
attributes with defaults, its output-shape rule, its torch reference (the one statement of its
semantics, on `tkopt.kernels.reference`), its kernel adapter (torch tensors to `tkopt.kernels`), its build
plan (`compiles`: the kernel compiles a node's calls use, which the torch targets' build wave makes) and its
native ORT binding (`program`: which TileLang program serves a node on an arch, and how the node's
tensors bind to the program's buffers), and, where ONNX Runtime's own ops compute the node alike, those ops
(`ort_ops`, which the ORT CPU target runs instead of the library's kernel). Derived from it, with no
per-op code elsewhere: the torch custom op `tkopt::<torch_name>` with its fake and autograd
(backends/torch_ops.py), the ONNX schema and shape inference (onnx_schema.py), the native ORT library's
bindings (ort/library.py) and the hybrid ONNX runner (onnx_runtime_ref.py).

Adding a fused op: write `<op>.py` here on the model of `add_norm.py` (plus its kernel in tkopt.kernels
and its reference in tkopt/kernels/reference.py), add its module to `_MODULES` below, and have a pass create
it with `tkopt.passes.base.fuse`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

from .base import FLOAT_DTYPES, FusedOp, ProgramSpec, Tensor, Unservable

_MODULES = ("gemm", "gemm_group", "gated_mlp", "attention", "add_norm")

SCHEMAS: dict[str, FusedOp] = {
    op.name: op for op in (importlib.import_module(f"{__name__}.{m}").OP for m in _MODULES)
}


def schema(op: str) -> FusedOp:
    """The definition of fused op `op`."""
    try:
        return SCHEMAS[op]
    except KeyError:
        raise ValueError(f"unknown fused op {op!r}; known: {sorted(SCHEMAS)}") from None


def run_reference(op: str, inputs: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    """Execute a fused op with its torch reference (float32 math, cast back to the input dtype)."""
    s = schema(op)
    return s.reference(s.padded(inputs), s.full_attrs(attrs))


def run_kernel(op: str, inputs: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    """Execute a fused op on its TileLang kernel for the tensors' device (sm90 / sm80 / cpu variant)."""
    s = schema(op)
    return s.kernel(s.padded(inputs), s.full_attrs(attrs))


def use_kernels() -> bool:
    """Whether fused ops run their kernels (default) or, with TKOPT_KERNELS=reference, their references."""
    mode = os.environ.get("TKOPT_KERNELS", "tilelang")
    if mode not in ("tilelang", "reference"):
        raise ValueError(f"TKOPT_KERNELS must be 'tilelang' or 'reference', got {mode!r}")
    return mode == "tilelang"


def execute(op: str, inputs: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    """Run fused op `op` on real tensors as configured: the kernel, or the reference (TKOPT_KERNELS)."""
    return (run_kernel if use_kernels() else run_reference)(op, inputs, attrs)


__all__ = ["FLOAT_DTYPES", "SCHEMAS", "FusedOp", "ProgramSpec", "Unservable", "execute", "run_kernel", "run_reference",
           "schema", "use_kernels"]
