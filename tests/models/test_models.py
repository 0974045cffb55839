"""Reference models run, export three ways (torch.export, ONNX dynamo, ONNX TorchScript), and the
ONNX exports match torch in ONNX Runtime at a batch and sequence length other than the exported ones."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tkopt.models import blocks, hf
from tkopt.models.export import example_model, export_example, export_fx, export_onnx

MODELS = sorted(blocks.REFERENCE_MODELS)
EXPORTERS = {"dynamo": True, "torchscript": False}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def exported(onnx_dir):
    """(model name, exporter) -> path, exported once per module."""
    cache: dict[tuple[str, str], object] = {}

    def get(name: str, exporter: str):
        key = (name, exporter)
        if key not in cache:
            model, inputs = blocks.REFERENCE_MODELS[name]()
            cache[key] = export_onnx(model, inputs, onnx_dir / f"{name}_{exporter}.onnx", dynamo=EXPORTERS[exporter])
        return cache[key]

    return get


def _ort_run(path, inputs) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: x.numpy() for n, x in zip(names, inputs, strict=True)})[0]


def _torch_run(model, inputs) -> np.ndarray:
    with torch.no_grad():
        return model(*inputs).numpy()


@pytest.mark.parametrize("name", MODELS)
def test_runs_deterministically(name):
    m1, x1 = blocks.REFERENCE_MODELS[name]()
    m2, x2 = blocks.REFERENCE_MODELS[name]()
    assert not m1.training
    y1, y2 = _torch_run(m1, x1), _torch_run(m2, x2)
    assert y1.shape == (2, 8, 64) and np.isfinite(y1).all()
    np.testing.assert_array_equal(y1, y2)


def test_expected_fusions_cover_all_models():
    assert set(blocks.EXPECTED_FUSIONS) == set(blocks.REFERENCE_MODELS)
    for counts in blocks.EXPECTED_FUSIONS.values():
        assert set(counts) == {"attention", "add_norm", "gemm", "gemm_group", "gated_mlp"}


def test_sdpa_variant_matches_manual_attention():
    m, x = blocks.REFERENCE_MODELS["gpt2_block"]()
    m_sdpa, _ = blocks.REFERENCE_MODELS["gpt2_block_sdpa"]()
    np.testing.assert_allclose(_torch_run(m, x), _torch_run(m_sdpa, x), atol=1e-5)


def test_bert_padding_mask_is_applied():
    """Changing a padded token's features must not change the other tokens' outputs."""
    m, (h, mask) = blocks.REFERENCE_MODELS["bert_layer"]()
    h2 = h.clone()
    h2[0, -1] += 10.0  # mask[0, -1] == 0
    y, y2 = _torch_run(m, (h, mask)), _torch_run(m, (h2, mask))
    np.testing.assert_allclose(y[0, :-2], y2[0, :-2], atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_torch_export_dynamic(name):
    model, inputs = blocks.REFERENCE_MODELS[name]()
    ep = export_fx(model, inputs)
    other = model.example_inputs(batch=3, seq=5)
    np.testing.assert_allclose(ep.module()(*other).detach().numpy(), _torch_run(model, other), atol=1e-5)
    assert len(ep.range_constraints) == 2  # batch and seq are symbolic


@pytest.mark.parametrize("exporter", sorted(EXPORTERS))
@pytest.mark.parametrize("name", MODELS)
def test_onnx_matches_torch_dynamic(name, exporter, exported):
    path = exported(name, exporter)
    proto = onnx.load(path)
    for vi in list(proto.graph.input) + list(proto.graph.output):
        dims = [d.dim_param for d in vi.type.tensor_type.shape.dim]
        assert dims[:2] == ["batch", "seq"], (vi.name, dims)
    model, inputs = blocks.REFERENCE_MODELS[name]()
    np.testing.assert_allclose(_ort_run(path, inputs), _torch_run(model, inputs), atol=1e-4)
    other = model.example_inputs(batch=3, seq=5)
    np.testing.assert_allclose(_ort_run(path, other), _torch_run(model, other), atol=1e-4)


def test_input_names_follow_forward(exported):
    proto = onnx.load(exported("bert_layer", "torchscript"))
    assert [i.name for i in proto.graph.input] == ["hidden_states", "attention_mask"]
    assert [o.name for o in proto.graph.output] == ["output"]


@pytest.mark.parametrize("exporter", sorted(EXPORTERS))
def test_external_data(tmp_path, exporter):
    model, inputs = blocks.REFERENCE_MODELS["mlp"]()
    path = export_onnx(model, inputs, tmp_path / "mlp.onnx", dynamo=EXPORTERS[exporter], external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx", "mlp.onnx.data"]
    inits = onnx.load(path, load_external_data=False).graph.initializer
    assert inits and all(t.data_location == onnx.TensorProto.EXTERNAL for t in inits)
    onnx.checker.check_model(str(path), full_check=True)
    np.testing.assert_allclose(_ort_run(path, inputs), _torch_run(model, inputs), atol=1e-4)


def test_failed_export_keeps_old_file(tmp_path):
    class Unsupported(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svd(x)[1]  # no ONNX symbolic at opset 17

    target = tmp_path / "m.onnx"
    target.write_bytes(b"old")
    with pytest.raises(torch.onnx.errors.UnsupportedOperatorError):
        export_onnx(Unsupported(), (torch.randn(2, 3, 3),), target, dynamo=False)
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"] and target.read_bytes() == b"old"


def test_example_model_export(exported, tmp_path):
    model, inputs = example_model()
    assert isinstance(model, blocks.GPT2Block)
    path = export_example(tmp_path / "example.onnx", dynamo=False)
    np.testing.assert_allclose(_ort_run(path, inputs), _torch_run(model, inputs), atol=1e-4)


# --------------------------------------------------------------------------- Hugging Face models

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@needs_transformers
@pytest.mark.parametrize("impl", hf.ATTN_IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(hf.HF_MODELS))
def test_hf_torch_export(name, impl):
    model, inputs = hf.HF_MODELS[name](impl)
    other = hf.example_inputs(batch=3, seq=5)
    ep = export_fx(model, inputs)
    np.testing.assert_allclose(ep.module()(*other).detach().numpy(), _torch_run(model, other), atol=1e-4)


# Both ONNX exporters work for every model x attention implementation (see .notes/graphs dumps); to keep
# CPU time small the tests export eager attention with TorchScript and the SDPA Llama with dynamo.
@pytest.mark.parametrize(("name", "impl", "exporter"), [
    ("hf_bert", "eager", "torchscript"),
    ("hf_gpt2", "eager", "torchscript"),
    ("hf_llama", "eager", "torchscript"),
    ("hf_llama", "sdpa", "dynamo"),
])
@needs_transformers
def test_hf_onnx(name, impl, exporter, tmp_path):
    model, inputs = hf.HF_MODELS[name](impl)
    other = hf.example_inputs(batch=3, seq=5)
    path = export_onnx(model, inputs, tmp_path / "m.onnx", dynamo=EXPORTERS[exporter])
    np.testing.assert_allclose(_ort_run(path, other), _torch_run(model, other), atol=1e-4)
