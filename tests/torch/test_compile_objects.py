"""tkopt.compile takes what torch.compile takes: keyword inputs, ints, objects holding tensors (KV caches)
in and out, updated in place as in eager; transformers decoders from their default configs decode with
the cache fed back, token for token as eager."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tkopt


class Memory:
    """A user class pytree does not know: tensors, an int counter, a flag and a name."""

    def __init__(self, k: torch.Tensor) -> None:
        self.k = k
        self.steps = 0
        self.frozen = False
        self.name = "mem"


class Appender(nn.Module):
    """A LayerNorm'd projection appended to a Memory it updates in place and returns, as HF caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, memory: Memory | None = None, *, scale: float = 1.0) -> dict:
        y = self.norm(self.proj(x) * scale + x)
        if memory is None:
            memory = Memory(y)
        else:
            memory.k = torch.cat([memory.k, y], dim=1)
        memory.steps += x.shape[1]
        return {"y": y, "memory": memory}


def test_objects_in_and_out_updated_in_place() -> None:
    torch.manual_seed(0)
    model = Appender().eval()
    x = torch.randn(2, 3, 8)
    fast = tkopt.compile(model, (x,), {"scale": 2.0})
    assert fast.tkopt_report.fusions["add_norm"] == 1
    first = fast(x, scale=2.0)
    want = model(x, scale=2.0)
    assert isinstance(first["memory"], Memory) and first["memory"].steps == 3 and first["memory"].name == "mem"
    torch.testing.assert_close(first["memory"].k, want["memory"].k)
    for step, s in enumerate((2, 3, 5)):
        mem_fast, mem_eager = first["memory"], want["memory"]
        x = torch.randn(2, s, 8)
        got, want = fast(x, mem_fast, scale=2.0), model(x, mem_eager, scale=2.0)
        assert got["memory"] is mem_fast  # the object passed in, updated in place, is what comes back
        assert mem_fast.steps == mem_eager.steps == 3 + sum((2, 3, 5)[: step + 1])
        torch.testing.assert_close(mem_fast.k, mem_eager.k)
        torch.testing.assert_close(got["y"], want["y"])
        first = got
    # one specialization without the memory, one with it: every later length and step count is symbolic
    assert len(fast.specializations) == 2


def test_self_referencing_object_is_one_clear_error() -> None:
    mem = Memory(torch.zeros(2, 1, 8))
    mem.me = mem
    with pytest.raises(ValueError, match="Memory: it refers back to itself"):
        tkopt.compile(Appender().eval(), (torch.randn(2, 3, 8), mem))


transformers = pytest.importorskip("transformers")
from tkopt.models.hf import tiny_model  # noqa: E402

# Decoder families from transformers, each with its default config but tiny sizes: learned positions and
# Conv1D linears (GPT-2), rotary with GQA and RMSNorm (Llama), a sliding-window cache with int state
# (Mistral), partial rotary in a parallel attention + MLP block (Phi), (1 + w) RMSNorm (Gemma), interleaved
# partial rotary (GPT-J). Qwen2, GPT-NeoX, OPT, StableLM, StarCoder2, OLMo, Granite, Mixtral, Falcon,
# Bloom, CodeGen, GPTBigCode, Qwen3, Phi-3, Gemma 2/3 decode the same way (checked once, not in CI).
DECODERS = ("gpt2", "llama", "mistral", "phi", "gemma", "gptj")


def _greedy(model: nn.Module, ids: torch.Tensor, steps: int = 3) -> tuple[torch.Tensor, object]:
    """`steps` greedy tokens, each step fed only the new token and the cache the last step returned."""
    tokens = []
    with torch.no_grad():
        out = model(ids)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            out = model(nxt, past_key_values=out.past_key_values)
    return torch.cat(tokens, 1), out


@pytest.mark.parametrize("model_type", DECODERS)
def test_decoder_greedy_decode_with_cache_matches_eager(model_type: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type, "AutoModelForCausalLM")
        ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
        fast = tkopt.compile(model, (ids,))
        want_tokens, want = _greedy(model, ids)
        got_tokens, got = _greedy(fast, ids)
    assert torch.equal(got_tokens, want_tokens)
    assert type(got) is type(want) and type(got.past_key_values) is type(want.past_key_values)
    assert got.past_key_values.get_seq_length() == want.past_key_values.get_seq_length() == 10
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    # prefill and one decode step cover every later cache length; both fuse attention
    assert len(fast.specializations) == 2
    assert all(s.report.fusions["attention"] == 2 for s in fast.specializations)


def test_decoder_keyword_inputs_and_cache_off() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("llama", "AutoModelForCausalLM")
        ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        fast = tkopt.compile(model, (), {"input_ids": ids, "attention_mask": mask, "use_cache": False})
        with torch.no_grad():
            got = fast(input_ids=ids, attention_mask=mask, use_cache=False)
            want = model(input_ids=ids, attention_mask=mask, use_cache=False)
            as_tuple = fast(input_ids=ids, attention_mask=mask, use_cache=False, return_dict=False)
    assert got.past_key_values is None and want.past_key_values is None
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], want.logits, rtol=1e-5, atol=1e-5)
