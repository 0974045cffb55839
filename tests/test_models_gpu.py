"""On the GPU, on the TileLang kernels: torch.compile(backend="tkopt") under no_grad and in training, and a
transformers decoder compiled by tkopt.compile decoding with its cache fed back (head dim 64, which the
GPU attention kernels take)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from tkopt.backends.dynamo import make_backend

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(autouse=True)
def _kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")


@pytest.mark.parametrize("training", [False, True])
def test_backend_encoder_layer_on_gpu(training: bool) -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=True).cuda().half().train(training)
    torch._dynamo.reset()
    backend = make_backend(select="all")  # counts asserted: keep every fusion
    fast = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 77, 256, device="cuda", dtype=torch.half)
    with torch.set_grad_enabled(training):
        got, want = fast(x), model(x)
    assert _rel(got, want) < 1e-2
    if not backend.graph_modules:
        with torch.set_grad_enabled(training):
            explained = torch._dynamo.explain(model)(x)
        pytest.fail(f"Dynamo never called the backend: {explained.graph_count} graphs, breaks "
                    f"{[str(b.reason) for b in explained.break_reasons]}")
    fusions = backend.graph_modules[-1].tkopt_report.fusions
    assert fusions["attention"] == 1 and fusions["add_norm"] == 2
    if training:
        # fp16 gradients are judged against the same layer in fp32: tkopt's may be as far off as eager's, not more.
        exact = copy.deepcopy(model).float()
        r = torch.randn_like(want)
        g_tk, g_eager, g_exact = (
            _grads(m, out, r) for m, out in ((model, got), (model, want), (exact, exact(x.float())))
        )
        assert _rel(g_tk, g_exact) <= max(2 * _rel(g_eager, g_exact), 1e-3)


def _grads(model: nn.Module, out: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    (out.float() * r.float()).sum().backward(retain_graph=True)
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


def _decode(fn, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """3 greedy steps with the cache fed back: the tokens and the last logits."""
    with torch.no_grad():
        out, tokens = fn(ids), []
        for _ in range(3):
            tokens.append(out.logits[:, -1:].argmax(-1))
            out = fn(tokens[-1], past_key_values=out.past_key_values)
    return torch.cat(tokens, 1), out.logits


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_compiled_decoder_decodes_on_gpu(precision: str) -> None:
    """An fp32 decoder: at torch's default precision eager's attention is full fp32, so the TF32 attention
    kernel is refused with the reason and the rest fuses; at "high" eager's matmuls are TF32 too and
    attention fuses."""
    import tkopt

    pytest.importorskip("transformers")
    from tkopt.models.hf import tiny_model

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model("llama", "AutoModelForCausalLM", hidden_size=256, head_dim=64,
                               intermediate_size=512).cuda()
            ids = torch.randint(1, 128, (2, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            fast = tkopt.compile(model, (ids,), select="all")
            (want, want_logits), (got, got_logits) = _decode(model, ids), _decode(fast, ids)
        torch.set_float32_matmul_precision("highest")
        with torch.no_grad():  # the last step's logits in full fp32, from the whole sequence at once
            exact = model(torch.cat([ids, want], 1)).logits[:, -1:]
    finally:
        torch.set_float32_matmul_precision(before)
    report = str(fast.tkopt_report)
    assert torch.equal(want, got)
    # Judged against full fp32: at "high" tkopt's logits may be off by what TF32 costs (2x eager's own TF32
    # error, or 4 TF32 unit roundoffs: its attention's two matmuls are TF32 too, where eager's fp32 SDPA is
    # not: 1.07e-3 against eager's 5.2e-4 on the H200); at "highest" by 1e-4.
    tf32 = 4 * 2.0**-11 if precision == "high" else 1e-4
    assert _rel(got_logits, exact) <= max(2 * _rel(want_logits, exact), tf32)
    assert fast.tkopt_report.fusions["attention"] == (2 if precision == "high" else 0), report
    if precision == "highest":
        assert "TF32" in report, report
