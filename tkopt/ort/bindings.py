"""Which TileLang program runs a fused node, and how the node's tensors bind to its buffers.

One function per fused op reads the node's dtypes, attributes and static dims from the IR and
asks `tkopt.kernels` for the program (compile-time keys only; batch and sequence stay symbolic).
A node no kernel can serve raises `Unservable` with the reason; the caller leaves it unfused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tkopt.ir import Node, Value


class Unservable(ValueError):
    """No kernel variant serves this node (dtype, static dims, mask type...); the message says why."""


@dataclass
class ProgramSpec:
    """A kernel program for a node plus the binding of its buffers (see native.NodeBinding)."""

    key: tuple  # compile-time keys, to share one kernel between identical nodes
    build: Callable[[], Any]  # -> prim_func
    buffers: dict[str, tuple[str, int | str]]
    out_shapes: dict[int, str]


def _static(v: Value, axis: int, what: str) -> int:
    if v.shape is None or not v.shape:
        raise Unservable(f"{what} ({v.name}) has unknown rank")
    d = v.shape[axis]
    if not isinstance(d, int):
        raise Unservable(f"{what} ({v.name}) axis {axis} must be static for the kernel, got {d!r}")
    return d


def _dtype(node: Node) -> str:
    dt = node.inputs[0].dtype if node.inputs[0] is not None else None
    if dt is None:
        raise Unservable(f"{node.name}: input dtype unknown")
    return dt


def _check_dtypes(node: Node, dtype: str, arch: str, indices: tuple[int, ...]) -> None:
    allowed = ("float32", "float64") if arch == "cpu" else ("float16", "bfloat16", "float32")
    if dtype not in allowed:
        raise Unservable(f"{node.name}: dtype {dtype} has no {arch} kernel (supported: {', '.join(allowed)})")
    for i in indices:
        v = node.inputs[i]
        if v is not None and v.dtype != dtype:
            raise Unservable(f"{node.name}: input {i} ({v.name}) is {v.dtype}, expected {dtype} like input 0")


def _check_same_shape(node: Node, x: Value, r: Value) -> None:
    """The kernel adds the residual row by row: refuse a residual that broadcasts against X.

    The add_norm pass fuses a residual only when its shape is provably X's (passes/shapes.py), so this
    rechecks what the node's declared shapes show: a static dim against another static or a dynamic one.
    """
    if x.shape is None or r.shape is None or len(x.shape) != len(r.shape):
        raise Unservable(f"{node.name}: residual {r.name} rank differs from X's (a broadcasting add)")
    for i, (a, b) in enumerate(zip(x.shape, r.shape, strict=True)):
        if (isinstance(a, int) or isinstance(b, int)) and a != b:
            raise Unservable(f"{node.name}: residual {r.name} axis {i} is {b!r} against X's {a!r} (a broadcasting "
                             "add; the kernel adds equal shapes)")


def _last_dim_expr(src: int, n: int) -> str:
    return f"[&]{{ auto s = s{src}; s.back() = {n}; return s; }}()"


def _gemm(node: Node, arch: str) -> ProgramSpec:
    from tkopt.kernels.config import default_config
    from tkopt.kernels.gemm_epilogue import gemm_program

    gated = node.op == "FusedGatedMLP"
    dtype = _dtype(node)
    _check_dtypes(node, dtype, arch, tuple(range(len(node.inputs))))
    a, b = node.inputs[0], node.inputs[1]
    trans_b = bool(node.attrs["trans_b"])
    if b.rank != 2:
        raise Unservable(f"{node.name}: weight {b.name} must be 2-D")
    k = _static(a, -1, "A")
    n = _static(b, 0 if trans_b else 1, "B")
    if _static(b, 1 if trans_b else 0, "B") != k:
        raise Unservable(f"{node.name}: weight {b.name} does not match K={k}")
    act = node.attrs["activation"]
    act = None if act == "none" else act
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
        lambda: gemm_program(arch, n, k, dtype, config, b_transposed=trans_b, has_bias=has_bias, act=act,
                             has_residual=has_res, gated=gated),
        buffers,
        {0: _last_dim_expr(0, n)},
    )


def _attention(node: Node, arch: str) -> ProgramSpec:
    from tkopt.kernels import attention

    dtype = _dtype(node)
    _check_dtypes(node, dtype, arch, (1, 2))
    q, k, v, mask = node.inputs
    layout = node.attrs["layout"]
    h_axis = 1 if layout == "bhsd" else 2
    dim = _static(q, -1, "Q")
    if _static(v, -1, "V") != dim:
        raise Unservable(f"{node.name}: V head dim differs from Q's")
    hq, hkv = _static(q, h_axis, "Q heads"), _static(k, h_axis, "K heads")
    mask_kind, bcast = None, (False,) * 4
    buffers: dict[str, tuple[str, int | str]] = {"Q": ("in", 0), "K": ("in", 1), "V": ("in", 2)}
    if mask is not None:
        if mask.dtype == "bool":
            mask_kind = "bool"
        elif mask.dtype == ("float64" if arch == "cpu" and dtype == "float64" else "float32"):
            mask_kind = "add"
        else:
            raise Unservable(f"{node.name}: mask dtype {mask.dtype} (kernel masks are bool, float32, or float64 "
                             "with float64 inputs on cpu)")
        if mask.shape is None or len(mask.shape) > 4:
            raise Unservable(f"{node.name}: mask {mask.name} rank must be known and <= 4")
        padded = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
        bcast = tuple(d == 1 for d in padded)
        buffers["Mask"] = ("in", 3)
    buffers["Output"] = ("out", 0)
    scale = float(node.attrs["scale"])
    # The program's compile-time keys, in gpu_program / cpu_program order: the node's semantics exactly.
    args = (dtype, dim, hq, hkv, bool(node.attrs["causal"]), (layout,) * 4, mask_kind, bcast,
            None if scale <= 0 else scale, float(node.attrs["mask_scale"]), float(node.attrs["mask_fill"]),
            node.attrs["guard"], bool(node.attrs["mask_keeps"]))
    if arch == "cpu":
        if dtype not in ("float32", "float64"):
            raise Unservable(f"{node.name}: cpu attention is float32/float64")
        key = ("attn", arch, *args)
        build = lambda: attention.cpu_program(*args)  # noqa: E731
    else:
        if dim not in attention.GPU_HEAD_DIMS:
            raise Unservable(f"{node.name}: head dim {dim} (GPU kernels: {attention.GPU_HEAD_DIMS})")
        cfg = attention.FP32_CONFIG if dtype == "float32" else attention.DEFAULT_CONFIGS[(arch, dim)]
        key = ("attn", arch, *args, tuple(cfg.items()))
        build = lambda: attention.gpu_program(*args, **cfg)  # noqa: E731
    return ProgramSpec(key, build, buffers, {0: "s0"})


def _add_norm(node: Node, arch: str) -> ProgramSpec:
    from tkopt.kernels import norm

    dtype = _dtype(node)
    _check_dtypes(node, dtype, arch, (1,))
    x, residual, weight, bias = node.inputs
    n = _static(x, -1, "X")
    if residual is not None:
        _check_same_shape(node, x, residual)
    w_dtypes = {v.dtype for v in (weight, bias) if v is not None}
    if len(w_dtypes) > 1:
        raise Unservable(f"{node.name}: weight and bias dtypes differ ({sorted(w_dtypes)})")
    w_dtype = w_dtypes.pop() if w_dtypes else dtype
    kind, eps = node.attrs["kind"], float(node.attrs["epsilon"])
    write_sum = len(node.outputs) > 1
    flags = dict(has_residual=residual is not None, has_weight=weight is not None, has_bias=bias is not None,
                 write_sum=write_sum, eps=eps)
    buffers: dict[str, tuple[str, int | str]] = {
        "X": ("in", 0),
        "R": ("in", 1) if residual is not None else ("alias", "X"),
        "W": ("in", 2) if weight is not None else ("alias", "X"),
        "B": ("in", 3) if bias is not None else ("alias", "X"),
        "Y": ("out", 0),
        "S": ("out", 1) if write_sum else ("alias", "Y"),
    }
    out_shapes = {0: "s0", 1: "s0"}
    if arch == "cpu":
        key = ("norm", arch, kind, n, dtype, w_dtype, tuple(sorted(flags.items())))
        return ProgramSpec(key, lambda: norm.norm_program_cpu(kind, n, dtype, w_dtype, **flags), buffers, out_shapes)
    cfg = norm.default_norm_config(n, 4 if dtype == "float32" else 2, arch)
    key = ("norm", arch, kind, n, dtype, w_dtype, tuple(sorted(flags.items())), tuple(cfg.items()))
    return ProgramSpec(key, lambda: norm.norm_program_gpu(kind, n, dtype, w_dtype, **flags, **cfg), buffers,
                       out_shapes)


_SPECS: dict[str, Callable[[Node, str], ProgramSpec]] = {
    "FusedGemm": _gemm,
    "FusedGatedMLP": _gemm,
    "FusedAttention": _attention,
    "FusedAddNorm": _add_norm,
}


def program_spec(node: Node, arch: str) -> ProgramSpec:
    """The kernel program and binding for a fused node on `arch`; Unservable if there is none."""
    try:
        fn = _SPECS[node.op]
    except KeyError:
        raise Unservable(f"{node.name}: no kernel for fused op {node.op}") from None
    return fn(node, arch)
