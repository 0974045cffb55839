"""transformers families beyond the coverage matrix's rows, through tkopt.compile: each pattern class the family
sweep (benchmarks/families.py, benchmarks/results/families.md) found, on the real model that writes it."""

from __future__ import annotations

import warnings

import pytest
import torch

import tkopt

transformers = pytest.importorskip("transformers")
from tkopt.models.hf import tiny_model  # noqa: E402

# family -> (fusions it must make on the 1-layer model, a refusal reason it must give)
CASES = {
    "cohere": ({"add_norm": 2, "attention": 1}, None),  # its LayerNorm writes x - mean twice (merge_duplicates)
    "phi3": ({"gated_mlp": 1, "attention": 1}, None),  # one packed gate_up_proj, then chunk(2, -1)
    "gemma2": ({"attention": 0}, "attention logit soft-capping (Tanh"),  # tanh(scores / cap) * cap
    "bloom": ({"attention": 0}, "Q·K^T is aten::baddbmm"),  # ALiBi added inside baddbmm
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_family_fuses_or_says_why(model_type: str) -> None:
    fusions, reason = CASES[model_type]
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type, "AutoModelForCausalLM", num_hidden_layers=1)
        fast = tkopt.compile(model, (ids,), {"use_cache": False}, select="all")
        with torch.no_grad():
            got, want = fast(ids, use_cache=False).logits, model(ids, use_cache=False).logits
    report = fast.tkopt_report
    assert {k: report.fusions.get(k, 0) for k in fusions} == fusions, report.passes.refusals
    refusals = [r.reason for r in report.passes.refusals]
    assert reason is None or any(reason in r for r in refusals), refusals
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
