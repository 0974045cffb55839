"""FusedAttention: O = softmax(Q K^T * scale + mask [causal]) V.

Layout "bhsd" or "bshd" for Q, K, V and O; K/V may have fewer heads (GQA). scale <= 0 means
1/sqrt(head_dim). The mask is additive (float) or a boolean keep-mask, broadcast over (b, h, q, k).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tkopt.ir import Node

from .base import Broadcast, FusedOp, ProgramSpec, Shape, Tensor, Unservable, check_dtypes, input_dtype, static_dim


def _scale(attrs: dict[str, Any]) -> float | None:
    scale = float(attrs["scale"])
    return None if scale <= 0 else scale


def reference(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt.kernels import reference as ref

    q, k, v, mask = ins
    return [ref.flash_attention_ref(q, k, v, causal=bool(attrs["causal"]), mask=mask, scale=_scale(attrs),
                                    layout=attrs["layout"])]


def kernel(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt import kernels

    q, k, v, mask = ins
    return [kernels.flash_attention(q, k, v, causal=bool(attrs["causal"]), mask=mask, scale=_scale(attrs),
                                    layout=attrs["layout"])]


def output_shapes(shapes: Sequence[Shape | None], attrs: dict[str, Any], broadcast: Broadcast) -> list[Shape | None]:
    """Q's shape with V's head dim."""
    q, v = shapes[0], shapes[2]
    if q is None or v is None or len(v) != len(q):
        return [None]
    return [[*q[:-1], v[-1]]]


def program(node: Node, arch: str) -> ProgramSpec:
    from tkopt.kernels import attention

    dtype = input_dtype(node)
    check_dtypes(node, dtype, arch, (1, 2))
    q, k, v, mask = node.inputs
    layout = node.attrs["layout"]
    h_axis = 1 if layout == "bhsd" else 2
    dim = static_dim(q, -1, "Q")
    if static_dim(v, -1, "V") != dim:
        raise Unservable(f"{node.name}: V head dim differs from Q's")
    hq, hkv = static_dim(q, h_axis, "Q heads"), static_dim(k, h_axis, "K heads")
    mask_kind, bcast = None, (False,) * 4
    buffers: dict[str, tuple[str, int | str]] = {"Q": ("in", 0), "K": ("in", 1), "V": ("in", 2)}
    if mask is not None:
        if mask.dtype == "bool":
            mask_kind = "bool"
        elif mask.dtype == "float32":
            mask_kind = "add"
        else:
            raise Unservable(f"{node.name}: mask dtype {mask.dtype} (kernel masks are bool or float32)")
        if mask.shape is None or len(mask.shape) > 4:
            raise Unservable(f"{node.name}: mask {mask.name} rank must be known and <= 4")
        padded = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
        bcast = tuple(d == 1 for d in padded)
        buffers["Mask"] = ("in", 3)
    buffers["Output"] = ("out", 0)
    scale = _scale(node.attrs)
    causal = bool(node.attrs["causal"])
    layouts = (layout,) * 4
    if arch == "cpu":
        key = ("attn", arch, dtype, dim, hq, hkv, causal, layouts, mask_kind, bcast, scale)
        build = lambda: attention.cpu_program(dtype, dim, hq, hkv, causal, layouts, mask_kind, bcast, scale)  # noqa: E731
    else:
        if dim not in attention.GPU_HEAD_DIMS:
            raise Unservable(f"{node.name}: head dim {dim} (GPU kernels: {attention.GPU_HEAD_DIMS})")
        cfg = attention.FP32_CONFIG if dtype == "float32" else attention.DEFAULT_CONFIGS[(arch, dim)]
        key = ("attn", arch, dtype, dim, hq, hkv, causal, layouts, mask_kind, bcast, scale, tuple(cfg.items()))
        build = lambda: attention.gpu_program(  # noqa: E731
            dtype, dim, hq, hkv, causal, layouts, mask_kind, bcast, scale, **cfg
        )
    return ProgramSpec(key, build, buffers, {0: "s0"})


OP = FusedOp(
    name="FusedAttention",
    torch_name="fused_attention",
    inputs=("Q", "K", "V", "mask"),
    optional_inputs=frozenset({"mask"}),
    outputs=("O",),
    attrs={"scale": 0.0, "causal": 0, "layout": "bhsd"},
    reference=reference,
    kernel=kernel,
    output_shapes=output_shapes,
    program=program,
    input_types={"mask": "M"},
)
