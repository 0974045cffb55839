"""What every fused op definition is made of: `FusedOp`, and the native-binding types its `program` returns.

One `FusedOp` per op (see the package docstring): the contract between the passes that create fused
nodes, the torch and ONNX backends that emit them, the native ORT op library and the kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tkopt.ir import Node, Value
from tkopt.kernels.arch import Build
from tkopt.kernels.workers import Compile

if TYPE_CHECKING:
    import onnx  # the torch backends never import it

Tensor = torch.Tensor
# The dtypes a fused op's tensors may have, by ONNX type constraint (IR dtype names): every tensor "T"
# (one float dtype per node), unless `input_types` names another constraint for an input.
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
TYPE_CONSTRAINTS = {
    "T": (FLOAT_DTYPES, "float tensors"),
    "M": ((*FLOAT_DTYPES, "bool"), "additive float mask or boolean keep-mask"),
    "R": (("uint8", "float32"), "summary per batch row of a mask"),
}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "bool": torch.bool, "int64": torch.int64, "int32": torch.int32,
                "uint8": torch.uint8}
Compute = Callable[[Sequence[Tensor | None], dict[str, Any]], list[Tensor]]
InputSpec = tuple[str, tuple[int, ...], tuple[int, ...]] | None  # an input's dtype name, shape, strides; None: absent
# (input specs, full attrs, what to build for) -> the kernel compiles calls on such inputs use
PlanCompiles = Callable[[Sequence[InputSpec], dict[str, Any], Build], list[Compile]]
Shape = Sequence[Any]  # dims of any kind: ints, torch SymInts, onnx TensorShapeProto.Dimension
Broadcast = Callable[[Shape, Shape], Shape | None]  # numpy broadcasting of two shapes; None if unknown
ShapeRule = Callable[[Sequence[Shape | None], dict[str, Any], Broadcast], list[Shape | None]]
# How an optional input follows from others: (a function of aten ops, the input positions it reads, its further
# arguments); the function of those inputs is the input's value. Aten ops alone, because the torch backend calls
# it on FX proxies: its program then holds no Python function, which AOTAutograd's cache would refuse.
Derivation = tuple[Callable[..., Tensor], tuple[int, ...], tuple[Any, ...]]
# (the node's inputs as tensors (example or fake values; None: absent or unknown), full attrs) -> its Derivation,
# None where the input is not worth giving
Derive = Callable[[Sequence[Tensor | None], dict[str, Any]], Derivation | None]
# (node, arch) -> ONNX Runtime's own ops computing the node (raises Unservable where they do not serve it)
OrtOps = Callable[[Node, str], list["onnx.NodeProto"]]


class Unservable(ValueError):
    """No kernel program serves this node (dtype, static dims, mask type...); the message says why."""


@dataclass
class ProgramSpec:
    """The TileLang program for one node on one arch, and how the node's tensors bind to its buffers.

    `buffers` maps each kernel buffer to ("in", i), ("out", j), or ("alias", other buffer) for a
    buffer the program's flags leave unread. `out_shapes[j]` is a C++ expression over s<i> (input i's
    shape) giving output j's shape. Identical `key`s share one compiled kernel in a library.
    `pass_configs`: what the program must be lowered with, as tkopt.kernels compiles it for torch (fast math,
    a pipeline that places its own syncs), so that the native library runs the same kernel.
    """

    key: tuple
    build: Callable[[], Any]  # -> prim_func
    buffers: dict[str, tuple[str, int | str]]
    out_shapes: dict[int, str]
    pass_configs: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class FusedOp:
    """One fused op: its signature, semantics, shape rule, kernel adapter and native binding.

    `reference(inputs, attrs)` is the op's meaning (torch, float32 math); `kernel(inputs, attrs)` runs
    it on tkopt.kernels for the tensors' device. Both take positional inputs (None for an absent
    optional one) and the full attribute dict, and return every output. `output_shapes(shapes, attrs,
    broadcast)` gives output shapes from input shapes (None: unknown) for any kind of dim, so the torch
    fake implementation and ONNX shape inference share it. `program(node, arch)` picks the TileLang
    program for an IR node (raising Unservable when none serves it). `compiles(specs, attrs, build)` lists
    the kernel compiles calls on inputs like `specs` will use, tuning candidates included, so that they can
    be built in parallel ahead of the calls (tkopt.targets.kernel_builds). `derived_inputs`: optional inputs
    that are functions of other inputs (a summary the kernel would otherwise compute per call), by name; the
    torch backend computes each once per graph for all the nodes whose Derivation is the same (same function,
    same input values, same arguments), in aten ops that the residual compile fuses. `ort_ops(node, arch)`:
    ONNX Runtime's own ops (its contrib ops) computing the node's outputs from its inputs, with the same
    arithmetic, where they serve it (raising Unservable where not); an ORT target runs them instead of the
    library's kernel (tkopt.targets.ort_target).
    """

    name: str
    torch_name: str  # the torch custom op: tkopt::<torch_name>
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any]  # name -> default; the default's type is the attribute's type
    reference: Compute
    kernel: Compute
    output_shapes: ShapeRule
    program: Callable[[Node, str], ProgramSpec]
    compiles: PlanCompiles
    optional_inputs: frozenset[str] = frozenset()
    optional_outputs: frozenset[str] = frozenset()
    input_types: Mapping[str, str] = field(default_factory=dict)  # ONNX type constraint by input, else "T"
    derived_inputs: Mapping[str, Derive] = field(default_factory=dict)
    ort_ops: OrtOps | None = None

    def full_attrs(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ValueError(f"{self.name}: unknown attributes {sorted(unknown)}")
        return {**self.attrs, **attrs}

    def dtype_problem(self, inputs: Sequence[Value | None], outputs: Sequence[Value | None]) -> str | None:
        """Why IR values of these dtypes cannot be this op's inputs and outputs (None: they can). Each type
        constraint binds one dtype per node, from its allowed ones (TYPE_CONSTRAINTS)."""
        named = [*zip(self.inputs, inputs, strict=True), *zip(self.outputs, outputs, strict=False)]
        bound: dict[str, set[str | None]] = {}
        for name, v in named:
            if v is not None:
                bound.setdefault(self.input_types.get(name, "T"), set()).add(v.dtype)
        for constraint, dtypes in bound.items():
            allowed, what = TYPE_CONSTRAINTS[constraint]
            if None in dtypes:
                return f"{self.name}: a tensor's dtype is unknown"
            if len(dtypes) != 1 or not dtypes <= set(allowed):
                got = sorted(dtypes)  # type: ignore[type-var]
                return f"{self.name} takes one dtype for its {what} ({', '.join(allowed)}), got {got}"
        return None

    def padded(self, inputs: Sequence[Any]) -> list[Any]:
        """`inputs` with absent trailing optional inputs as None (ONNX drops them)."""
        return list(inputs) + [None] * (len(self.inputs) - len(inputs))


def meta_tensors(specs: Sequence[InputSpec]) -> list[Tensor | None]:
    """Data-less tensors of `specs` (the meta device): what a `compiles` function reads shapes and strides of."""
    return [None if s is None else torch.empty_strided(s[1], s[2], dtype=TORCH_DTYPES[s[0]], device="meta")
            for s in specs]


# ---- helpers for `program` functions ------------------------------------------------------------
def static_dim(v: Value, axis: int, what: str) -> int:
    if v.shape is None or not v.shape:
        raise Unservable(f"{what} ({v.name}) has unknown rank")
    d = v.shape[axis]
    if not isinstance(d, int):
        raise Unservable(f"{what} ({v.name}) axis {axis} must be static for the kernel, got {d!r}")
    return d


def input_dtype(node: Node) -> str:
    dt = node.inputs[0].dtype if node.inputs[0] is not None else None
    if dt is None:
        raise Unservable(f"{node.name}: input dtype unknown")
    return dt


def check_dtypes(node: Node, dtype: str, arch: str, indices: Sequence[int]) -> None:
    """The kernels' dtypes per arch, and inputs `indices` sharing input 0's dtype."""
    allowed = ("float32", "float64") if arch == "cpu" else ("float16", "bfloat16", "float32")
    if dtype not in allowed:
        raise Unservable(f"{node.name}: dtype {dtype} has no {arch} kernel (supported: {', '.join(allowed)})")
    for i in indices:
        v = node.inputs[i]
        if v is not None and v.dtype != dtype:
            raise Unservable(f"{node.name}: input {i} ({v.name}) is {v.dtype}, expected {dtype} like input 0")


def last_dim_expr(src: int, n: int) -> str:
    """C++: input `src`'s shape with its last dim replaced by `n`."""
    return f"[&]{{ auto s = s{src}; s.back() = {n}; return s; }}()"

