"""Run ONNX models, fused or not, without the native tkopt op library if need be.

ORT cannot run domain "tkopt" nodes until the native custom-op library is loaded. Without it a
fused model runs "hybrid": runs of standard nodes in ORT sessions, each tkopt node with
`tkopt.fused_ops.run_reference` (the one statement of their semantics). onnx's ReferenceEvaluator
with the same tkopt ops is the "reference" runner (all Python; slower, and its numpy ops are not
ORT's). `run_model` picks the runner; a native library plugs in through `custom_ops_library` (or
TKOPT_ORT_LIBRARY) and then fused models run in ORT itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tkopt.fused_ops import SCHEMAS, run_reference
from tkopt.fused_ops.onnx_schema import attribute_values
from tkopt.ir import FUSED_DOMAIN
from tkopt.ort.run import CPU_PROVIDERS, session


def to_torch(a: np.ndarray | None) -> torch.Tensor | None:
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))  # a writable copy (evaluator arrays may be read-only)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class _FusedOpRun(OpRun):
    """A tkopt op in the ReferenceEvaluator: attributes from the node, math from run_reference."""

    op_domain = FUSED_DOMAIN

    def _run(self, *inputs: Any, **_: Any) -> tuple[np.ndarray, ...]:
        attrs = attribute_values(self.onnx_node)
        outs = run_reference(self.onnx_node.op_type, [to_torch(x) for x in inputs], attrs)
        return tuple(to_numpy(o) for o in outs[: len(self.onnx_node.output)])


FUSED_OP_RUNS: list[type[OpRun]] = [type(name, (_FusedOpRun,), {}) for name in SCHEMAS]


def has_fused_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == FUSED_DOMAIN for n in model.graph.node)


def native_library() -> str | None:
    """Path of the native tkopt ORT op library, when one is configured (TKOPT_ORT_LIBRARY)."""
    path = os.environ.get("TKOPT_ORT_LIBRARY")
    return path if path and os.path.isfile(path) else None


def _segments(nodes: list[onnx.NodeProto]) -> list[list[onnx.NodeProto]]:
    """Consecutive standard nodes grouped; each tkopt node alone."""
    out: list[list[onnx.NodeProto]] = []
    for n in nodes:
        if n.domain == FUSED_DOMAIN or not out or out[-1][0].domain == FUSED_DOMAIN:
            out.append([n])
        else:
            out[-1].append(n)
    return out


def _reads(n: onnx.NodeProto) -> set[str]:
    from tkopt.frontends.onnx import outer_reads

    reads = {i for i in n.input if i}
    for a in n.attribute:
        for g in [a.g] if a.HasField("g") else a.graphs:
            reads |= outer_reads(g)
    return reads


def run_hybrid(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Standard ops in ORT (one session per run of consecutive standard nodes), tkopt ops in torch.

    Only the fused nodes run outside ORT, so a comparison with the unfused model in ORT measures
    the fusions and nothing else (ReferenceEvaluator's own numpy ops differ, and some mis-handle
    shapes real exports use).
    """
    from tkopt.fused_ops.onnx_schema import register_schemas

    register_schemas()
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    types.update({vi.name: vi.type.tensor_type.elem_type for vi in model.graph.output})
    inits = {t.name: t for t in model.graph.initializer}
    env: dict[str, Any] = dict(inputs)
    segments = _segments(list(model.graph.node))
    needed_later: list[set[str]] = []
    later = {o.name for o in model.graph.output}
    for seg in reversed(segments):
        needed_later.append(set(later))
        for n in seg:
            later |= _reads(n)
    needed_later.reverse()
    for seg, needed in zip(segments, needed_later, strict=True):
        if seg[0].domain == FUSED_DOMAIN:
            (n,) = seg
            attrs = attribute_values(n)
            ins = [None if not i else to_torch(env[i] if i in env else onnx.numpy_helper.to_array(inits[i]))
                   for i in n.input]
            outs = run_reference(n.op_type, ins, attrs)
            env.update({name: to_numpy(t) for name, t in zip(n.output, outs, strict=False)})
            continue
        produced = {o for n in seg for o in n.output if o}
        reads = set().union(*(_reads(n) for n in seg)) - produced
        outs = [o for n in seg for o in n.output if o and o in needed]
        if not outs:
            continue
        feeds = {r: np.asarray(env[r]) for r in reads if r in env}
        g = helper.make_graph(
            seg, "segment",
            [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
             for k, v in feeds.items()],
            [helper.make_tensor_value_info(o, types.get(o, onnx.TensorProto.UNDEFINED), None) for o in outs],
            [inits[r] for r in reads if r in inits and r not in env],
        )
        sub = helper.make_model(g, opset_imports=list(model.opset_import), functions=list(model.functions))
        sub.ir_version = model.ir_version
        env.update(zip(outs, session(sub).run(outs, feeds), strict=True))
    return {o.name: np.asarray(env[o.name] if o.name in env else onnx.numpy_helper.to_array(inits[o.name]))
            for o in model.graph.output}


def run_model(
    model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    provider: str = "auto",
    custom_ops_library: str | None = None,
    ort_providers: Sequence[str] = CPU_PROVIDERS,
) -> dict[str, np.ndarray]:
    """Outputs by name. provider: "ort" (fused nodes need the native library), "hybrid" (standard
    ops in ORT, tkopt ops in torch), "reference" (onnx's ReferenceEvaluator with tkopt ops in
    torch), or "auto": "ort" unless the model has tkopt nodes and no native library, else "hybrid".
    `ort_providers`: ORT's execution providers for "ort" (a GPU target's library needs CUDA's)."""
    lib = custom_ops_library or native_library()
    if provider == "auto":
        provider = "hybrid" if has_fused_nodes(model) and lib is None else "ort"
    names = [o.name for o in model.graph.output]
    if provider == "ort":
        outs = session(model, lib if has_fused_nodes(model) else None, ort_providers).run(names, dict(inputs))
    elif provider == "hybrid":
        return run_hybrid(model, inputs)
    elif provider == "reference":
        outs = ReferenceEvaluator(model, new_ops=FUSED_OP_RUNS).run(names, dict(inputs))
    else:
        raise ValueError(f"unknown provider {provider!r}; expected 'auto', 'ort', 'hybrid' or 'reference'")
    return dict(zip(names, outs, strict=True))
