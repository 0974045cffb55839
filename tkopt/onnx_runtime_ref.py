"""Run ONNX models, fused or not: onnxruntime for standard ops, onnx's ReferenceEvaluator for tkopt ops.

ORT cannot run domain "tkopt" nodes until the native custom-op library exists; until then a fused
model runs in onnx.reference.ReferenceEvaluator, whose tkopt ops call
`tkopt.fused_ops.run_reference` (the one statement of their semantics). `run_model` picks the
runner; a native library plugs in through `custom_ops_library` (or TKOPT_ORT_LIBRARY) and then
fused models run in ORT too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tkopt.fused_ops import SCHEMAS, run_reference
from tkopt.ir import FUSED_DOMAIN


def _to_torch(a: np.ndarray | None) -> torch.Tensor | None:
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))  # a writable copy (evaluator arrays may be read-only)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class _FusedOpRun(OpRun):
    """A tkopt op in the ReferenceEvaluator: attributes from the node, math from run_reference."""

    op_domain = FUSED_DOMAIN

    def _run(self, *inputs: Any, **_: Any) -> tuple[np.ndarray, ...]:
        attrs = {a.name: helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        outs = run_reference(self.onnx_node.op_type, [_to_torch(x) for x in inputs], attrs)
        return tuple(_to_numpy(o) for o in outs[: len(self.onnx_node.output)])


FUSED_OP_RUNS: list[type[OpRun]] = [type(name, (_FusedOpRun,), {}) for name in SCHEMAS]


def has_fused_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == FUSED_DOMAIN for n in model.graph.node)


def native_library() -> str | None:
    """Path of the native tkopt ORT op library, when one is configured (TKOPT_ORT_LIBRARY)."""
    path = os.environ.get("TKOPT_ORT_LIBRARY")
    return path if path and os.path.isfile(path) else None


def ort_session(model: onnx.ModelProto, custom_ops_library: str | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if custom_ops_library:
        so.register_custom_ops_library(custom_ops_library)
    if model.ByteSize() < 2**31:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    from tkopt.backends.onnx_model import save  # > 2 GB: ORT reads it from disk, with external data

    with tempfile.TemporaryDirectory() as d:
        path = save(model, os.path.join(d, "model.onnx"), external_data=True)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run_model(
    model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    provider: str = "auto",
    custom_ops_library: str | None = None,
) -> dict[str, np.ndarray]:
    """Outputs by name. provider: "ort", "reference", or "auto" (ORT unless the model has tkopt
    nodes and no native library is available; then the reference evaluator)."""
    lib = custom_ops_library or native_library()
    if provider == "auto":
        provider = "reference" if has_fused_nodes(model) and lib is None else "ort"
    names = [o.name for o in model.graph.output]
    if provider == "ort":
        outs = ort_session(model, lib if has_fused_nodes(model) else None).run(names, dict(inputs))
    elif provider == "reference":
        outs = ReferenceEvaluator(model, new_ops=FUSED_OP_RUNS).run(names, dict(inputs))
    else:
        raise ValueError(f"unknown provider {provider!r}; expected 'auto', 'ort' or 'reference'")
    return dict(zip(names, outs, strict=True))
