"""Tests marked `gpu` need a CUDA GPU: skipped without one (run them on the device).

torch before 2.13 cannot export Llama-style GQA models with a named dynamic sequence dim (it fails to prove
min(16*s, 32*s) == 16*s): the tests that export them that way are expected to fail there with that error,
and only that error (torch 2.11 is in the supported range; CI runs 2.13)."""

import pytest
import torch
from torch._dynamo.exc import UserError
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

GQA_DYNAMIC_EXPORTS = {  # test -> what its id holds where it exports GQA that way
    "test_torch_export_dynamic": "llama", "test_hf_torch_export": "llama",
    "test_reference_models_fuse_as_expected": "llama_block-fx", "test_hf_causal_mask_from_positions_is_proven": "llama",
    "test_hf_causal_and_padding_mask_splits_into_causal_and_the_padding": "llama",
}
OLD_EXPORT = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gqa = pytest.mark.xfail(raises=(ConstraintViolationError, UserError), strict=True,
                            reason="torch < 2.13 cannot export GQA with a named dynamic sequence dim")
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        held = GQA_DYNAMIC_EXPORTS.get(getattr(item, "originalname", None) or "")
        if OLD_EXPORT and held is not None and held in item.name:
            item.add_marker(gqa)


@pytest.fixture
def one_thread():
    """ATen on one thread: on a loaded machine (the suite shares two cores) its two threads stall on each
    other for a time slice, and even a serial scalar GEMM kernel then measures faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_shipped_decisions(monkeypatch):
    """Tests measure what they assert: a decline shipped for the GPU they run on would skip it. The shipped
    declines have their own tests (test_shipped_decisions.py), which turn them back on."""
    monkeypatch.setenv("TKOPT_SHIPPED_DECISIONS", "0")
