"""Torch references for every kernel: the single statement of what each fused op computes.

The TileLang kernels are tested against these, and the graph side's fused nodes run them when no
kernel is used (verification, fallback). Math is done in float32 (float64 stays float64) and the
result is cast back to the input dtype, which is also what the kernels do (fp32 accumulate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid")


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def apply_activation(y: torch.Tensor, act: str | None) -> torch.Tensor:
    """The epilogue activations the fused GEMM supports, by name."""
    if act is None or act == "none":
        return y
    if act == "relu":
        return torch.relu(y)
    if act == "gelu":
        return F.gelu(y)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if act == "silu":
        return F.silu(y)
    if act == "sigmoid":
        return torch.sigmoid(y)
    raise ValueError(f"unknown activation {act!r}; expected one of {ACTIVATIONS}")


def gemm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    residual: torch.Tensor | None = None,
    b_transposed: bool = False,
) -> torch.Tensor:
    """act(a @ b + bias) + residual. `b` is (K, N), or (N, K) when `b_transposed` (a linear weight).

    `a` may have leading batch dims; bias broadcasts over the last dim (N); residual has the output shape.
    """
    w = _acc(b).transpose(-1, -2) if b_transposed else _acc(b)
    y = _acc(a) @ w
    if bias is not None:
        y = y + _acc(bias)
    y = apply_activation(y, act)
    if residual is not None:
        y = y + _acc(residual)
    return y.to(a.dtype)


def gemm_group_ref(
    a: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    b_transposed: bool = False,
) -> list[torch.Tensor]:
    """[a @ w + b] for each weight and bias: the GEMMs a grouped GEMM computes in one kernel."""
    biases = [None] * len(weights) if biases is None else biases
    return [gemm_ref(a, w, b, b_transposed=b_transposed) for w, b in zip(weights, biases, strict=True)]


def gated_mlp_ref(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    act: str = "silu",
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    weights_transposed: bool = False,
) -> torch.Tensor:
    """act(x @ Wg + bg) * (x @ Wu + bu): SwiGLU (act="silu") and GeGLU (act="gelu"/"gelu_tanh")."""
    g = gemm_ref(_acc(x), w_gate, b_gate, act, b_transposed=weights_transposed)
    u = gemm_ref(_acc(x), w_up, b_up, None, b_transposed=weights_transposed)
    return (g * u).to(x.dtype)


GUARDS = ("none", "masked", "nan", "sdpa")
# The reference attends at most this many scores at a time: query rows are independent, so it takes them in blocks,
# and its memory stays bounded at any length (a probe of Llama-style attention at 131072 keys would need 1 TiB of
# scores at once).
SCORE_BLOCK = 1 << 26


def sdpa_flash_on_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's SDPA, called without a mask on these CPU tensors (4-D, either layout: the head transpose
    keeps the last stride), runs its flash kernel, whose answer for a query row whose every score is NaN or -inf
    is its own (`sdpa_eager`). Its math fallback (3-D inputs, a last dim that is not contiguous, flash switched
    off) gives NaN for a row of NaN, as every CUDA backend does."""
    return (q.device.type == "cpu" and q.dim() == 4 and all(t.stride(-1) == 1 for t in (q, k, v))
            and torch.backends.cuda.flash_sdp_enabled())


def sdpa_dead_rows(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None, layout: str) -> torch.Tensor:
    """The query rows (a size-1 last dim, in q's layout) whose every score, scaled and with the causal keys dropped,
    is NaN or -inf: where torch's CPU flash SDPA gives what `sdpa_eager` gives."""
    if layout == "bshd":
        q, k = (t.transpose(1, 2) for t in (q, k))
    s = _scaled_scores(q, _with_heads(k, q.shape[1]), scale)
    dead = _nan_or_neg_inf_rows(_drop_later_keys(s) if causal else s)
    return dead.transpose(1, 2) if layout == "bshd" else dead


def sdpa_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
               layout: str) -> torch.Tensor:
    """torch's own SDPA on these inputs, in their layout: what the rows `sdpa_dead_rows` names take where its CPU
    flash kernel runs. That kernel gives 0 for a row of -inf, but for a row of NaN it gives 0 only where the row's
    max skips the NaN: the max is vectorized and propagates NaN, its scalar tail skips it, so the answer depends on
    the key count, the dtype and the CPU's vector width (a float32 row of 8 keys: NaN on an AVX2 CPU, where 7 keys
    give 0; an AVX-512 CPU's vectors hold twice as many). Asking torch is the one model that holds on every CPU and
    torch version."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2) if layout == "bshd" else out


def _with_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A bhsd key or value tensor with `heads` heads (GQA: kv head h // group serves query head h)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q k^T * scale (1/sqrt(head_dim) by default), bhsd, accumulated in at least float32."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (_acc(q) @ _acc(k).transpose(-1, -2)) * scale


def _drop_later_keys(s: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """Scores with the keys after each query (top-left causal) at -inf; `s` holds the query rows from
    `first_row` on."""
    keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril(first_row)
    return s.masked_fill(~keep, float("-inf"))


def _nan_or_neg_inf_rows(s: torch.Tensor) -> torch.Tensor:
    return (s.isnan() | (s == float("-inf"))).all(-1, keepdim=True)


def flash_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    layout: str = "bhsd",
    mask_scale: float = 1.0,
    mask_fill: float = float("-inf"),
    guard: str = "masked",
    mask_keeps: bool = True,
) -> torch.Tensor:
    """softmax(T) v per head, T the scaled scores with the mask applied; every edge as eager computes it.

    layout "bhsd": (batch, heads, seq, dim); "bshd": (batch, seq, heads, dim); output as q.
    GQA: k/v may have fewer heads than q, dividing it (head h of q reads kv head h // group).
    T = q k^T * scale (scale defaults to 1/sqrt(head_dim)), then a mask broadcastable to (B, Hq, Sq, Skv):
    a float mask is added, and the sum then scaled by mask_scale (the scale a graph applies after adding
    it: (S * scale + M) * mask_scale, in that order, which is what eager rounds); a bool mask keeps where
    it equals mask_keeps (True; False for masked_fill's mask) and
    sets T to mask_fill elsewhere (a finite fill stays
    finite: a row whose every key is masked then weighs them all equally, as eager does).
    causal: query i sees keys j <= i (top-left, as torch SDPA's is_causal); later keys get no weight
    whatever their score.
    guard: a row whose every T is -inf is NaN under plain softmax ("none"), 0 under SDPA's safe softmax
    ("masked"); "nan" zeroes every NaN probability (the dynamo exporter's Where(IsNaN(p), 0, p)), so rows
    with a NaN or +inf score give 0 too; "sdpa" is torch's SDPA called without a mask: "masked", and where its
    CPU flash kernel runs (`sdpa_flash_on_cpu`) a row whose every T is NaN or -inf gives what that kernel gives
    (`sdpa_eager`: the reference takes those rows from it). NaN and inf otherwise propagate as in eager (p @ v
    reads every key).
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if guard not in GUARDS:
        raise ValueError(f"guard must be one of {GUARDS}, got {guard!r}")
    cpu_flash = guard == "sdpa" and mask is None and sdpa_flash_on_cpu(q, k, v)  # the inputs as SDPA gets them
    inputs, dead = (q, k, v), []  # dead: per block of rows, those whose every score is NaN or -inf
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    k, v = _acc(_with_heads(k, hq)), _acc(_with_heads(v, hq))  # once, not per block of rows
    rows = max(1, SCORE_BLOCK // max(1, q.shape[0] * hq * k.shape[-2]))

    def attend(r: int) -> torch.Tensor:  # query rows r, r + 1, ... r + rows - 1
        s = _scaled_scores(q[..., r:r + rows, :], k, scale)
        if mask is not None:
            m = mask[..., r:r + rows, :] if mask.dim() > 1 and mask.shape[-2] > 1 else mask
            s = s.masked_fill(m != mask_keeps, mask_fill) if m.dtype == torch.bool else (s + _acc(m)) * mask_scale
        if causal:
            s = _drop_later_keys(s, r)
        if cpu_flash:
            dead.append(_nan_or_neg_inf_rows(s))
        p = torch.softmax(s, dim=-1)
        if guard in ("masked", "sdpa"):
            p = p.masked_fill((s == float("-inf")).all(-1, keepdim=True), 0.0)
        elif guard == "nan":
            p = p.masked_fill(p.isnan(), 0.0)
        return (p @ v).to(q.dtype)

    o = torch.cat([attend(r) for r in range(0, max(q.shape[-2], 1), rows)], dim=-2)
    o = o.transpose(1, 2) if layout == "bshd" else o
    if cpu_flash:  # without a branch on the values, so that the reference traces (training graphs run it)
        dead = torch.cat(dead, dim=-2)
        dead = dead.transpose(1, 2) if layout == "bshd" else dead
        o = torch.where(dead, sdpa_eager(*inputs, causal, scale, layout), o)
    return o


def add_layer_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(x + residual) over the last dim, x + residual)."""
    s = _acc(x) if residual is None else _acc(x) + _acc(residual)
    mean = s.mean(-1, keepdim=True)
    var = (s - mean).pow(2).mean(-1, keepdim=True)
    y = (s - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * _acc(weight)
    if bias is not None:
        y = y + _acc(bias)
    return y.to(x.dtype), s.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) over the last dim, x + residual)."""
    s = _acc(x) if residual is None else _acc(x) + _acc(residual)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * _acc(weight)
    return y.to(x.dtype), s.to(x.dtype)


def layer_norm_ref(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    return add_layer_norm_ref(x, None, weight, bias, eps)[0]


def rms_norm_ref(x, weight, eps: float = 1e-6) -> torch.Tensor:
    return add_rms_norm_ref(x, None, weight, eps)[0]


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(_acc(x), dim=dim).to(x.dtype)


def conv2d_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
) -> torch.Tensor:
    """act(conv2d(x, w) + bias), NCHW in and out as torch gives it."""
    b = None if bias is None else _acc(bias)
    y = F.conv2d(_acc(x), _acc(w), b, stride=stride, padding=padding, dilation=dilation)
    return apply_activation(y, act).to(x.dtype)
