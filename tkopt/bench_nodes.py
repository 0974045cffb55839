"""Per fused node: its error and its time against the original nodes it replaced, on real inputs.

ONNX: each fused node becomes a one-node model (its non-constant inputs as graph inputs, constants
as initializers) and its `replaced` nodes a model of their own, both written by the ONNX backend
from sub-Graphs of the optimized IR. Their inputs are the values the full original model computes:
a copy of it, with those values added as outputs, runs once in ORT. The fused model runs with the
op library (the kernels look nodes up by name, and the one-node model keeps the name); without one
the fused node runs its torch reference and only errors are reported.

Torch: the original exported GraphModule runs once under torch.fx.Interpreter to capture every
value; each fused node's custom op (tkopt::fused_*) is called on its captured inputs, and its
replaced fx nodes are copied into a tiny GraphModule (their outer inputs as placeholders, weights
as get_attr) and run on the same captured values, so "unfused" is the exact original code.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tkopt.bench import NodeBench, Timing, _out_errors, _session, time_calls
from tkopt.ir import Graph, Node, Value

# ---- ONNX -----------------------------------------------------------------------------------------


def _outer_inputs(nodes: Sequence[Node]) -> list[Value]:
    """Non-constant values the nodes read but do not produce, in first-read order."""
    produced = {id(v) for n in nodes for v in n.outputs}
    seen: set[int] = set()
    out = []
    for n in nodes:
        for v in n.inputs:
            if v is not None and v.const is None and id(v) not in produced and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _model_of(graph: Graph, nodes: Sequence[Node], outputs: Sequence[Value], name: str) -> onnx.ModelProto:
    """An ONNX model of `nodes` alone: their outer non-constant inputs as graph inputs, constants as
    initializers, `outputs` as graph outputs (written by the ONNX backend from a sub-Graph)."""
    from tkopt.backends.onnx_model import export_onnx

    sub = Graph(name)
    sub.nodes = list(nodes)
    sub.inputs = _outer_inputs(nodes)
    sub.outputs = list(outputs)
    sub.meta = {k: graph.meta[k] for k in ("onnx_model", "onnx_initializers", "onnx_import_consts")
                if k in graph.meta}
    return export_onnx(sub)


def capture_onnx(original: onnx.ModelProto, values: Sequence[Value], feeds: Mapping[str, np.ndarray],
                 providers: list[str], tmp: Path) -> dict[str, np.ndarray]:
    """The named values as the original model computes them on `feeds` (one ORT run of a copy with
    those values as extra outputs). Names the original does not compute are absent from the result."""
    from tkopt.frontends.onnx import ELEM_TYPES

    produced = {o for n in original.graph.node for o in n.output if o}
    have = {o.name for o in original.graph.output}
    wanted = {v.name: v for v in values if v.name in produced and v.name not in feeds}
    m = onnx.ModelProto()
    m.CopyFrom(original)
    for name, v in wanted.items():
        if name not in have:
            m.graph.output.append(onnx.helper.make_tensor_value_info(
                name, ELEM_TYPES.get(v.dtype or "", onnx.TensorProto.UNDEFINED), None))
    names = list(wanted)
    got = dict(zip(names, _session(m, providers, None, tmp).run(names, dict(feeds)), strict=True)) if names else {}
    return {**feeds, **got}


def onnx_node_rows(graph: Graph, original: onnx.ModelProto, feeds: Mapping[str, np.ndarray], providers: list[str],
                   library: Path | None, runs: int, warmup: int, tmp: Path) -> list[NodeBench]:
    """A NodeBench per fused node of `graph` (see the module docstring for how each side runs)."""
    fused = [n for n in graph.nodes if n.is_fused]
    if not fused:
        return []
    needed = [v for n in fused for v in (*_outer_inputs([n]), *_outer_inputs(n.replaced))]
    values = capture_onnx(original, needed, feeds, providers, tmp)
    rows = []
    for n in fused:
        row = NodeBench(n.name, n.op, len(n.replaced))
        rows.append(row)
        missing = sorted({v.name for v in (*_outer_inputs([n]), *_outer_inputs(n.replaced)) if v.name not in values})
        if missing:
            row.note = f"inputs {missing} are not values of the original model; not measured"
            continue
        unfused = _model_of(graph, n.replaced, n.outputs, f"{n.name}_unfused")
        ufeeds = {v.name: values[v.name] for v in _outer_inputs(n.replaced)}
        usess = _session(unfused, providers, None, tmp)
        out_names = [v.name for v in n.outputs]
        want = dict(zip(out_names, usess.run(out_names, ufeeds), strict=True))
        row.unfused = time_calls(lambda s=usess, o=out_names, f=ufeeds: s.run(o, f), runs, warmup)
        ffeeds = {v.name: values[v.name] for v in _outer_inputs([n])}
        if library is not None:
            fsess = _session(_model_of(graph, [n], n.outputs, n.name), providers, library, tmp)
            got = dict(zip(out_names, fsess.run(out_names, ffeeds), strict=True))
            row.fused = time_calls(lambda s=fsess, o=out_names, f=ffeeds: s.run(o, f), runs, warmup)
        else:
            got = _reference(n, values)
            row.note = "reference"
        row.outputs = _out_errors(out_names, got, want)
    return rows


def _reference(n: Node, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    from tkopt.fused_ops import run_reference
    from tkopt.onnx_runtime_ref import _to_numpy, _to_torch

    ins = [None if v is None else _to_torch(v.const if v.const is not None else values[v.name]) for v in n.inputs]
    outs = run_reference(n.op, ins, n.attrs)
    return {v.name: _to_numpy(t) for v, t in zip(n.outputs, outs, strict=False)}


# ---- torch ----------------------------------------------------------------------------------------


def torch_node_rows(graph: Graph, example_inputs: Sequence[Any], timer: Callable[[Callable[[], Any]], Timing]
                    ) -> list[NodeBench]:
    """A NodeBench per fused node of `graph` (imported by import_fx, after passes and kernel probes).

    On CUDA both sides are timed as CUDA-graph replays: kernel time, not Python dispatch."""
    import torch
    from torch import fx

    from tkopt.backends.torch_ops import CUSTOM_OPS
    from tkopt.bench_torch import replayed, tensor_errors
    from tkopt.fused_ops import schema
    from tkopt.kernel_dispatch import first_device

    fused = [n for n in graph.nodes if n.is_fused]
    if not fused:
        return []
    gm: fx.GraphModule = graph.meta["fx_module"]
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*example_inputs)
    env = interp.env
    rows = []
    for n in fused:
        row = NodeBench(n.name, n.op, len(n.replaced))
        rows.append(row)
        ins, missing = [], []
        for v in n.inputs:
            if v is None:
                ins.append(None)
            elif isinstance(v.origin, fx.Node) and v.origin in env:
                ins.append(env[v.origin])
            elif v.const is not None:
                ins.append(_const_tensor(v, example_inputs))
            else:
                missing.append(v.name)
        tiny, tiny_args = _replaced_module(gm, n, env)
        if missing or tiny is None:
            row.note = f"inputs {missing or 'of the replaced nodes'} not captured; not measured"
            continue
        op, attr_names = CUSTOM_OPS[n.op]
        defaults = schema(n.op).attrs
        attrs = [type(defaults[k])(n.attrs[k]) for k in attr_names]
        with torch.no_grad():
            got = _as_list(op(*ins, *attrs))[: len(n.outputs)]
            want = _as_list(tiny(*tiny_args))
            device = first_device(ins)
            row.fused = timer(replayed(lambda op=op, ins=ins, attrs=attrs: op(*ins, *attrs), device))
            row.unfused = timer(replayed(lambda tiny=tiny, a=tiny_args: tiny(*a), device))
        row.outputs = [tensor_errors(v.name, g, w) for v, g, w in zip(n.outputs, got, want, strict=True)]
    return rows


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, tuple | list) else [x]


def _const_tensor(v: Value, example_inputs: Sequence[Any]) -> Any:
    import torch

    from tkopt.kernel_dispatch import DTYPES, first_device

    t = torch.from_numpy(np.array(v.const))
    return t.to(device=first_device(example_inputs), dtype=DTYPES.get(v.dtype or "", t.dtype))


def _replaced_module(gm: Any, n: Node, env: Mapping[Any, Any]) -> tuple[Any, list[Any]]:
    """The fx nodes `n` replaced, copied into a GraphModule returning `n`'s outputs; and its arguments
    (the captured values of the outer nodes they read). (None, []) if a node has no fx origin."""
    from torch import fx

    g = fx.Graph()
    new: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    args: list[Any] = []

    def arg(a: fx.Node) -> fx.Node:
        if a not in new:
            if a.op == "get_attr":
                root[a.target] = operator.attrgetter(a.target)(gm)
                new[a] = g.get_attr(a.target)
            else:
                new[a] = g.placeholder(a.name)
                args.append(env[a])
        return new[a]

    for r in n.replaced:
        if not isinstance(r.origin, fx.Node):
            return None, []
        new[r.origin] = g.node_copy(r.origin, arg)
        for v in r.outputs:  # multi-output nodes: each output is an operator.getitem of the original
            if isinstance(v.origin, fx.Node) and v.origin is not r.origin:
                new[v.origin] = g.node_copy(v.origin, arg)
    outs = [new.get(v.origin) if isinstance(v.origin, fx.Node) else None for v in n.outputs]
    if any(o is None for o in outs):
        return None, []
    g.output(tuple(outs))
    return fx.GraphModule(root, g), args
