"""Tiny Hugging Face models with random weights (no downloads).

The real modelling code is what users feed the optimizer, so the passes are checked against it.
`hf_bert`, `hf_gpt2` and `hf_llama` return (model in eval mode, example inputs), the model wrapped
(`TensorsIn`) so that forward takes (input_ids, attention_mask) tensors and returns the last hidden
state tensor only: no KV cache (use_cache=False) and no output dataclass, which keeps torch.export
and both ONNX exporters on the plain tensor path. `tiny_config` shrinks any transformers family's default config
(everything else stays at its default, caches and output dataclasses included), for models used as
users use them. transformers is a test extra, imported lazily.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

SEED = 0
VOCAB = 128
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "tkopt.models.hf needs the 'transformers' package (pip install 'tkopt[test]')"
        ) from e
    return transformers


def example_inputs(batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and an all-ones int64 attention mask (padding would differ between
    attention implementations only at padded positions, which are garbage by design)."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ids, torch.ones(batch, seq, dtype=torch.int64)


# Small sizes under the names transformers' configs use (directly or through their attribute_map);
# a config takes the ones its __init__ knows. rotary_dim (GPT-J, CodeGen) stays below head_dim 16.
TINY = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128, "ffn_dim": 128,
    "word_embed_proj_dim": 64, "max_position_embeddings": 128, "rotary_dim": 8,
    # encoder-decoder families (BART, Marian, Whisper) size each side apart; num_hidden_layers maps to one
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """`model_type`'s default transformers config with the TINY sizes it has a parameter for."""
    tf = _transformers()
    cls = tf.AutoConfig.for_model(model_type).__class__
    known = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))
    return cls(**{**{k: v for k, v in TINY.items() if k in known}, **overrides})


def tiny_model(model_type: str, auto_class: str = "AutoModel", **overrides: Any) -> nn.Module:
    """A 2-layer `model_type` model from `tiny_config` through transformers' `auto_class`, eval mode, seeded."""
    tf = _transformers()
    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(SEED)
    return getattr(tf, auto_class).from_config(cfg).eval()


class TensorsIn(nn.Module):
    """A transformers model called with named tensors given positionally, returning its first output:
    the form both ONNX exporters take. `input_names` and `dynamic_axes` tell tkopt.models.export how
    to name the inputs and which of their dims are dynamic; `kwargs` go to every call."""

    def __init__(self, model: nn.Module, input_names: list[str], dynamic_axes: dict | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.dynamic_axes = dynamic_axes or {}
        self.kwargs = kwargs
        # Position embeddings cap the sequence length; tkopt.models.export reads this for Dim("seq").
        self.max_seq = getattr(model.config, "max_position_embeddings", None)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.input_names, tensors, strict=True)), return_dict=False, **self.kwargs)[0]


def _finish(model: nn.Module) -> tuple[nn.Module, tuple]:
    return TensorsIn(model, ["input_ids", "attention_mask"], use_cache=False).eval(), example_inputs()


def _check_impl(attn_implementation: str) -> None:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")


def hf_bert(attn_implementation: str = "eager") -> tuple[nn.Module, tuple]:
    """2-layer BertModel, hidden 64, 4 heads (post-norm, erf GELU, padding mask)."""
    _check_impl(attn_implementation)
    tf = _transformers()
    cfg = tf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, attn_implementation=attn_implementation,
    )
    torch.manual_seed(SEED)
    return _finish(tf.BertModel(cfg, add_pooling_layer=False))


def hf_gpt2(attn_implementation: str = "eager") -> tuple[nn.Module, tuple]:
    """2-layer GPT2Model, hidden 64, 4 heads (pre-norm, Conv1D linears, tanh GELU, causal)."""
    _check_impl(attn_implementation)
    tf = _transformers()
    cfg = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(SEED)
    return _finish(tf.GPT2Model(cfg))


def hf_llama(attn_implementation: str = "eager") -> tuple[nn.Module, tuple]:
    """2-layer LlamaModel, hidden 64, 4 heads / 2 KV heads (RMSNorm, RoPE, GQA, SwiGLU, causal)."""
    _check_impl(attn_implementation)
    tf = _transformers()
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=128, attn_implementation=attn_implementation,
    )
    torch.manual_seed(SEED)
    return _finish(tf.LlamaModel(cfg))


HF_MODELS = {"hf_bert": hf_bert, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama}
# What a correct optimizer fuses in each (2 layers), from every frontend.
EXPECTED_FUSIONS: dict[str, dict[str, int]] = {
    # per layer q, k, v = 1 GEMM group; attn-out, ffn-in(+gelu), ffn-out = 3 GEMMs; embedding LN + 2 post-norms
    # per layer.
    "hf_bert": {"attention": 2, "add_norm": 5, "gemm": 6, "gemm_group": 2, "gated_mlp": 0},
    # per layer c_attn (qkv in one weight), c_proj, c_fc(+gelu_tanh), mlp c_proj = 4 GEMMs; ln_1, ln_2 per layer +
    # ln_f.
    "hf_gpt2": {"attention": 2, "add_norm": 5, "gemm": 8, "gemm_group": 0, "gated_mlp": 0},
    # per layer q, k, v = 1 GEMM group, o, down = 2 GEMMs and 1 SwiGLU; 2 RMSNorms per layer + the final norm; GQA.
    "hf_llama": {"attention": 2, "add_norm": 5, "gemm": 4, "gemm_group": 2, "gated_mlp": 2},
}
