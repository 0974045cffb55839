"""ONNX frontend: an ONNX model (file or ModelProto) -> tkopt's IR.

Works on what both torch exporters write (dynamo=True and the TorchScript one), opset 17 and
newer. ONNX's own shape inference types every value (symbolic dims stay strings). Each node keeps
its NodeProto as `origin` so the ONNX backend re-emits unfused nodes exactly; initializers and
Constant outputs carry their data in `Value.const`. Inputs that ONNX takes as constant tensors
(Reshape shape, Slice starts, opset-18 ReduceMean axes, ...) are also given as attributes, per the
canonical-op contract, so passes read one form whatever the opset. The ModelProto itself is kept in
`graph.meta["onnx_model"]` (opsets, metadata, functions, value_info) for the backend.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from tkopt.fused_ops import SCHEMAS
from tkopt.fused_ops.onnx_schema import attribute_values, register_schemas
from tkopt.ir import FUSED_DOMAIN, Dim, Graph, Node, Value
from tkopt.onnx_checker import checkable

MIN_OPSET = 17

DTYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}
ELEM_TYPES: dict[str, int] = {v: k for k, v in DTYPES.items()}

# Constant tensor inputs that are also exposed as attributes: op -> attribute name per input slot.
CONST_INPUT_ATTRS: dict[str, tuple[str | None, ...]] = {
    "Reshape": (None, "shape"),
    "Expand": (None, "shape"),
    "Unsqueeze": (None, "axes"),
    "Squeeze": (None, "axes"),
    "Slice": (None, "starts", "ends", "axes", "steps"),
    "Split": (None, "split"),
    "Tile": (None, "repeats"),
    "Trilu": (None, "k"),
    "Pad": (None, "pads", "constant_value", "axes"),
    "Clip": (None, "min", "max"),
    **{
        r: (None, "axes")
        for r in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare")
    },
}


class ModelLoadError(ValueError):
    """The model file cannot be used: missing, not ONNX, truncated, too old, or its data is missing."""


def dtype_name(elem_type: int) -> str:
    """tkopt's dtype string for an ONNX element type (unusual ones: ONNX's own name, lowercased)."""
    return DTYPES.get(elem_type) or onnx.TensorProto.DataType.Name(elem_type).lower()


def to_numpy(tensor: onnx.TensorProto, base_dir: str = "") -> np.ndarray:
    """Tensor data as numpy; bfloat16 becomes float32 (numpy has no bfloat16 of its own)."""
    arr = numpy_helper.to_array(tensor, base_dir)
    if tensor.data_type == onnx.TensorProto.BFLOAT16:
        arr = arr.astype(np.float32)
    return arr


def _shape(tp: onnx.TypeProto, known: frozenset[str] = frozenset()) -> tuple[str | None, tuple[Dim, ...] | None]:
    """dtype and shape; a dim_param shape inference made up ("unk__3": not one of the model's own
    `known` names) is an unknown dim (None): two such names say nothing about equality."""
    if not tp.HasField("tensor_type"):
        return None, None
    tt = tp.tensor_type
    dtype = dtype_name(tt.elem_type) if tt.elem_type else None
    if not tt.HasField("shape"):
        return dtype, None
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param") and (d.dim_param in known or not d.dim_param.startswith("unk__")):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dtype, tuple(dims)


def _attr_value(attr: onnx.AttributeProto) -> Any:
    v = helper.get_attribute_value(attr)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return to_numpy(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    if isinstance(v, list) and v and isinstance(v[0], onnx.TensorProto):
        return [to_numpy(t) for t in v]
    return v  # int, float, list of them, GraphProto (subgraphs stay protos)


def _plain(arr: np.ndarray) -> Any:
    """A constant input as an attribute value: a scalar for 0-d, else a list."""
    return arr.item() if arr.ndim == 0 else arr.tolist()


def _constant_value(attrs: dict[str, Any]) -> np.ndarray | None:
    """The tensor a Constant node produces, from whichever value_* attribute it uses."""
    if "value" in attrs:
        return attrs["value"]
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in attrs:
            return np.array(attrs[key], dtype=dtype)
    return None  # sparse_value / strings: left as the raw attribute


@functools.cache
def _schema_defaults(op: str, domain: str, version: int) -> dict[str, Any]:
    """Default attribute values from ONNX's op schema, so that passes never need to know them.
    (Cached: callers copy the dict before adding to it.)"""
    try:
        sch = onnx.defs.get_schema(op, version, domain)
    except onnx.defs.SchemaError:
        return {}
    out = {}
    for name, a in sch.attributes.items():
        if a.default_value.type != onnx.AttributeProto.UNDEFINED:
            out[name] = _attr_value(a.default_value)
    return out


def _load(model: str | Path | onnx.ModelProto, base_dir: str | Path | None) -> tuple[onnx.ModelProto, str, str]:
    """The ModelProto (external data not loaded yet), a name for messages, and its base directory."""
    if isinstance(model, onnx.ModelProto):
        return model, "<ModelProto>", str(base_dir or "")
    path = Path(model)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such model file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable ONNX model (truncated or not ONNX): {e}") from None
    return proto, str(path), str(base_dir or path.parent)


def load_model(
    model: str | Path | onnx.ModelProto, base_dir: str | Path | None = None
) -> tuple[onnx.ModelProto, onnx.ModelProto, str, bool]:
    """Load and validate a model: (ModelProto with its external data, value types, name for messages,
    whether it used external data). Types come from ONNX shape inference, run before the external
    data is loaded so that it works for models of any size.
    """
    proto, where, base = _load(model, base_dir)
    if not proto.HasField("graph") or proto.ir_version == 0:
        raise ModelLoadError(f"{where}: not an ONNX model (no graph or IR version)")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise ModelLoadError(
            f"{where}: opset {opset} is not supported; tkopt needs opset >= {MIN_OPSET} "
            f"(re-export with torch.onnx.export(..., opset_version={MIN_OPSET}) or newer)"
        )
    external = [t for t in _all_tensors(proto) if uses_external_data(t)]
    for t in external:
        _check_external_data(t, base, where)
    register_schemas()  # an optimized model has tkopt ops
    in_memory = isinstance(model, onnx.ModelProto)
    if external and in_memory:
        proto = _copy(proto)
        onnx.external_data_helper.load_external_data_for_model(proto, base)
    checked = checkable(proto)  # ops ONNX does not define but ORT runs pass through unchecked
    try:
        # From a file the checker reads external data itself (any size); shape inference needs types only.
        onnx.checker.check_model(where if external and not in_memory and checked is proto else checked)
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ModelLoadError(f"{where}: invalid ONNX model: {str(e).splitlines()[0]}") from None
    if external and not in_memory:
        onnx.external_data_helper.load_external_data_for_model(proto, base)
    return proto, inferred, where, bool(external)


def _check_external_data(t: onnx.TensorProto, base: str, where: str) -> None:
    """The tensor's data file exists and holds the bytes the tensor needs (a truncated copy names the file)."""
    info = {e.key: e.value for e in t.external_data}
    data = os.path.join(base, info.get("location", ""))
    if not os.path.isfile(data):
        raise ModelLoadError(f"{where}: external data file {data!r} (for tensor {t.name!r}) is missing")
    item = helper.tensor_dtype_to_np_dtype(t.data_type)
    if "length" in info:
        length = int(info["length"])
    elif item.kind != "O":
        length = int(np.prod(t.dims, dtype=np.int64)) * item.itemsize
    else:
        return  # strings: no fixed size to check
    end, size = int(info.get("offset", 0)) + length, os.path.getsize(data)
    if end > size:
        raise ModelLoadError(f"{where}: external data file {data!r} is truncated: it has {size} bytes, "
                             f"tensor {t.name!r} needs bytes up to {end}")


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out


def _all_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    return list(onnx.external_data_helper._get_all_tensors(proto))


def outer_reads(g: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from the enclosing scope (If/Loop/Scan bodies do this implicitly)."""
    defined = {v.name for v in g.input} | {t.name for t in g.initializer}
    reads: set[str] = set()
    for n in g.node:
        reads.update(i for i in n.input if i and i not in defined)
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                reads |= outer_reads(sub) - defined
        defined.update(n.output)
    return reads


def import_onnx(model: str | Path | onnx.ModelProto, base_dir: str | Path | None = None) -> Graph:
    """Import an ONNX model (path or ModelProto; `base_dir` locates external data of a ModelProto)."""
    proto, inferred, where, external = load_model(model, base_dir)
    g = proto.graph
    graph = Graph(g.name or "onnx_graph")
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}
    graph.meta.update(
        onnx_model=proto, source=where, opsets=opsets, external_data=external,
        onnx_initializers={t.name: t for t in g.initializer},
        onnx_input_names=[v.name for v in g.input], onnx_output_names=[v.name for v in g.output],
    )

    types: dict[str, onnx.TypeProto] = {}
    for vi in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output):
        types[vi.name] = vi.type
    known = frozenset(d.dim_param for vi in (*g.input, *g.output, *g.value_info)
                      for d in vi.type.tensor_type.shape.dim if d.HasField("dim_param"))
    values: dict[str, Value] = {}

    def value(name: str) -> Value:
        v = values.get(name)
        if v is None:
            dtype, shape = _shape(types[name], known) if name in types else (None, None)
            v = values[name] = Value(graph.reserve(name), dtype, shape)
        return v

    import_consts: dict[str, np.ndarray] = {}
    for t in g.initializer:
        v = value(t.name)
        v.dtype, v.shape = dtype_name(t.data_type), tuple(t.dims)
        v.const = import_consts[t.name] = to_numpy(t)
    graph.meta["onnx_import_consts"] = import_consts
    graph.inputs = [value(i.name) for i in g.input if i.name not in import_consts]
    for n in g.node:
        graph.add_node(_node(n, value, opsets, graph))
    graph.outputs = [value(o.name) for o in g.output]
    return graph


def _node(n: onnx.NodeProto, value: Any, opsets: dict[str, int], graph: Graph) -> Node:
    domain = "" if n.domain == "ai.onnx" else n.domain
    attrs = dict(_schema_defaults(n.op_type, domain, opsets.get(domain, 1))) if domain == "" else {}
    attrs.update(attribute_values(n) if domain == FUSED_DOMAIN else {a.name: _attr_value(a) for a in n.attribute})
    inputs = [value(i) if i else None for i in n.input]
    outputs = [value(o) for o in n.output]
    if domain == "":
        op = n.op_type
        _canonical_attrs(op, attrs, inputs, outputs)
    elif domain == FUSED_DOMAIN:
        op = n.op_type  # an already-fused model: stays a fused node, its absent trailing inputs None
        if op in SCHEMAS:
            inputs = SCHEMAS[op].padded(inputs)
    else:
        op, domain = f"{domain}::{n.op_type}", ""
    if any(isinstance(a, onnx.GraphProto) for a in attrs.values()):
        # Outer-scope reads of subgraphs become trailing inputs so the IR sees the dependency.
        reads: set[str] = set()
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                reads |= outer_reads(sub)
        inputs += [value(r) for r in sorted(reads)]
    name = n.name if n.name and n.name not in graph._names else graph.fresh_name(n.op_type)
    return Node(op, inputs, outputs, attrs, name=name, domain=domain, origin=n)


def _canonical_attrs(op: str, attrs: dict[str, Any], inputs: list[Value | None], outputs: list[Value]) -> None:
    """Fill in the contract's attribute forms for a default-domain node (in place)."""
    for slot, key in enumerate(CONST_INPUT_ATTRS.get(op, ())):
        if key and slot < len(inputs) and inputs[slot] is not None and inputs[slot].const is not None:
            attrs[key] = _plain(inputs[slot].const)
    if op == "Cast":
        attrs["to"] = dtype_name(attrs["to"])
    elif op == "Constant":
        const = _constant_value(attrs)
        if const is not None:
            attrs.clear()
            attrs["value"] = const
            outputs[0].const = const
            outputs[0].dtype = outputs[0].dtype or str(const.dtype)
            outputs[0].shape = tuple(const.shape)
    elif op == "Transpose" and "perm" not in attrs and inputs[0] is not None and inputs[0].rank is not None:
        attrs["perm"] = list(range(inputs[0].rank))[::-1]
