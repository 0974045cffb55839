"""The fused ops as ONNX op schemas (domain "tkopt"), so onnx's checker and shape inference know them.

Derived from the definitions: inputs, outputs and attributes from each `FusedOp`, output types from its
`output_shapes` rule over ONNX dims. Both the ONNX frontend (an optimized model has tkopt ops) and the
ONNX backend register them.

Attributes: an ONNX FLOAT attribute is 32-bit, which would round a float64 model's scale or epsilon
(1/sqrt(8) loses 1e-8 relative). A fused op's float attribute is therefore a 0-d double TENSOR
attribute, exact; `onnx_attributes` writes a node's attributes and `attribute_values` reads them, for
everything that emits or reads a tkopt node (backend, frontend, hybrid runner, shape inference).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.defs import OpSchema

from tkopt.ir import FUSED_DOMAIN

from . import SCHEMAS, FusedOp, base, schema

FUSED_OPSET = 1
_ONNX_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)",
               "float64": "tensor(double)", "bool": "tensor(bool)", "uint8": "tensor(uint8)"}
TYPE_CONSTRAINTS = {k: ([_ONNX_TYPES[d] for d in dtypes], doc) for k, (dtypes, doc) in base.TYPE_CONSTRAINTS.items()}


def _onnx_attribute(op: FusedOp, name: str, value: Any) -> onnx.AttributeProto:
    kind = type(op.attrs[name])
    if kind is float:
        return helper.make_attribute(name, numpy_helper.from_array(np.array(value, np.float64)))
    return helper.make_attribute(name, kind(value))


def onnx_attributes(op: str, attrs: dict[str, Any]) -> list[onnx.AttributeProto]:
    """Every attribute of a node of fused op `op` (defaults filled in), float ones as 0-d double tensors."""
    s = schema(op)
    return [_onnx_attribute(s, k, v) for k, v in s.full_attrs(attrs).items()]


def _value(op: FusedOp, node: str, a: onnx.AttributeProto) -> Any:
    if a.name not in op.attrs:
        raise ValueError(f"{op.name} node {node!r}: unknown attribute {a.name!r}; known: {sorted(op.attrs)}")
    kind = type(op.attrs[a.name])
    if kind is float:
        if a.type != onnx.AttributeProto.TENSOR or a.t.data_type != onnx.TensorProto.DOUBLE or list(a.t.dims):
            got = onnx.AttributeProto.AttributeType.Name(a.type)
            if a.type == onnx.AttributeProto.TENSOR:
                got = f"a {onnx.TensorProto.DataType.Name(a.t.data_type)} tensor of shape {list(a.t.dims)}"
            raise ValueError(f"{op.name} node {node!r}: attribute {a.name!r} must be a 0-d double tensor "
                             f"(float attributes are exact), got {got}")
        return float(numpy_helper.to_array(a.t))
    value = helper.get_attribute_value(a)
    return value.decode() if isinstance(value, bytes) else value


def attribute_values(node: onnx.NodeProto) -> dict[str, Any]:
    """A tkopt node's attributes as Python values (floats exact), as `onnx_attributes` wrote them."""
    op = schema(node.op_type)
    return {a.name: _value(op, node.name, a) for a in node.attribute}


def _dim_equal(a: onnx.TensorShapeProto.Dimension, b: onnx.TensorShapeProto.Dimension) -> bool:
    if a.HasField("dim_value") and b.HasField("dim_value"):
        return a.dim_value == b.dim_value
    return a.HasField("dim_param") and b.HasField("dim_param") and a.dim_param == b.dim_param


def _broadcast(a: list, b: list) -> list | None:
    """numpy broadcasting of two lists of ONNX dims; an unknown dim where it cannot be told statically."""
    out = []
    for i in range(max(len(a), len(b))):
        da = a[len(a) - 1 - i] if i < len(a) else None
        db = b[len(b) - 1 - i] if i < len(b) else None
        if da is None or (db is not None and da.HasField("dim_value") and da.dim_value == 1):
            out.append(db)
        elif db is None or (db.HasField("dim_value") and db.dim_value == 1) or _dim_equal(da, db):
            out.append(da)
        else:
            out.append(onnx.TensorShapeProto.Dimension())
    return out[::-1]


def _inference(op: FusedOp):
    def infer(ctx: Any) -> None:
        if not ctx.has_input(0) or not ctx.get_input_type(0).HasField("tensor_type"):
            return
        shapes = []
        for i in range(len(op.inputs)):
            t = ctx.get_input_type(i) if i < ctx.get_num_inputs() and ctx.has_input(i) else None
            known = t is not None and t.HasField("tensor_type") and t.tensor_type.HasField("shape")
            shapes.append(list(t.tensor_type.shape.dim) if known else None)
        attrs = {}
        for name, default in op.attrs.items():
            a = ctx.get_attribute(name)
            attrs[name] = default if a is None else _value(op, "", a)
        elem = ctx.get_input_type(0).tensor_type.elem_type
        for i, shape in enumerate(op.output_shapes(shapes, attrs, _broadcast)[: ctx.get_num_outputs()]):
            out = onnx.TypeProto()
            out.tensor_type.elem_type = elem
            if shape is not None:
                out.tensor_type.shape.dim.extend(shape)
            ctx.set_output_type(i, out)

    return infer


def _onnx_schema(op: FusedOp) -> OpSchema:
    opt, single = OpSchema.FormalParameterOption.Optional, OpSchema.FormalParameterOption.Single
    ins = [OpSchema.FormalParameter(n, op.input_types.get(n, "T"),
                                    param_option=opt if n in op.optional_inputs else single) for n in op.inputs]
    outs = [OpSchema.FormalParameter(n, "T", param_option=opt if n in op.optional_outputs else single)
            for n in op.outputs]
    used = {"T", *op.input_types.values()}
    constraints = [(t, *TYPE_CONSTRAINTS[t]) for t in sorted(used)]
    attrs = [OpSchema.Attribute(k, _onnx_attribute(op, k, v), "") for k, v in op.attrs.items()]
    doc = f"tkopt fused op {op.name}; semantics: tkopt.fused_ops.SCHEMAS[{op.name!r}]"
    sch = OpSchema(op.name, FUSED_DOMAIN, FUSED_OPSET, doc, inputs=ins, outputs=outs, type_constraints=constraints,
                   attributes=attrs)
    sch.set_type_and_shape_inference_function(_inference(op))
    return sch


def register_schemas() -> None:
    """Make onnx's checker and shape inference know the tkopt ops (idempotent)."""
    for op in SCHEMAS.values():
        if not onnx.defs.has(op.name, FUSED_DOMAIN):
            onnx.defs.register_schema(_onnx_schema(op))
