"""Decompositions tkopt traces Dynamo's graphs with, so the fusions see the ops they stand for.

torch's fused inference fast paths: in eval mode without autograd, nn.TransformerEncoderLayer and
nn.MultiheadAttention call aten._transformer_encoder_layer_fwd / aten._native_multi_head_attention,
one opaque op per layer, which Dynamo (and torch.export, for modules whose parameters need no grad)
records as is and no pass can fuse. These decompositions restate them op by op (projections,
attention, residual adds, LayerNorms, the feed-forward), reproducing what the native CPU/CUDA
kernels compute:
- q is scaled by 1/sqrt(head_dim) before Q K^T;
- the mask (bool, or float as nn.MultiheadAttention passes it after canonicalizing a bool mask) is
  read as "nonzero = masked out"; masked scores are -inf before a plain softmax, so a fully masked
  row gives NaN, as the native kernel does;
- mask_type: 0 a (L, S) mask, 1 a (B, S) key-padding mask, 2 a mask broadcastable to (B, H, L, S).
Without a mask and without returned weights the attention is SDPA; its default scale is the same.

aten._safe_softmax (SDPA's math path, taken in training when a float mask needs a gradient, as T5's
position bias does): softmax with rows of all -inf giving 0, written with the row guard the
attention pass knows (FusedAttention defines fully masked rows as 0 too).

`TRACE_DECOMPOSITIONS` feeds make_fx when the torch.compile backend traces Dynamo's graph. Before that,
Dynamo must trace the fast path itself: `ensure_fake_impls` gives it the fake (meta) implementation torch
2.13 has and 2.11 lacks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
aten = torch.ops.aten


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, L, H*D) -> (B, H, L, D)."""
    b, n, _ = x.shape
    return x.view(b, n, heads, -1).transpose(1, 2)


def _masked(mask: Tensor, mask_type: int | None, batch: int, heads: int, q_len: int, k_len: int) -> Tensor:
    """The native kernels' boolean "masked out" tensor, broadcastable to (B, H, L, S)."""
    masked = mask if mask.dtype == torch.bool else mask != 0
    if mask_type == 1:
        return masked.view(batch, 1, 1, k_len)
    if mask_type == 0:
        return masked.view(1, 1, q_len, k_len)
    return masked


def native_multi_head_attention(
    query: Tensor, key: Tensor, value: Tensor, embed_dim: int, num_head: int, qkv_weight: Tensor,
    qkv_bias: Tensor, proj_weight: Tensor, proj_bias: Tensor, mask: Tensor | None = None,
    need_weights: bool = True, average_attn_weights: bool = True, mask_type: int | None = None,
) -> tuple[Tensor, Tensor]:
    """aten._native_multi_head_attention: (output, attention weights or an empty tensor)."""
    wq, wk, wv = qkv_weight.chunk(3)
    bq, bk, bv = qkv_bias.chunk(3)
    q = _heads(F.linear(query, wq, bq), num_head)
    k = _heads(F.linear(key, wk, bk), num_head)
    v = _heads(F.linear(value, wv, bv), num_head)
    batch, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
    weights = query.new_empty(0)
    if mask is None and not need_weights:
        ctx = F.scaled_dot_product_attention(q, k, v)
    else:
        scores = (q / math.sqrt(embed_dim // num_head)) @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores.masked_fill(_masked(mask, mask_type, batch, num_head, q_len, k_len), float("-inf"))
        probs = scores.softmax(-1)
        ctx = probs @ v
        if need_weights:
            weights = probs.mean(1) if average_attn_weights else probs
    out = F.linear(ctx.transpose(1, 2).reshape(batch, q_len, embed_dim), proj_weight, proj_bias)
    return out, weights


def transformer_encoder_layer_fwd(
    src: Tensor, embed_dim: int, num_heads: int, qkv_weight: Tensor, qkv_bias: Tensor, proj_weight: Tensor,
    proj_bias: Tensor, use_gelu: bool, norm_first: bool, eps: float, norm_weight_1: Tensor, norm_bias_1: Tensor,
    norm_weight_2: Tensor, norm_bias_2: Tensor, ffn_weight_1: Tensor, ffn_bias_1: Tensor, ffn_weight_2: Tensor,
    ffn_bias_2: Tensor, mask: Tensor | None = None, mask_type: int | None = None,
) -> Tensor:
    """aten._transformer_encoder_layer_fwd: a post- or pre-norm encoder layer, as nn.TransformerEncoderLayer."""

    def norm1(x: Tensor) -> Tensor:
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x: Tensor) -> Tensor:
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    def attention(x: Tensor) -> Tensor:
        return native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                           proj_bias, mask, False, True, mask_type)[0]

    def ffn(x: Tensor) -> Tensor:
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(h) if use_gelu else F.relu(h), ffn_weight_2, ffn_bias_2)

    if norm_first:
        x = src + attention(norm1(src))
        return x + ffn(norm2(x))
    x = norm1(src + attention(src))
    return norm2(x + ffn(x))


def safe_softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """aten._safe_softmax: softmax, but 0 on rows whose inputs are all -inf (torch's own decomposition,
    all(x == -inf) spelled not(any(not(x == -inf))))."""
    p = torch.softmax(x, dim, dtype=dtype)
    masked_rows = torch.logical_not(torch.any(torch.logical_not(x == float("-inf")), dim, keepdim=True))
    return torch.where(masked_rows, torch.full_like(p, 0), p)


def _encoder_layer_meta(src: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """aten._transformer_encoder_layer_fwd's output on fake tensors: src's shape (torch 2.13's meta)."""
    if src.is_nested:
        raise NotImplementedError("_transformer_encoder_layer_fwd: no fake implementation for nested tensors")
    return src.clone() if src.numel() == 0 else torch.empty_like(src)


_FAKE_IMPLS: list[torch.library.Library] = []  # registrations stay only while their Library lives


def ensure_fake_impls() -> None:
    """Register a Meta kernel for aten._transformer_encoder_layer_fwd where torch has none (torch < 2.13).

    Without one, Dynamo cannot run the op on fake tensors: it breaks the graph at every
    nn.TransformerEncoderLayer in eval without autograd and runs the layer outside any backend, so
    torch.compile(backend="tkopt") never sees it. The kernel is torch 2.13's own; once registered it
    serves every backend in the process, as it does on torch 2.13."""
    name = "aten::_transformer_encoder_layer_fwd"
    if _FAKE_IMPLS or torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_transformer_encoder_layer_fwd", _encoder_layer_meta, "Meta")
    _FAKE_IMPLS.append(lib)


TRACE_DECOMPOSITIONS: dict[Any, Any] = {
    aten._native_multi_head_attention.default: native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer_fwd,
    aten._safe_softmax.default: safe_softmax,
}
