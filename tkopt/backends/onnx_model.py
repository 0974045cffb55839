"""ONNX backend: tkopt's IR -> an ONNX model, and saving it safely.

Unfused nodes are re-emitted from their NodeProto (`origin`) with only their value names updated,
so they run exactly as before; fused nodes become domain "tkopt" nodes with every attribute
explicit. The tkopt op schemas (tkopt.fused_ops.onnx_schema) are registered with onnx so that the
checker (full_check) and shape inference understand the fused nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import set_external_data

from tkopt.files import chmod_default
from tkopt.frontends.onnx import CONST_INPUT_ATTRS, ELEM_TYPES, outer_reads
from tkopt.fused_ops.onnx_schema import FUSED_OPSET, onnx_attributes, register_schemas
from tkopt.ir import FUSED_DOMAIN, Graph, Node, Value
from tkopt.onnx_checker import checkable
from tkopt.ort.metadata import LIBRARY_KEY, TARGET_KEY

DEFAULT_OPSET = 18  # for graphs that did not come from ONNX
TWO_GB = 2**31


# ---- export -----------------------------------------------------------------------------------
def _value_info(v: Value) -> onnx.ValueInfoProto:
    elem = ELEM_TYPES.get(v.dtype or "", onnx.TensorProto.UNDEFINED)
    return helper.make_tensor_value_info(v.name, elem, None if v.shape is None else list(v.shape))


def _tensor(v: Value) -> onnx.TensorProto:
    """A new initializer from a const Value (bfloat16 data is held as float32)."""
    arr = np.asarray(v.const)
    if v.dtype == "bfloat16":
        return helper.make_tensor(v.name, onnx.TensorProto.BFLOAT16, arr.shape, arr.astype(np.float32).ravel())
    if v.dtype and v.dtype in ELEM_TYPES:
        arr = arr.astype(helper.tensor_dtype_to_np_dtype(ELEM_TYPES[v.dtype]), copy=False)
    return numpy_helper.from_array(arr, v.name)


def _attr(key: str, value: Any) -> onnx.AttributeProto:
    if isinstance(value, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(value))
    return helper.make_attribute(key, value)


def _fused_node(n: Node) -> onnx.NodeProto:
    names = ["" if v is None else v.name for v in n.inputs]
    while names and names[-1] == "":
        names.pop()
    node = helper.make_node(n.op, names, [v.name for v in n.outputs], name=n.name, domain=FUSED_DOMAIN)
    node.attribute.extend(onnx_attributes(n.op, n.attrs))
    return node


def _from_origin(n: Node, out: list[onnx.NodeProto]) -> None:
    """The original NodeProto with its value names updated to the IR's current wiring."""
    proto = onnx.NodeProto()
    proto.CopyFrom(n.origin)
    n_explicit = len(n.origin.input)
    del proto.input[:]
    proto.input.extend("" if v is None else v.name for v in n.inputs[:n_explicit])
    del proto.output[:]
    proto.output.extend(v.name for v in n.outputs)
    # Subgraphs read outer values by name: keep those names alive if the IR rewired them.
    implicit = n.inputs[n_explicit:]
    if implicit:
        reads = sorted(r for a in n.origin.attribute for g in ([a.g] if a.HasField("g") else a.graphs)
                       for r in outer_reads(g))
        for old, v in zip(reads, implicit, strict=False):
            if v is not None and v.name != old:
                out.append(helper.make_node("Identity", [v.name], [old], name=f"{n.name}_outer_{old}"))
    out.append(proto)


def _from_attrs(n: Node) -> onnx.NodeProto:
    """A default-domain node that has no origin (made by a pass): emitted from op and attrs."""
    if "::" in n.op:
        raise ValueError(f"node {n.name}: cannot emit namespaced op {n.op} without its original NodeProto")
    attrs = dict(n.attrs)
    for slot, key in enumerate(CONST_INPUT_ATTRS.get(n.op, ())):
        if key and slot < len(n.inputs) and n.inputs[slot] is not None:
            attrs.pop(key, None)  # mirrors an input (an attribute only in older opsets, e.g. ReduceMean 17)
    if n.op == "Cast":
        attrs["to"] = ELEM_TYPES[attrs["to"]]
    names = ["" if v is None else v.name for v in n.inputs]
    while names and names[-1] == "":
        names.pop()
    node = helper.make_node(n.op, names, [v.name for v in n.outputs], name=n.name, domain=n.domain)
    node.attribute.extend(_attr(k, v) for k, v in attrs.items())
    return node


def _rename(nodes: list[onnx.NodeProto], old: str, new: str) -> None:
    for p in nodes:
        for field in (p.input, p.output):
            for i, name in enumerate(field):
                if name == old:
                    field[i] = new


def _emit(n: Node, out: list[onnx.NodeProto], lowered: Mapping[str, list[onnx.NodeProto]]) -> None:
    if n.is_fused:
        out.extend(lowered.get(n.name) or [_fused_node(n)])
    elif n.origin is not None:
        _from_origin(n, out)
    elif n.replaced:  # a recognised canonical node nobody fused: its original nodes
        for r in n.replaced:
            _emit(r, out, lowered)
    else:
        out.append(_from_attrs(n))


def export_onnx(graph: Graph, lowered: Mapping[str, list[onnx.NodeProto]] | None = None) -> onnx.ModelProto:
    """The ONNX model for `graph` (an imported one keeps its opsets, metadata and functions). `lowered`: fused
    nodes, by name, that run as these nodes instead (ONNX Runtime's own ops, FusedOp.ort_ops)."""
    register_schemas()
    src: onnx.ModelProto | None = graph.meta.get("onnx_model")
    orig_inits: dict[str, onnx.TensorProto] = graph.meta.get("onnx_initializers", {})
    import_consts: dict[str, np.ndarray] = graph.meta.get("onnx_import_consts", {})

    nodes: list[onnx.NodeProto] = []
    for n in graph.nodes:
        _emit(n, nodes, lowered or {})
    produced = {o for p in nodes for o in p.output}
    input_names = {v.name for v in graph.inputs}

    # Graph outputs keep their original names even if the IR now returns another value.
    out_names = graph.meta.get("onnx_output_names") or [v.name for v in graph.outputs]
    if len(out_names) != len(graph.outputs):
        out_names = [v.name for v in graph.outputs]
    for name, v in zip(out_names, graph.outputs, strict=True):
        if v.name != name:
            if name in produced:  # the old name now belongs to an inner value: give that one a new name
                _rename(nodes, name, graph.fresh_name(name))
            nodes.append(helper.make_node("Identity", [v.name], [name], name=graph.fresh_name("output_alias")))

    used = {i for p in nodes for i in p.input} | {v.name for v in graph.outputs}
    used |= {r for p in nodes for a in p.attribute for g in ([a.g] if a.HasField("g") else a.graphs)
             for r in outer_reads(g)}
    consts: dict[str, Value] = {}
    for v in graph.values():
        if v.const is not None and v.name in used and v.name not in produced and v.name not in input_names:
            consts[v.name] = v
    initializers = []
    for name, v in consts.items():
        if name in orig_inits and import_consts.get(name) is v.const:
            initializers.append(orig_inits[name])
        else:
            initializers.append(_tensor(v))

    src_vi = {vi.name: vi for vi in src.graph.value_info} if src is not None else {}
    src_io = {vi.name: vi for vi in (*src.graph.input, *src.graph.output)} if src is not None else {}
    inputs = [src_io.get(v.name) or _value_info(v) for v in graph.inputs]
    outputs = []
    for name, v in zip(out_names, graph.outputs, strict=True):
        vi = src_io.get(name)
        if vi is None:
            vi = _value_info(v)
            vi.name = name
        outputs.append(vi)
    io_names = {vi.name for vi in (*inputs, *outputs)}
    value_info = [vi for name, vi in src_vi.items() if name in produced and name not in io_names]
    have = {vi.name for vi in value_info} | io_names
    for n in graph.nodes:
        if n.origin is None:
            value_info += [_value_info(v) for v in n.outputs if v.name not in have and v.dtype in ELEM_TYPES]

    g = helper.make_graph(nodes, graph.name, inputs, outputs, initializers, value_info=value_info)
    if src is not None:
        model = helper.make_model(g, opset_imports=list(src.opset_import), functions=list(src.functions))
        model.ir_version = src.ir_version
        for f in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
            setattr(model, f, getattr(src, f))
        model.metadata_props.extend(src.metadata_props)
        g.doc_string = src.graph.doc_string
    else:
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], producer_name="tkopt")
    imported = {o.domain for o in model.opset_import} | {"", "ai.onnx"}
    for domain in sorted({p.domain for p in nodes} - imported):  # tkopt's, and com.microsoft for ORT's own ops
        model.opset_import.append(helper.make_opsetid(domain, FUSED_OPSET if domain == FUSED_DOMAIN else 1))
    return model


def check(model: onnx.ModelProto) -> None:
    """onnx.checker with full_check (strict shape inference, tkopt ops included); ops ONNX does not
    define but the input model had (ORT's own) pass unchecked (tkopt.onnx_checker)."""
    register_schemas()
    model = checkable(model)
    if model.ByteSize() < TWO_GB:
        onnx.checker.check_model(model, full_check=True)
        return
    with tempfile.TemporaryDirectory() as d:  # > 2 GB: the checker reads it from disk
        path = os.path.join(d, "model.onnx")
        save(model, path, external_data=True)
        onnx.checker.check_model(path, full_check=True)


# ---- saving -----------------------------------------------------------------------------------
_DIGEST = 10  # hex digits of a companion file's content hash in its name


def library_name(model_path: str | Path, target: str, digest: str) -> str:
    """The op library's file name beside a model written at `model_path`: `<stem>.tkopt-<target>-<digest>.so`."""
    return f"{Path(model_path).stem.removesuffix('.tkopt')}.tkopt-{target}-{digest}.so"


def save(
    model: onnx.ModelProto, path: str | Path, external_data: bool | None = None, size_threshold: int = 1024,
    library: str | Path | None = None,
) -> Path:
    """Write `model` and its companion files as one transaction: a reader sees the old output or the new one.

    `external_data=None` means: only when the model is 2 GB or more. The data goes to
    `<name>.<digest>.data` beside the model (tensors of `size_threshold` bytes or more); `library` (the op
    library the model's fused nodes run on; its target is the model's `tkopt.target` metadata) is copied to
    `library_name(...)`, which the model's metadata then names. Companions are named by their content, so
    moving them in never touches a file the current model at `path` reads; replacing the model file is the
    one commit point; only then are the companions the replaced model named, and the new one does not, removed.
    A failure before the commit removes what it moved in and leaves the old output as it was.
    """
    path = Path(path)
    if external_data is None:
        external_data = model.ByteSize() >= TWO_GB
    old = _companions(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    moved: list[Path] = []
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp:
        try:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)  # the caller's proto keeps its data and metadata
            staged: list[tuple[Path, Path, bool]] = []  # (temporary, final, executable)
            if library is not None:
                data = Path(library).read_bytes()
                meta = {p.key: p.value for p in copy.metadata_props}
                name = library_name(path, meta[TARGET_KEY], _digest([data]))
                helper.set_model_props(copy, {**meta, LIBRARY_KEY: name})
                (Path(tmp) / name).write_bytes(data)
                staged.append((Path(tmp) / name, path.parent / name, True))
            if external_data:
                tensors = [t for t in _initializers(copy.graph)
                           if t.HasField("raw_data") and len(t.raw_data) >= size_threshold]
                if tensors:
                    location = f"{path.name}.{_digest([t.name.encode() + t.raw_data for t in tensors])}.data"
                    for t in tensors:
                        set_external_data(t, location)
                    staged.append((Path(tmp) / location, path.parent / location, False))
            onnx.save_model(copy, os.path.join(tmp, path.name))  # writes the tensors set external to tmp/<location>
            for src, dst, executable in staged:
                chmod_default(src, executable)
                if not dst.exists():
                    moved.append(dst)
                os.replace(src, dst)
            chmod_default(os.path.join(tmp, path.name))
            os.replace(os.path.join(tmp, path.name), path)
        except BaseException:
            for f in moved:
                with contextlib.suppress(OSError):
                    f.unlink()
            raise
    for stale in old - _companions(path):
        with contextlib.suppress(OSError):
            stale.unlink()
    return path


def _digest(chunks: list[bytes]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()[:_DIGEST]


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every initializer, subgraphs' included."""
    yield from graph.initializer
    for n in graph.node:
        for a in n.attribute:
            for g in [a.g] if a.HasField("g") else a.graphs:
                yield from _initializers(g)


def _companions(path: Path) -> set[Path]:
    """The files `save` wrote beside the model now at `path` that it reads: its external data and op library
    (names of save's own form only, so a file a user made is never touched). Empty if there is no model."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - no model, or not one of ours: nothing to clean up
        return set()
    names = {e.value for t in _initializers(model.graph) for e in t.external_data if e.key == "location"}
    data = re.compile(rf"{re.escape(path.name)}\.[0-9a-f]{{{_DIGEST}}}\.data")
    found = {path.parent / n for n in names if data.fullmatch(n)}
    meta = {p.key: p.value for p in model.metadata_props}
    lib = meta.get(LIBRARY_KEY, "")
    if re.fullmatch(rf"{re.escape(path.stem.removesuffix('.tkopt'))}\.tkopt-\w+-[0-9a-f]{{{_DIGEST}}}\.so", lib):
        found.add(path.parent / lib)
    return found
