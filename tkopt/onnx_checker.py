"""onnx.checker for models that hold ops ONNX does not define but ONNX Runtime runs.

ORT's transformer optimizer writes its own ops into the default domain (SimplifiedLayerNormalization)
beside com.microsoft ones (SkipLayerNormalization, FastGelu, Attention). The checker rejects an
unknown op of the default domain ("No Op registered for ..."), though it accepts unknown ops of other
domains. tkopt passes such ops through untouched, so it checks models with them set aside: each
default-domain node without an ONNX schema at the model's opset is checked as an op of an opaque
domain, and everything else (the graph's structure, types, the fused nodes tkopt wrote) as usual.
"""

from __future__ import annotations

import onnx

OPAQUE_DOMAIN = "tkopt.passthrough"  # only ever in the copy handed to the checker


def _known(op: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


def _move_unknown(graph: onnx.GraphProto, opset: int) -> int:
    moved = 0
    for node in graph.node:
        if node.domain in ("", "ai.onnx") and not _known(node.op_type, opset):
            node.domain = OPAQUE_DOMAIN
            moved += 1
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                moved += _move_unknown(sub, opset)
    return moved


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy whose default-domain ops unknown to ONNX are in an opaque domain."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if not _move_unknown(copy.graph, opset):
        return model
    copy.opset_import.append(onnx.helper.make_opsetid(OPAQUE_DOMAIN, 1))
    return copy
