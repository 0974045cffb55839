"""ONNX backend: round trips, fused-node export (full check, shape inference, reference run), saving."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from tests.onnx.exports import MaskedAttention
from tkopt.api import compare_onnx, make_inputs, optimize_onnx
from tkopt.backends.onnx_model import check, export_onnx, save
from tkopt.frontends.onnx import import_onnx
from tkopt.ir import Graph, Node, Value
from tkopt.onnx_runtime_ref import run_model
from tkopt.passes.base import fuse

# The TorchScript exporter is deprecated upstream but is one of the two exporters users run.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _ort(model: onnx.ModelProto | Path, feeds: dict) -> list[np.ndarray]:
    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("which", ["ts_model", "dynamo_model"])
def test_round_trip_without_fusion(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    original = onnx.load(str(path))
    model = export_onnx(import_onnx(path))
    check(model)
    assert list(model.graph.node) == list(original.graph.node)  # re-emitted unchanged, same order
    assert {t.name for t in model.graph.initializer} == {t.name for t in original.graph.initializer}
    assert model.graph.input[0] == original.graph.input[0]  # symbolic dims preserved
    assert model.graph.output[0].type == original.graph.output[0].type
    assert list(model.opset_import) == list(original.opset_import)
    feeds = {"x": np.random.default_rng(0).standard_normal((5, 3, 8)).astype(np.float32)}
    for a, b in zip(_ort(path, feeds), _ort(model, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_custom_domain_op_round_trip() -> None:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Foo", ["r"], ["y"], domain="com.example", k=3)]
    src = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                            opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    g = import_onnx(src)
    assert g.count_ops() == {"Relu": 1, "com.example::Foo": 1}
    out = export_onnx(g)
    assert list(out.graph.node) == nodes and list(out.opset_import) == list(src.opset_import)


def _fused_graph() -> tuple[Graph, dict[str, np.ndarray]]:
    """x -> FusedGemm(bias omitted, residual) -> FusedAddNorm (Y, Sum) -> FusedAttention(mask) -> GatedMLP."""
    rng = np.random.default_rng(0)
    w = {k: rng.standard_normal(s).astype(np.float32) for k, s in
         [("w", (16, 16)), ("ln_w", (16,)), ("ln_b", (16,)), ("wg", (16, 8)), ("wu", (16, 8))]}
    g = Graph("fused")
    x = Value("x", "float32", ("b", 4, 16))
    mask = Value("mask", "bool", ("b", 1, 4, 4))
    c = {k: Value(k, "float32", v.shape, const=v) for k, v in w.items()}
    v = {n: Value(n, "float32", ("b", 4, 16)) for n in ("gemm", "norm", "sum")}
    q = Value("q", "float32", ("b", 1, 4, 16))
    att = Value("att", "float32", ("b", 1, 4, 16))
    y = Value("y", "float32", ("b", 1, 4, 8))
    g.inputs = [x, mask]
    g.add_node(Node("FusedGemm", [x, c["w"], None, x], [v["gemm"]], {"trans_b": 1}, domain="tkopt"))
    g.add_node(Node("FusedAddNorm", [v["gemm"], x, c["ln_w"], c["ln_b"]], [v["norm"], v["sum"]],
                    {"kind": "layer", "epsilon": 1e-5}, domain="tkopt"))
    g.add_node(Node("Unsqueeze", [v["norm"], Value("axes", "int64", (1,), const=np.array([1]))], [q], {"axes": [1]}))
    g.add_node(Node("FusedAttention", [q, q, q, mask], [att], {"causal": 1}, domain="tkopt"))
    g.add_node(Node("FusedGatedMLP", [att, c["wg"], c["wu"], None, None], [y], {"activation": "silu"},
                    domain="tkopt"))
    g.outputs = [y, v["sum"]]
    return g, w


def _expected(w: dict[str, np.ndarray], x: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    xt = torch.from_numpy(x)
    gemm = xt @ t["w"].T + xt
    s = gemm + xt
    norm = torch.nn.functional.layer_norm(s, (16,), t["ln_w"], t["ln_b"], 1e-5).unsqueeze(1)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    att = torch.nn.functional.scaled_dot_product_attention(norm, norm, norm, attn_mask=torch.from_numpy(mask) & causal)
    y = torch.nn.functional.silu(att @ t["wg"]) * (att @ t["wu"])
    return y.numpy(), s.numpy()


@pytest.mark.parametrize("provider", ["hybrid", "reference"])
def test_fused_nodes_export_check_and_run(provider: str) -> None:
    g, w = _fused_graph()
    model = export_onnx(g)
    check(model)  # full_check with the registered tkopt schemas
    assert helper.make_opsetid("tkopt", 1) in model.opset_import
    gemm = next(n for n in model.graph.node if n.op_type == "FusedGemm")
    assert list(gemm.input) == ["x", "w", "", "x"]  # omitted optional input in the middle: ""
    assert {a.name: helper.get_attribute_value(a) for a in gemm.attribute} == {"trans_b": 1, "activation": b"none"}
    mlp = next(n for n in model.graph.node if n.op_type == "FusedGatedMLP")
    assert len(mlp.input) == 3  # trailing omitted inputs dropped
    assert {t.name for t in model.graph.initializer} == {"w", "ln_w", "ln_b", "wg", "wu", "axes"}
    # Shape inference knows the fused ops' output shapes.
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {vi.name: vi.type for vi in inferred.graph.value_info}
    assert [d.dim_value or d.dim_param for d in types["gemm"].tensor_type.shape.dim] == ["b", 4, 16]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 16)).astype(np.float32)
    mask = np.ones((2, 1, 4, 4), dtype=bool)
    mask[1, ..., 0] = False
    out = run_model(model, {"x": x, "mask": mask}, provider=provider)
    y, s = _expected(w, x, mask)
    np.testing.assert_allclose(out["sum"], s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["y"], y, rtol=1e-4, atol=1e-4)


def test_manual_fusion_of_imported_model(ts_model: Path) -> None:
    """MatMul+Add of an exported model -> FusedGemm: exports, checks, matches the original."""
    g = import_onnx(ts_model)
    mm = next(n for n in g.nodes if n.op == "MatMul")
    add = g.user_map()[id(mm.outputs[0])][0]
    bias = next(v for v in add.inputs if v.is_const)
    fuse(g, [mm, add], "FusedGemm", [mm.inputs[0], mm.inputs[1], bias, None], add.outputs, {})
    # A folded constant (new Value) replaces an initializer: the old one is dropped, the new one emitted.
    ln = next(n for n in g.nodes if n.op == "LayerNormalization")
    ln.inputs[1] = Value("folded_w", "float32", (16,), const=ln.inputs[1].const * 1.0)
    model = export_onnx(g)
    check(model)
    names = {t.name for t in model.graph.initializer}
    assert "folded_w" in names and "norm.weight" not in names
    assert any(vi.name == add.outputs[0].name for vi in model.graph.value_info)  # fused output typed
    acc = compare_onnx(ts_model, model)
    assert acc.fused_runner == "hybrid" and acc.ok, acc
    assert compare_onnx(ts_model, model).outputs == acc.outputs  # deterministic


def test_graph_output_keeps_its_name(ts_model: Path) -> None:
    """If a pass reroutes a graph output to another value, the model's output name stays."""
    g = import_onnx(ts_model)
    last = g.nodes[-1]
    g.nodes.append(Node("Identity", [last.outputs[0]], [Value("renamed", "float32", last.outputs[0].shape)]))
    g.outputs = [g.nodes[-1].outputs[0]]
    model = export_onnx(g)
    check(model)
    assert [o.name for o in model.graph.output] == ["y"]
    feeds = make_inputs(model)
    np.testing.assert_array_equal(_ort(ts_model, feeds)[0], _ort(model, feeds)[0])


def test_make_inputs_masks_and_ids() -> None:
    x = helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"])
    m = helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.INT64, ["batch", "seq"])
    model = helper.make_model(helper.make_graph([helper.make_node("Mul", ["input_ids", "attention_mask"], ["y"])],
                                                "g", [x, m], [y]))
    feeds = make_inputs(model)
    assert feeds["input_ids"].shape == (2, 8) and feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() < 10
    assert (feeds["attention_mask"][:, :6] == 1).all() and (feeds["attention_mask"][:, 6:] == 0).all()


def test_save_external_data_and_atomicity(ts_model: Path, tmp_path: Path) -> None:
    model = export_onnx(import_onnx(ts_model))
    out = save(model, tmp_path / "a.onnx", external_data=True, size_threshold=0)
    data = [p.name for p in tmp_path.iterdir() if p.name.startswith("a.onnx.") and p.name.endswith(".data")]
    assert len(data) == 1  # named by its content: a.onnx.<digest>.data
    assert import_onnx(out).meta["external_data"]
    assert all(t.HasField("raw_data") or t.float_data for t in model.graph.initializer)  # caller's proto untouched
    save(model, tmp_path / "b.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.onnx", *data, "b.onnx"])
    assert onnx.load(str(tmp_path / "b.onnx")) == model
    (tmp_path / "dir.onnx").mkdir()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(OSError):
        save(model, tmp_path / "dir.onnx")  # the target is a directory: replace fails
    assert sorted(os.listdir(tmp_path)) == before  # no temporary leftovers


def test_optimize_and_compare_with_int_mask(tmp_path: Path) -> None:
    """optimize_onnx end to end on a model with an int attention_mask input (generated: ones, then padding)."""
    torch.manual_seed(0)
    path = tmp_path / "att.onnx"
    dyn = {0: "batch", 1: "seq"}
    torch.onnx.export(MaskedAttention().eval(), (torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.int64)),
                      str(path), dynamo=False, opset_version=17, input_names=["x", "attention_mask"],
                      dynamic_axes={"x": dyn, "attention_mask": dyn})
    out = tmp_path / "att.tkopt.onnx"
    model, rep = optimize_onnx(path, out, report=False, check_accuracy=True)
    assert out.exists() and rep.output == str(out)
    assert rep.passes.total_fused >= 1 and rep.accuracy is not None and rep.accuracy.ok
    assert rep.accuracy.inputs == {"x": [2, 8, 16], "attention_mask": [2, 8]}
    assert rep.to_dict()["accuracy"]["outputs"][0]["ok"]


def test_reoptimizing_is_idempotent_and_mismatch_is_caught(ts_model: Path) -> None:
    optimized, rep = optimize_onnx(ts_model, report=False)
    again, rep2 = optimize_onnx(optimized, report=False)
    assert rep.passes.total_fused > 0 and rep2.passes.total_fused == 0
    assert list(again.graph.node) == list(optimized.graph.node)
    broken = onnx.ModelProto()
    broken.CopyFrom(optimized)
    gemm = next(n for n in broken.graph.node if n.op_type == "FusedGemm")
    next(a for a in gemm.attribute if a.name == "activation").s = b"relu"
    acc = compare_onnx(ts_model, broken)
    assert not acc.ok and acc.outputs[0].max_abs > 1e-3
