"""FusedAttention: O = softmax(T) V, T = Q K^T * scale with the mask applied [causal].

Layout "bhsd" or "bshd" for Q, K, V and O; K/V may have fewer heads (GQA). scale <= 0 means
1/sqrt(head_dim). The mask broadcasts over (b, h, q, k): a float mask is added and the sum scaled by mask_scale
(a graph's (S * a + M) * c: scale a, mask_scale c, in eager's order), a bool mask keeps where it equals
mask_keeps and sets T to mask_fill elsewhere (finite fills stay finite). causal drops keys after the query
(top-left). guard: what a row gives whose every T is -inf ("none": NaN, as softmax; "masked": 0, as SDPA) or
holds a NaN ("nan": 0, as the dynamo exporter's Where(IsNaN(p), 0, p)); "sdpa" (torch's SDPA without a mask) is
"masked", and where torch's CPU flash kernel would run, a row whose every T is NaN or -inf gives what that
kernel gives (0 or NaN: `kernels.reference.sdpa_eager`). kept: the key-only mask's summary per batch row that
the GPU kernel reads (`kernels.attention.kept_rows`, a function of the mask), which the torch backend derives once
per graph for all the nodes that share a mask; the reference ignores it, the kernel computes it where it is absent.
Exact definition: kernels.reference.flash_attention_ref; docs/LEGALITY.md says which graphs map onto it and
for which inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tkopt.ir import Node
from tkopt.kernels.arch import Build
from tkopt.kernels.workers import Compile

from .base import (
    Broadcast,
    Derivation,
    FusedOp,
    InputSpec,
    ProgramSpec,
    Shape,
    Tensor,
    Unservable,
    check_dtypes,
    input_dtype,
    meta_tensors,
    static_dim,
)


def _scale(attrs: dict[str, Any]) -> float | None:
    scale = float(attrs["scale"])
    return None if scale <= 0 else scale


def _semantics(attrs: dict[str, Any], kernel: bool = False) -> dict[str, Any]:
    """The attributes as the reference's and the kernel's keyword arguments (one spelling for both). The kernels
    run "sdpa" as "masked": `kernel` then takes torch's CPU flash answer for the rows it decides itself."""
    guard = "masked" if kernel and attrs["guard"] == "sdpa" else attrs["guard"]
    return dict(causal=bool(attrs["causal"]), scale=_scale(attrs), layout=attrs["layout"],
                mask_scale=float(attrs["mask_scale"]), mask_fill=float(attrs["mask_fill"]), guard=guard,
                mask_keeps=bool(attrs["mask_keeps"]))


def reference(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt.kernels import reference as ref

    q, k, v, mask, _ = ins
    return [ref.flash_attention_ref(q, k, v, mask=mask, **_semantics(attrs))]


def _check_precision(q: Tensor, on_gpu: bool) -> None:
    """Eager's fp32 attention is full fp32 at torch's default precision; the GPU kernel's products are TF32."""
    import torch

    from tkopt import kernels

    if on_gpu and q.dtype == torch.float32 and kernels.matmul_precision() != "tf32":
        raise Unservable("float32 attention on the GPU computes Q K^T and P V in TF32, which torch's matmul "
                         "precision 'highest' does not allow (torch.set_float32_matmul_precision('high') does)")


def kernel(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    import torch

    from tkopt import kernels
    from tkopt.kernels import reference as ref

    q, k, v, mask, kept = ins
    if q is not None:
        _check_precision(q, q.is_cuda)
    out = kernels.flash_attention(q, k, v, mask=mask, kept=kept, **_semantics(attrs, kernel=True))
    if attrs["guard"] == "sdpa" and mask is None and ref.sdpa_flash_on_cpu(q, k, v) and out.isnan().any():
        causal, scale, layout = bool(attrs["causal"]), _scale(attrs), attrs["layout"]
        dead = ref.sdpa_dead_rows(q, k, causal, scale, layout)
        out = torch.where(dead, ref.sdpa_eager(q, k, v, causal, scale, layout), out)
    return [out]


def _kept(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> Derivation | None:
    """The mask's `kept_rows`, for a key-only mask (the CPU kernel reads none, but once per graph costs nothing)."""
    import torch

    from tkopt.kernels import attention

    mask = ins[3]
    if mask is None or not attention.summarizes(mask.shape):
        return None
    return attention.kept_rows_ops, (3,), (bool(attrs["mask_keeps"]), mask.dim(), mask.dtype == torch.bool)


def compiles(specs: Sequence[InputSpec], attrs: dict[str, Any], build: Build) -> list[Compile]:
    from tkopt.kernels.attention import planned_kernels

    q, k, v, mask, _ = meta_tensors(specs)
    _check_precision(q, build.arch != "cpu")
    return planned_kernels(q, k, v, mask, build, **_semantics(attrs, kernel=True))


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
    q, k, v, mask, _ = node.inputs  # kept: the native kernels compute what they read
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
    if node.attrs["guard"] == "sdpa" and arch == "cpu":
        raise Unservable(f"{node.name}: torch SDPA's CPU result for NaN rows has no native CPU kernel")
    a = _semantics(node.attrs, kernel=True)
    # The program's compile-time keys, in gpu_program / cpu_program order: the node's semantics exactly.
    args = (dtype, dim, hq, hkv, a["causal"], (layout,) * 4, mask_kind, bcast, a["scale"], a["mask_scale"],
            a["mask_fill"], a["guard"], a["mask_keeps"])
    if arch == "cpu":
        key = ("attn", arch, *args)
        build = lambda: attention.cpu_program(*args)  # noqa: E731
    else:
        if not attention.gpu_head_dim(dim):
            raise Unservable(f"{node.name}: head dim {dim} (GPU kernels: {attention.GPU_HEAD_DIMS_TEXT})")
        cfg = attention.FP32_CONFIG if dtype == "float32" else attention.default_config(arch, dim)
        key = ("attn", arch, *args, tuple(cfg.items()))
        build = lambda: attention.gpu_program(*args, **cfg)  # noqa: E731
    return ProgramSpec(key, build, buffers, {0: "s0"}, attention.program_pass_configs(arch))


OP = FusedOp(
    name="FusedAttention",
    torch_name="fused_attention",
    inputs=("Q", "K", "V", "mask", "kept"),
    optional_inputs=frozenset({"mask", "kept"}),
    derived_inputs={"kept": _kept},
    outputs=("O",),
    attrs={"scale": 0.0, "causal": 0, "layout": "bhsd", "mask_scale": 1.0, "mask_fill": float("-inf"),
           "guard": "masked", "mask_keeps": 1},
    reference=reference,
    kernel=kernel,
    output_shapes=output_shapes,
    program=program,
    input_types={"mask": "M", "kept": "R"},
    compiles=compiles,
)
