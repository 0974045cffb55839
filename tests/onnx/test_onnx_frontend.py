"""ONNX frontend on real exports (both torch exporters) and on bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from tests.onnx.exports import Block, export
from tkopt.backends.onnx_model import check, export_onnx
from tkopt.frontends.onnx import ModelLoadError, import_onnx

# The TorchScript exporter is deprecated upstream but is one of the two exporters users run.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_torchscript_opset17(ts_model: Path) -> None:
    g = import_onnx(ts_model)
    assert g.meta["opsets"][""] == 17 and not g.meta["external_data"]
    (x,) = g.inputs
    assert x.name == "x" and x.dtype == "float32" and x.shape == ("batch", 3, 8)
    assert g.outputs[0].shape[0] == "batch"
    assert all(isinstance(n.origin, onnx.NodeProto) for n in g.nodes)
    # Initializers: const, not graph inputs, no producer.
    consts = [v for v in g.values() if v.is_const and g.producer(v) is None]
    assert {"lin.bias", "norm.weight", "norm.bias"} <= {v.name for v in consts}
    assert not any(v.is_const for v in g.inputs)
    # Constant nodes stay nodes; their outputs carry the data.
    const_nodes = [n for n in g.nodes if n.op == "Constant"]
    assert const_nodes and all(isinstance(n.outputs[0].const, np.ndarray) for n in const_nodes)
    assert all(isinstance(n.attrs["value"], np.ndarray) for n in const_nodes)
    ln = next(n for n in g.nodes if n.op == "LayerNormalization")
    assert ln.attrs["axis"] == -1 and ln.attrs["epsilon"] == pytest.approx(1e-5)
    # Constant tensor inputs mirrored as attributes; opset 17 ReduceMean has axes as an attribute.
    unsq = next(n for n in g.nodes if n.op == "Unsqueeze" and n.attrs.get("axes") == [1])
    assert unsq.inputs[1] is not None
    assert next(n for n in g.nodes if n.op == "ReduceMean").attrs["axes"] == [-1]
    # Every value typed by shape inference.
    assert all(v.dtype is not None for v in g.values())


def test_dynamo_opset18_external_data(dynamo_model: Path) -> None:
    assert dynamo_model.with_name(dynamo_model.name + ".data").exists()
    g = import_onnx(dynamo_model)
    assert g.meta["opsets"][""] >= 18 and g.meta["external_data"]
    assert g.inputs[0].shape == ("batch", 3, 8)
    rm = next(n for n in g.nodes if n.op == "ReduceMean")
    assert rm.inputs[1].is_const and rm.attrs["axes"] == [-1]  # opset 18: axes input -> attribute too
    rs = next(n for n in g.nodes if n.op == "Reshape")
    assert rs.attrs["shape"] == list(rs.inputs[1].const)
    w = next(v for v in g.values() if v.name == "lin.bias")
    np.testing.assert_array_equal(w.const, numpy_helper.to_array(
        next(t for t in onnx.load(str(dynamo_model)).graph.initializer if t.name == "lin.bias")))


def test_model_proto_input_and_fp16(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = export(Block().eval().half(), tmp_path / "half.onnx", False, 17, torch.randn(2, 3, 8).half())
    g = import_onnx(onnx.load(str(path)))
    assert g.meta["source"] == "<ModelProto>"
    assert g.inputs[0].dtype == "float16" and g.outputs[0].dtype == "float16"
    assert next(v for v in g.values() if v.name == "lin.bias").const.dtype == np.float16


def _tiny(opset: int = 18, nodes=None, inits=(), domain_opsets=()) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    nodes = nodes or [helper.make_node("Relu", ["x"], ["y"])]
    g = helper.make_graph(nodes, "tiny", [x], [y], list(inits))
    ops = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domain_opsets)]
    return helper.make_model(g, opset_imports=ops)


def test_bf16_initializer_and_cast() -> None:
    w = helper.make_tensor("w", TensorProto.BFLOAT16, [4], [1.0, 2.0, 3.0, 0.5])
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("Mul", ["xb", "w"], ["m"]),
        helper.make_node("Cast", ["m"], ["y"], to=TensorProto.FLOAT),
    ]
    g = import_onnx(_tiny(nodes=nodes, inits=[w]))
    wv = next(v for v in g.values() if v.name == "w")
    assert wv.dtype == "bfloat16" and wv.const.dtype == np.float32
    np.testing.assert_array_equal(wv.const, [1.0, 2.0, 3.0, 0.5])
    assert [n.attrs["to"] for n in g.nodes if n.op == "Cast"] == ["bfloat16", "float32"]
    assert g.nodes[1].outputs[0].dtype == "bfloat16"


def test_old_opset_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "old.onnx"
    onnx.save(_tiny(opset=13), str(path))
    with pytest.raises(ModelLoadError, match=r"old\.onnx.*opset 13.*>= 17"):
        import_onnx(path)


def test_custom_domain_op_kept() -> None:
    nodes = [helper.make_node("Foo", ["x"], ["y"], domain="com.example", alpha=2.0)]
    g = import_onnx(_tiny(nodes=nodes, domain_opsets=["com.example"]))
    (n,) = g.nodes
    assert n.op == "com.example::Foo" and n.attrs == {"alpha": 2.0} and n.origin is not None


def test_external_data_missing(ts_model: Path, tmp_path: Path) -> None:
    proto = onnx.load(str(ts_model))
    path = tmp_path / "ext.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, location="ext.bin", size_threshold=0)
    g = import_onnx(path)
    assert g.meta["external_data"]
    assert next(v for v in g.values() if v.name == "norm.weight").const.shape == (16,)
    (tmp_path / "ext.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"ext\.onnx.*ext\.bin.*missing"):
        import_onnx(path)


@pytest.mark.parametrize("offset", [False, True])
def test_external_data_truncated_names_the_file(offset: bool, ts_model: Path, tmp_path: Path) -> None:
    """A cut-short data file is named, not just the tensor that ran past its end (issue 8)."""
    proto = onnx.load(str(ts_model))
    path = tmp_path / "ext.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, location="ext.bin", size_threshold=0)
    data = (tmp_path / "ext.bin").read_bytes()
    (tmp_path / "ext.bin").write_bytes(data[: len(data) - 4] if offset else data[:8])
    with pytest.raises(ModelLoadError, match=r"ext\.onnx: external data file '.*ext\.bin' is truncated: it has "):
        import_onnx(path)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "text", "missing", "empty"])
def test_bad_files_name_the_file(kind: str, ts_model: Path, tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.onnx"
    data = ts_model.read_bytes()
    contents = {
        "truncated": data[: len(data) // 2],
        "garbage": bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)),
        "text": b"this is not a model\n",
        "empty": b"",
    }
    if kind != "missing":
        path.write_bytes(contents[kind])
    with pytest.raises(ModelLoadError, match=rf"{kind}\.onnx"):
        import_onnx(path)


def test_relative_external_data_from_other_cwd(dynamo_model: Path, tmp_path: Path, monkeypatch) -> None:
    """External data is found next to the model file, not in the working directory."""
    for f in dynamo_model.parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.chdir(Path(__file__).parent)
    assert import_onnx(tmp_path / dynamo_model.name).meta["external_data"]


def test_subgraph_outer_reads_are_dependencies() -> None:
    """An If branch reading an outer value by name: the IR sees it as an input of the If node."""
    then_g = helper.make_graph([helper.make_node("Identity", ["r"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["r"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    zero = numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero")
    g = import_onnx(_tiny(nodes=nodes, inits=[zero]))
    if_node = g.nodes[-1]
    assert [v.name for v in if_node.inputs] == ["c", "r"]
    assert g.producers()[id(if_node.inputs[1])] is g.nodes[0]  # the If depends on the Relu
    model = export_onnx(g)
    check(model)
    assert list(model.graph.node) == nodes
