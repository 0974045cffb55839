"""FusedAddNorm: Y = Norm(X + residual) over the last axis; Sum = X + residual (emitted when used later).

kind "layer" (LayerNorm: weight and bias optional) or "rms" (RMSNorm: weight optional, no bias).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tkopt.ir import Node, Value
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
    meta_tensors,
    static_dim,
)

if TYPE_CHECKING:
    import onnx


def _kind(attrs: dict[str, Any]) -> str:
    if attrs["kind"] not in ("layer", "rms"):
        raise ValueError(f"FusedAddNorm kind must be 'layer' or 'rms', got {attrs['kind']!r}")
    return attrs["kind"]


def reference(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt.kernels import reference as ref

    x, residual, weight, bias = ins
    if _kind(attrs) == "layer":
        return list(ref.add_layer_norm_ref(x, residual, weight, bias, attrs["epsilon"]))
    if bias is not None:
        raise ValueError("FusedAddNorm kind='rms' takes no bias")
    return list(ref.add_rms_norm_ref(x, residual, weight, attrs["epsilon"]))


def kernel(ins: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    from tkopt import kernels

    x, residual, weight, bias = ins
    if _kind(attrs) == "layer":
        return list(kernels.add_layer_norm(x, residual, weight, bias, attrs["epsilon"]))
    return list(kernels.add_rms_norm(x, residual, weight, attrs["epsilon"]))


def compiles(specs: Sequence[InputSpec], attrs: dict[str, Any], build: Build) -> list[Compile]:
    from tkopt.kernels.norm import planned_kernels

    x, residual, weight, bias = meta_tensors(specs)
    kind = _kind(attrs)
    return planned_kernels(kind, x, residual, weight, bias if kind == "layer" else None, attrs["epsilon"], True, build)


def output_shapes(shapes: Sequence[Shape | None], attrs: dict[str, Any], broadcast: Broadcast) -> list[Shape | None]:
    """Both outputs have the shape of X + residual."""
    x, residual = shapes[0], shapes[1]
    s = x if residual is None or x is None else broadcast(x, residual)
    return [s, s]


def _check_same_shape(node: Node, x: Value, r: Value) -> None:
    """The kernel adds the residual row by row: refuse a residual that broadcasts against X.

    The add_norm pass fuses a residual only when its shape is provably X's (tkopt/passes/shapes.py), so this
    rechecks what the node's declared shapes show: a static dim against another static or a dynamic one.
    """
    if x.shape is None or r.shape is None or len(x.shape) != len(r.shape):
        raise Unservable(f"{node.name}: residual {r.name} rank differs from X's (a broadcasting add)")
    for i, (a, b) in enumerate(zip(x.shape, r.shape, strict=True)):
        if (isinstance(a, int) or isinstance(b, int)) and a != b:
            raise Unservable(f"{node.name}: residual {r.name} axis {i} is {b!r} against X's {a!r} (a broadcasting "
                             "add; the kernel adds equal shapes)")


def program(node: Node, arch: str) -> ProgramSpec:
    from tkopt.kernels import norm

    dtype = input_dtype(node)
    check_dtypes(node, dtype, arch, (1,))
    x, residual, weight, bias = node.inputs
    n = static_dim(x, -1, "X")
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


# ONNX Runtime's CPU norms: float32 and float16 tensors of rank 2 or 3, computed in float32.
ORT_DTYPES = ("float32", "float16")
ORT_RANKS = (2, 3)


def ort_ops(node: Node, arch: str) -> list[onnx.NodeProto]:
    """The node as ONNX Runtime's own CPU ops: with a residual, SkipSimplifiedLayerNormalization or
    SkipLayerNormalization (com.microsoft; their fourth output is X + residual, as Sum), without one
    SimplifiedLayerNormalization or LayerNormalization (the default domain, which ORT runs at every opset). They
    take a weight. They add and normalize in float32, as the kernels do; the RMS form sums squares as
    the subgraph does. Their LayerNorm takes the variance in one pass (E[s^2] - E[s]^2), as ORT's
    LayerNormalization does, which loses more than a two-pass variance where a row's mean dwarfs its spread:
    the layer kind is served only where the subgraph itself was a LayerNormalization, so ORT computed it so
    unfused as well."""
    from onnx import helper

    if arch != "cpu":
        raise Unservable(f"{node.name}: ORT's own norms are used on the CPU only")
    x, residual, weight, bias = node.inputs
    rms = _kind(node.attrs) == "rms"
    dtype = input_dtype(node)
    if dtype not in ORT_DTYPES or x.rank not in ORT_RANKS:
        raise Unservable(f"{node.name}: ORT's norms take {' or '.join(ORT_DTYPES)} tensors of rank 2 or 3, "
                         f"not {dtype} of rank {x.rank}")
    if any(v is not None and v.dtype != dtype for v in node.inputs):
        raise Unservable(f"{node.name}: ORT's norms take one dtype for every input")
    if not rms and not any(r.op == "LayerNormalization" and r.domain in ("", "ai.onnx") for r in node.replaced):
        raise Unservable(f"{node.name}: ORT's LayerNorm takes a one-pass variance; this LayerNorm was not ORT's")
    if weight is None:
        raise Unservable(f"{node.name}: ORT's norms take a weight; this norm has none")
    sum_out = node.outputs[1].name if len(node.outputs) > 1 else None
    if residual is None and sum_out is not None:
        raise Unservable(f"{node.name}: a Sum output without a residual")
    eps = float(node.attrs["epsilon"])
    beta = [bias.name] if bias is not None and not rms else []
    if residual is not None:
        op = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
        outs = [node.outputs[0].name, *(["", "", sum_out] if sum_out else [])]
        proto = helper.make_node(op, [x.name, residual.name, weight.name, *beta], outs, name=node.name,
                                 domain="com.microsoft", epsilon=eps)
    else:
        op = "SimplifiedLayerNormalization" if rms else "LayerNormalization"
        proto = helper.make_node(op, [x.name, weight.name, *beta], [node.outputs[0].name], name=node.name, axis=-1,
                                 epsilon=eps)
    return [proto]


OP = FusedOp(
    name="FusedAddNorm",
    torch_name="fused_add_norm",
    inputs=("X", "residual", "weight", "bias"),
    optional_inputs=frozenset({"residual", "weight", "bias"}),
    outputs=("Y", "Sum"),
    optional_outputs=frozenset({"Sum"}),
    attrs={"kind": "layer", "epsilon": 1e-5},
    reference=reference,
    kernel=kernel,
    output_shapes=output_shapes,
    program=program,
    compiles=compiles,
    ort_ops=ort_ops,
)
