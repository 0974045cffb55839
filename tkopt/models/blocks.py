"""Small reference models, written out op by op the way real model code writes them.

They are the fixtures the fusion passes are written against: each one spells attention, norms,
activations and masks the way BERT / GPT-2 / Llama / ViT code does (not via fused library calls),
so a pass that fires here fires on the real thing. Shapes are tiny and every input has a dynamic
batch dim (0) and sequence dim (1). `REFERENCE_MODELS` builds each one deterministically (eval mode,
fixed seed); `EXPECTED_FUSIONS` says what a correct optimizer fuses in each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SEED = 0


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, H*D) -> (B, H, S, D) via view + transpose, as HF models do."""
    b, s, _ = x.shape
    return x.view(b, s, heads, -1).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H*D): transpose back, contiguous reshape."""
    b, _, s, _ = x.shape
    return x.transpose(1, 2).reshape(b, s, -1)


# ----------------------------------------------------------------------------------------- MLP


@dataclass
class MLPConfig:
    d_in: int = 64
    hidden: int = 128
    d_out: int = 64


class MLP(nn.Module):
    """Linear+bias+GELU, Linear+bias+ReLU, Linear: three GEMMs with activation epilogues."""

    def __init__(self, cfg: MLPConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or MLPConfig()
        self.fc1 = nn.Linear(cfg.d_in, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.hidden)
        self.fc3 = nn.Linear(cfg.hidden, cfg.d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)

    def example_inputs(self, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, seq, self.cfg.d_in),)


# ------------------------------------------------------------------------------------------ BERT


@dataclass
class BertLayerConfig:
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    eps: float = 1e-12


class BertLayer(nn.Module):
    """Post-norm encoder layer with an additive padding mask built from a 0/1 attention_mask."""

    def __init__(self, cfg: BertLayerConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or BertLayerConfig()
        h = cfg.hidden
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.eps)
        self.ffn_in = nn.Linear(h, cfg.ffn)
        self.ffn_out = nn.Linear(cfg.ffn, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        heads = self.cfg.heads
        q = _split_heads(self.query(x), heads)
        k = _split_heads(self.key(x), heads)
        v = _split_heads(self.value(x), heads)
        # HF's "extended attention mask": (B, S) 0/1 -> (B, 1, 1, S) additive, 0 keep / min drop.
        ext = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        # Constant scale, as HF BERT (GPT-2 below derives it from a shape, as HF GPT-2 does).
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.cfg.hidden // heads) + ext
        ctx = _merge_heads(scores.softmax(-1) @ v)
        x = self.attn_norm(self.attn_out(ctx) + x)
        ff = self.ffn_out(F.gelu(self.ffn_in(x)))
        return self.ffn_norm(ff + x)

    def example_inputs(self, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, ...]:
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, seq - max(1, seq // 4):] = 0  # padding at the end of the first sequence
        return torch.randn(batch, seq, self.cfg.hidden), mask


# ----------------------------------------------------------------------------------------- GPT-2


@dataclass
class GPT2BlockConfig:
    hidden: int = 64
    heads: int = 4
    max_seq: int = 64
    eps: float = 1e-5
    use_sdpa: bool = False


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's NewGELU, written out (what aten/ONNX see as Pow/Mul/Add/Tanh)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GPT2Block(nn.Module):
    """Pre-norm block: fused qkv Linear split in 3, causal mask from a tril buffer, tanh-GELU MLP.

    With `use_sdpa` attention is F.scaled_dot_product_attention(is_causal=True), as HF's sdpa path.
    """

    def __init__(self, cfg: GPT2BlockConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPT2BlockConfig()
        h = cfg.hidden
        self.ln_1 = nn.LayerNorm(h, eps=cfg.eps)
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h, eps=cfg.eps)
        self.c_fc = nn.Linear(h, 4 * h)
        self.mlp_proj = nn.Linear(4 * h, h)
        tril = torch.tril(torch.ones(cfg.max_seq, cfg.max_seq, dtype=torch.bool))
        self.register_buffer("bias", tril.view(1, 1, cfg.max_seq, cfg.max_seq), persistent=False)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.cfg.hidden, dim=2)
        heads = self.cfg.heads
        q, k, v = _split_heads(q, heads), _split_heads(k, heads), _split_heads(v, heads)
        if self.cfg.use_sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = q.shape[2]
            w = q @ k.transpose(-1, -2) / math.sqrt(v.shape[-1])
            w = torch.where(self.bias[:, :, :s, :s], w, torch.finfo(w.dtype).min)
            o = w.softmax(dim=-1) @ v
        return self.c_proj(_merge_heads(o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attn(self.ln_1(x))
        return x + self.mlp_proj(gelu_tanh(self.c_fc(self.ln_2(x))))

    def example_inputs(self, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, seq, self.cfg.hidden),)


# ----------------------------------------------------------------------------------------- Llama


@dataclass
class LlamaBlockConfig:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    eps: float = 1e-6
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: float32 mean of squares, rsqrt(+eps), cast back, times weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF repeat_kv: (B, KV, S, D) -> (B, KV*n_rep, S, D) via expand + reshape."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: RoPE, GQA (repeat_kv), causal additive mask, SwiGLU MLP; no biases."""

    def __init__(self, cfg: LlamaBlockConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LlamaBlockConfig()
        h, d = cfg.hidden, cfg.hidden // cfg.heads
        self.input_layernorm = RMSNorm(h, cfg.eps)
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.eps)
        self.gate_proj = nn.Linear(h, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(h, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, h, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        s = x.shape[1]
        q = _split_heads(self.q_proj(x), cfg.heads)
        k = _split_heads(self.k_proj(x), cfg.kv_heads)
        v = _split_heads(self.v_proj(x), cfg.kv_heads)
        pos = torch.arange(s, device=x.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        n_rep = cfg.heads // cfg.kv_heads
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        causal = torch.full((s, s), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)
        w = q @ k.transpose(2, 3) * (q.shape[-1] ** -0.5) + causal
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj(_merge_heads(w @ v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def example_inputs(self, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, seq, self.cfg.hidden),)


# ------------------------------------------------------------------------------------------- ViT


@dataclass
class ViTBlockConfig:
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    eps: float = 1e-6


class ViTBlock(nn.Module):
    """timm-style pre-norm block: fused qkv reshaped (B,N,3,H,D) and permuted, no mask, nn.GELU."""

    def __init__(self, cfg: ViTBlockConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or ViTBlockConfig()
        h = cfg.hidden
        self.norm1 = nn.LayerNorm(h, eps=cfg.eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=cfg.eps)
        self.fc1 = nn.Linear(h, cfg.ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.ffn, h)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        heads = self.cfg.heads
        qkv = self.qkv(x).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        w = (q * (q.shape[-1] ** -0.5)) @ k.transpose(-2, -1)
        o = w.softmax(dim=-1) @ v
        return self.proj(o.transpose(1, 2).reshape(b, n, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    def example_inputs(self, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, seq, self.cfg.hidden),)


# -------------------------------------------------------------------------------------- registry


def _perturb_norms(model: nn.Module) -> None:
    """Give norm weights/biases non-default values, so a fusion that drops or swaps them shows up
    numerically (and exporters cannot dedupe identical all-ones/all-zeros initializers)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, RMSNorm)):
                for p in m.parameters(recurse=False):
                    p.add_(0.1 * torch.randn_like(p))


def _build(cls: type[nn.Module], cfg: object | None = None) -> Callable[[], tuple[nn.Module, tuple]]:
    def make() -> tuple[nn.Module, tuple]:
        torch.manual_seed(SEED)
        model = cls(cfg).eval()
        _perturb_norms(model)
        return model, model.example_inputs()

    make.__doc__ = f"{cls.__name__} (seed {SEED}, eval mode) and its example inputs."
    return make


REFERENCE_MODELS: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "mlp": _build(MLP),
    "bert_layer": _build(BertLayer),
    "gpt2_block": _build(GPT2Block),
    "gpt2_block_sdpa": _build(GPT2Block, GPT2BlockConfig(use_sdpa=True)),
    "llama_block": _build(LlamaBlock),
    "vit_block": _build(ViTBlock),
}

# What a correct optimizer fuses in each model. "add_norm" counts every norm, with or without a
# residual (a plain norm is FusedAddNorm without residual). A Linear's residual add may go into the
# GEMM epilogue or into the following norm; either way the counts below are the same.
EXPECTED_FUSIONS: dict[str, dict[str, int]] = {
    # fc1+bias+gelu, fc2+bias+relu, fc3+bias: three GEMMs with epilogues; nothing else.
    "mlp": {"attention": 0, "add_norm": 0, "gemm": 3, "gemm_group": 0, "gated_mlp": 0},
    # q, k, v = 1 GEMM group (three projections of one input); out, ffn_in(+gelu), ffn_out = 3 GEMMs; 1 attention
    # with the additive padding mask; post-norm: LN(attn_out + x) and LN(ffn + x) = 2 add+LayerNorm (their Sums
    # are not used later).
    "bert_layer": {"attention": 1, "add_norm": 2, "gemm": 3, "gemm_group": 1, "gated_mlp": 0},
    # c_attn (one qkv GEMM, split after), c_proj, c_fc(+tanh-gelu), mlp_proj = 4 GEMMs; causal
    # attention (tril buffer + where); ln_1 has no residual (plain norm), ln_2 takes x + attn and its
    # Sum feeds the final residual = 2 add_norm. The last residual add rides on mlp_proj's epilogue.
    "gpt2_block": {"attention": 1, "add_norm": 2, "gemm": 4, "gemm_group": 0, "gated_mlp": 0},
    # Same block with attention as F.scaled_dot_product_attention(is_causal=True).
    "gpt2_block_sdpa": {"attention": 1, "add_norm": 2, "gemm": 4, "gemm_group": 0, "gated_mlp": 0},
    # q, k, v = 1 GEMM group; o, down = 2 GEMMs (gate/up belong to the gated MLP); silu(gate(h)) * up(h) = 1 gated
    # MLP; causal GQA attention (RoPE stays unfused, repeat_kv is absorbed or left before it);
    # input RMSNorm (no residual) + post-attention RMSNorm of x + attn (Sum used later) = 2 add_norm.
    "llama_block": {"attention": 1, "add_norm": 2, "gemm": 2, "gemm_group": 1, "gated_mlp": 1},
    # qkv (one GEMM), proj, fc1(+gelu), fc2 = 4 GEMMs; 1 non-causal unmasked attention (scale on q
    # before the matmul); norm1 plain, norm2 on x + attn = 2 add_norm.
    "vit_block": {"attention": 1, "add_norm": 2, "gemm": 4, "gemm_group": 0, "gated_mlp": 0},
}
