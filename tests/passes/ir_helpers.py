"""Test helpers for the graph passes: build IR graphs by hand and execute them.

`Builder` evaluates every op as it is added (on sample inputs), so each Value gets its real shape
and dtype without a shape-inference engine; `run_graph` executes a graph, original or fused, with
torch (canonical ops here, fused ops through their reference), which is how tests check that a
rewrite computes the same thing.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F

from tkopt.fused_ops import run_reference
from tkopt.ir import FUSED_DOMAIN, Graph, Node, Value
from tkopt.passes.base import PassResult

T = torch.Tensor
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


def _axes(n: Node, ins: Sequence[T | None], slot: int = 1) -> list[int] | None:
    axes = n.attr("axes")
    if axes is None and len(ins) > slot and ins[slot] is not None:
        axes = ins[slot].tolist()
    return None if axes is None else [int(a) for a in np.atleast_1d(axes)]


def _norm(n: Node, i: Sequence[T | None], rms: bool) -> T:
    x = i[0]
    axis = n.attr("axis", -1) % x.dim()
    dims = list(range(axis, x.dim()))
    xf = x.float()
    if not rms:
        xf = xf - xf.mean(dims, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + n.attr("epsilon", 1e-5))
    y = y.to(x.dtype)
    if len(i) > 1 and i[1] is not None:
        y = y * i[1]
    if len(i) > 2 and i[2] is not None:
        y = y + i[2]
    return y.to(x.dtype)  # the canonical norms give X's dtype, whatever the parameters' dtype


def _gemm(n: Node, i: Sequence[T | None]) -> T:
    a = i[0].T if n.attr("transA", 0) else i[0]
    b = i[1].T if n.attr("transB", 0) else i[1]
    y = n.attr("alpha", 1.0) * (a @ b)
    return y + n.attr("beta", 1.0) * i[2] if len(i) > 2 and i[2] is not None else y


def _slice(n: Node, i: Sequence[T | None]) -> T:
    x = i[0]
    index = [slice(None)] * x.dim()
    axes = n.attr("axes") or list(range(len(n.attr("starts"))))
    steps = n.attr("steps") or [1] * len(axes)
    for a, s, e, st in zip(axes, n.attr("starts"), n.attr("ends"), steps, strict=True):
        index[a] = slice(s, min(e, x.shape[a]), st)
    return x[tuple(index)]


OPS: dict[str, Callable[[Node, Sequence[T | None]], T]] = {
    "MatMul": lambda n, i: i[0] @ i[1],
    "Gemm": _gemm,
    "Linear": lambda n, i: F.linear(i[0], i[1], i[2] if len(i) > 2 else None),
    "Add": lambda n, i: i[0] + i[1],
    "Sub": lambda n, i: i[0] - i[1],
    "Mul": lambda n, i: i[0] * i[1],
    "Div": lambda n, i: i[0] / i[1],
    "Pow": lambda n, i: torch.pow(i[0], i[1]),
    "Sqrt": lambda n, i: torch.sqrt(i[0]),
    "Rsqrt": lambda n, i: torch.rsqrt(i[0]),
    "Reciprocal": lambda n, i: torch.reciprocal(i[0]),
    "Erf": lambda n, i: torch.erf(i[0]),
    "Tanh": lambda n, i: torch.tanh(i[0]),
    "Sigmoid": lambda n, i: torch.sigmoid(i[0]),
    "Relu": lambda n, i: torch.relu(i[0]),
    "Neg": lambda n, i: -i[0],
    "Gelu": lambda n, i: F.gelu(i[0], approximate=n.attr("approximate", "none")),
    "Silu": lambda n, i: F.silu(i[0]),
    "Cast": lambda n, i: i[0].to(DTYPES[n.attr("to")]),
    "Identity": lambda n, i: i[0],
    "Constant": lambda n, i: torch.as_tensor(n.attr("value")),
    "ReduceMean": lambda n, i: i[0].mean(_axes(n, i), keepdim=bool(n.attr("keepdims", 1))),
    "LayerNormalization": lambda n, i: _norm(n, i, rms=False),
    "RMSNormalization": lambda n, i: _norm(n, i, rms=True),
    "Transpose": lambda n, i: i[0].permute(*n.attr("perm")),
    "Reshape": lambda n, i: i[0].reshape(
        [d if d != 0 else i[0].shape[k] for k, d in enumerate(n.attr("shape") or i[1].tolist())]),
    "Shape": lambda n, i: torch.tensor(i[0].shape, dtype=torch.int64),
    "Gather": lambda n, i: torch.index_select(i[0], n.attr("axis", 0), i[1].reshape(-1)).reshape(
        [*i[0].shape[: n.attr("axis", 0)], *i[1].shape, *i[0].shape[n.attr("axis", 0) + 1:]]),
    "Concat": lambda n, i: torch.cat(list(i), n.attr("axis", 0)),
    "Unsqueeze": lambda n, i: torch.as_tensor(np.expand_dims(i[0].numpy(), tuple(_axes(n, i)))),
    "Slice": _slice,
    "aten::chunk": lambda n, i: i[0].chunk(n.attr("chunks"), n.attr("dim", 0)),
}


def apply(graph: Graph, *passes: Callable[[Graph, PassResult], None]) -> PassResult:
    """Run pass functions directly (not via the pipeline), collecting one result for all of them."""
    result = PassResult("test")
    for fn in passes:
        fn(graph, result)
    return result


def reasons(result: PassResult) -> str:
    return " | ".join(r.reason for r in result.refusals)


def ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


def _execute(node: Node, ins: list[T | None]) -> list[T]:
    if node.domain == FUSED_DOMAIN:
        return run_reference(node.op, ins, node.attrs)
    out = OPS[node.op](node, ins)
    return list(out) if isinstance(out, tuple) else [out]


def run_graph(graph: Graph, feeds: dict[str, T]) -> list[T]:
    """Execute `graph` on `feeds` (by input name); returns the graph outputs."""
    env: dict[int, T] = {}
    for v in graph.inputs:
        env[id(v)] = feeds[v.name]
    for node in graph.nodes:
        ins = [None if v is None else env[id(v)] if id(v) in env else _const(v) for v in node.inputs]
        for v, t in zip(node.outputs, _execute(node, ins), strict=False):
            env[id(v)] = t
    return [env[id(v)] if id(v) in env else _const(v) for v in graph.outputs]


def _const(v: Value) -> T:
    if v.const is None:
        raise KeyError(f"value {v.name} has no producer and no constant data")
    t = torch.from_numpy(np.array(v.const, order="C"))
    return t.to(DTYPES[v.dtype]) if v.dtype in DTYPES else t


class Builder:
    """Builds a Graph op by op, running each op on sample data to give Values their shape/dtype."""

    def __init__(self, seed: int = 0) -> None:
        self.graph = Graph("test")
        self.samples: dict[str, T] = {}
        self._data: dict[int, T] = {}
        self._gen = torch.Generator().manual_seed(seed)

    def _value(self, name: str, t: T) -> Value:
        v = Value(self.graph.reserve(name), NAMES[t.dtype], tuple(t.shape))
        self._data[id(v)] = t
        return v

    def input(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Value:
        t = torch.randn(tuple(shape), generator=self._gen).to(dtype)
        v = self._value(name, t)
        self.graph.inputs.append(v)
        self.samples[name] = t
        return v

    def const(self, data: Any, name: str | None = None, dtype: torch.dtype = torch.float32) -> Value:
        t = torch.as_tensor(np.asarray(data)).to(dtype) if not isinstance(data, T) else data
        v = self._value(name or self.graph.fresh_name("c"), t)
        v.const = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        return v

    def param(self, *shape: int, name: str | None = None) -> Value:
        return self.const(torch.randn(*shape, generator=self._gen) * 0.5, name)

    def op(self, op: str, *inputs: Value | float | None, n_out: int = 1, **attrs: Any) -> Any:
        ins = [self.const(np.float32(v)) if isinstance(v, float | int) else v for v in inputs]
        node = Node(op, ins, [], attrs)
        data = [None if v is None else self._data[id(v)] for v in ins]
        outs = _execute(node, data)
        node.outputs = [self._value(self.graph.fresh_name(op.lower()), t) for t in outs[:n_out]]
        self.graph.add_node(node)
        return node.outputs[0] if n_out == 1 else node.outputs

    def output(self, *values: Value) -> Graph:
        self.graph.outputs.extend(values)
        return self.graph

    def run(self, graph: Graph | None = None) -> list[T]:
        return run_graph(graph or self.graph, self.samples)


@functools.cache
def exported(name: str, how: str) -> Any:
    """A reference model exported once per test session: "torchscript"/"dynamo" -> ONNX ModelProto,
    "fx" -> ExportedProgram, "fx_decomposed" -> ExportedProgram after run_decompositions()."""
    from tkopt.models.blocks import REFERENCE_MODELS
    from tkopt.models.export import export_fx, export_onnx

    model, inputs = REFERENCE_MODELS[name]()
    if how.startswith("fx"):
        ep = export_fx(model, inputs)
        return ep.run_decompositions() if how == "fx_decomposed" else ep
    with tempfile.TemporaryDirectory() as d:
        path = export_onnx(model, inputs, Path(d) / f"{name}.onnx", dynamo=how == "dynamo")
        return onnx.load(str(path))
