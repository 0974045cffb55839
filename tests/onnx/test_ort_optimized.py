"""Models a user already ran through ONNX Runtime's transformer optimizer: every op ORT runs passes
through untouched (its SimplifiedLayerNormalization in the default domain, com.microsoft's
SkipLayerNormalization, FastGelu, Attention, ...), and tkopt checks what it wrote, not what it was given."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from onnxruntime.transformers.optimizer import optimize_model

from tkopt.api import optimize_onnx
from tkopt.frontends.onnx import ModelLoadError
from tkopt.models.blocks import REFERENCE_MODELS
from tkopt.models.export import export_onnx
from tkopt.models.hf import HF_MODELS

# model -> (ORT optimizer model_type, heads, hidden); 0 lets ORT read them off the graph
MODELS = {"llama_block": ("gpt2", 4, 64), "bert_layer": ("bert", 4, 64), "gpt2_block": ("gpt2", 4, 64),
          "hf_bert": ("bert", 4, 64), "hf_gpt2": ("gpt2", 4, 64)}


def _ort_optimized(name: str, d: Path) -> Path:
    pytest.importorskip("transformers") if name.startswith("hf_") else None
    model, inputs = (HF_MODELS[name] if name.startswith("hf_") else REFERENCE_MODELS[name])()
    src = export_onnx(model, inputs, d / f"{name}.onnx", dynamo=False)
    model_type, heads, hidden = MODELS[name]
    out = d / f"{name}.ort.onnx"
    optimize_model(str(src), model_type=model_type, num_heads=heads, hidden_size=hidden).save_model_to_file(str(out))
    return out


def _foreign(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "com.microsoft" or n.op_type.startswith("Simplified")]


@pytest.mark.parametrize("name", list(MODELS))
def test_ort_optimized_model_passes_through(name: str, tmp_path: Path) -> None:
    src = _ort_optimized(name, tmp_path)
    foreign = _foreign(onnx.load(str(src)))
    assert foreign, "ORT's optimizer fused nothing: the test would prove nothing"
    model, rep = optimize_onnx(src, tmp_path / "out.onnx", report=False, check_accuracy=True)
    assert rep.accuracy is not None and rep.accuracy.checked and rep.accuracy.ok, rep.accuracy
    assert len(rep.accuracy.runs) >= 3
    kept = _foreign(model)
    assert [(n.op_type, n.domain, list(n.attribute)) for n in kept] == [
        (n.op_type, n.domain, list(n.attribute)) for n in foreign]
    if name == "llama_block":
        assert any(n.op_type == "SimplifiedLayerNormalization" and n.domain == "" for n in kept)


def test_unknown_default_domain_op_still_gets_structural_checks(tmp_path: Path) -> None:
    """Setting unknown ops aside does not set the checker aside: a dangling input is still refused."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "missing_scale"], ["y"])
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(ModelLoadError, match=r"bad\.onnx: invalid ONNX model: .*missing_scale"):
        optimize_onnx(tmp_path / "bad.onnx", report=False)
