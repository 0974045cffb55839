"""conv2d (groups=1) as an implicit GEMM in TileLang, with bias + activation epilogue.

Public API (semantics: tkopt/kernels/reference.py conv2d_ref):
    conv2d(x, w, bias=None, act=None, stride=1, padding=0, dilation=1, *, arch=None)
x is NCHW as torch gives it and the result is NCHW-shaped. Inside, the kernel works in NHWC: x is
converted with permute(0, 2, 3, 1).contiguous() (free when x is already channels_last), and the output is
produced as a contiguous NHWC buffer returned as its NCHW permuted view (i.e. channels_last memory format).
The weight (F, C, KH, KW) is rearranged to a (KH*KW*C, F) GEMM operand, zero-padded to the tile sizes.

GEMM view: M = N*OH*OW (rows = output pixels), N_gemm = F (out channels), K = KH*KW*C ordered (kh, kw, c).
The A tile is gathered (im2col) from the NHWC image straight into shared memory, guarded for padding and
tails; when C % block_K == 0 every K tile has one fixed (kh, kw) and a contiguous channel run, so the
gather is 128-bit vectorized. The batch N is a dynamic dim (one kernel for all batch sizes).

Program builders:
    conv2d_program_gpu(c, h, w, f, kh, kw, stride, padding, dilation, dtype, act, has_bias,
                       block_m, block_n, block_k, num_stages, threads)
        signature (X: (n, H, W, C), Wt: (Kp, Fp), Bias: (Fp,), Y: (n*OH*OW, F))
    conv2d_program_cpu(same shape keys, dtype, act, has_bias)   # serial direct convolution, same signature
"""

import torch

from .activations import activation
from .arch import UnsupportedError, arch_of
from .constants import const
from .norm import (
    CPU_DTYPES,
    GPU_DTYPES,
    _ceil_to,
    _pick_config,
    acc_dtype,
    compile_cached,
    tl_dtype,
)
from .reference import ACTIVATIONS
from .tuning import median_ms, tuning_suspended


def _pair(v, name):
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(a, int) for a in v):
        return tuple(v)
    raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")


def _out_hw(h, w, kh, kw, stride, padding, dilation):
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return oh, ow


def _all(T, *conds):
    out = conds[0]
    for c in conds[1:]:
        out = T.And(out, c)
    return out


def conv2d_program_gpu(c, h, w, f, kh, kw, stride, padding, dilation, dtype, act, has_bias,
                       block_m=128, block_n=128, block_k=64, num_stages=3, threads=256):
    import tilelang.language as T

    acc = "float32"
    oh, ow = _out_hw(h, w, kh, kw, stride, padding, dilation)
    k_total = kh * kw * c
    kp = _ceil_to(k_total, block_k)
    fp = _ceil_to(f, block_n)
    n = T.dynamic("n")
    m_total = n * oh * ow
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    fast_k = c % block_k == 0
    c_tiles = c // block_k if fast_k else 0

    @T.prim_func
    def main(
        X: T.Tensor((n, h, w, c), dtype),
        Wt: T.Tensor((kp, fp), dtype),
        Bias: T.Tensor((fp,), dtype),
        Y: T.Tensor((n * oh * ow, f), dtype),
    ):
        with T.Kernel(T.ceildiv(fp, block_n), T.ceildiv(m_total, block_m), threads=threads) as (bx, by):
            a_s = T.alloc_shared((block_m, block_k), dtype)
            b_s = T.alloc_shared((block_k, block_n), dtype)
            c_l = T.alloc_fragment((block_m, block_n), acc)
            c_s = T.alloc_shared((block_m, block_n), dtype)
            T.clear(c_l)
            for ko in T.Pipelined(kp // block_k, num_stages=num_stages):
                for i, kk in T.Parallel(block_m, block_k):
                    mi = by * block_m + i
                    nb = mi // (oh * ow)
                    rem = mi % (oh * ow)
                    oy = rem // ow
                    ox = rem % ow
                    if fast_k:
                        tap = ko // c_tiles
                        ci = (ko % c_tiles) * block_k + kk
                        ty = tap // kw
                        tx = tap % kw
                    else:
                        kidx = ko * block_k + kk
                        tap = kidx // c
                        ci = kidx % c
                        ty = tap // kw
                        tx = tap % kw
                    iy = oy * sh - ph + ty * dh
                    ix = ox * sw - pw + tx * dw
                    inb = _all(T, iy >= 0, iy < h, ix >= 0, ix < w, mi < m_total)
                    if not fast_k:
                        inb = T.And(inb, kidx < k_total)
                    a_s[i, kk] = T.if_then_else(inb, X[nb, iy, ix, ci], T.cast(0, dtype))
                T.copy(Wt[ko * block_k, bx * block_n], b_s)
                T.gemm(a_s, b_s, c_l)
            for i, j in T.Parallel(block_m, block_n):
                v = c_l[i, j]
                if has_bias:
                    v = v + T.Cast(acc, Bias[bx * block_n + j])
                c_s[i, j] = T.Cast(dtype, activation(v, act, "float32", dtype, cuda=True))
            for i, j in T.Parallel(block_m, block_n):
                if T.And(by * block_m + i < m_total, bx * block_n + j < f):
                    Y[by * block_m + i, bx * block_n + j] = c_s[i, j]

    return main


def conv2d_program_cpu(c, h, w, f, kh, kw, stride, padding, dilation, dtype, act, has_bias):
    """Serial direct convolution (C backend), same signature as the GPU program with kp=K, fp=F."""
    import tilelang.language as T
    from tilelang.cpu.language import Kernel

    acc = acc_dtype(dtype)
    oh, ow = _out_hw(h, w, kh, kw, stride, padding, dilation)
    k_total = kh * kw * c
    n = T.dynamic("n")
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation

    @T.prim_func
    def main(
        X: T.Tensor((n, h, w, c), dtype),
        Wt: T.Tensor((k_total, f), dtype),
        Bias: T.Tensor((f,), dtype),
        Y: T.Tensor((n * oh * ow, f), dtype),
    ):
        with Kernel(n * oh * ow) as mi:
            accv = T.alloc_local((1,), acc)
            nb = mi // (oh * ow)
            oy = (mi % (oh * ow)) // ow
            ox = mi % ow
            for fo in T.serial(f):
                accv[0] = const(0, acc)
                for ty, tx, ci in T.grid(kh, kw, c):
                    iy = oy * sh - ph + ty * dh
                    ix = ox * sw - pw + tx * dw
                    if _all(T, iy >= 0, iy < h, ix >= 0, ix < w):
                        accv[0] += T.Cast(acc, X[nb, iy, ix, ci]) * T.Cast(acc, Wt[(ty * kw + tx) * c + ci, fo])
                if has_bias:
                    accv[0] += T.Cast(acc, Bias[fo])
                Y[mi, fo] = T.Cast(dtype, activation(accv[0], act, acc, dtype))

    return main


def default_conv_config(c: int, f: int, k_total: int, dtype: str, arch: str) -> dict:
    bk = 32 if dtype == "float32" else 64
    if c % bk and c % 32 == 0:
        bk = 32
    bn = 128 if f >= 128 else 64
    return {"block_m": 128, "block_n": bn, "block_k": bk, "num_stages": 3, "threads": 256}


def conv_candidates(c, f, k_total, dtype, arch) -> list[dict]:
    d = default_conv_config(c, f, k_total, dtype, arch)
    out = [d, {**d, "num_stages": 4}]
    if f >= 256:
        out.append({**d, "block_n": 256, "num_stages": 3})
    out.append({**d, "block_m": 64, "threads": 128})
    return out


_cfg_cache: dict[tuple, dict] = {}


def _weight_operand(w: torch.Tensor, kp: int, fp: int) -> torch.Tensor:
    """(F, C, KH, KW) -> zero-padded (Kp, Fp) with K ordered (kh, kw, c), rebuilt on every call.

    Not cached: a cache keyed by the weight's address and version handed a new weight, allocated where
    a freed one had been (version 0 again), the freed weight's values (the H200 "sm80 variant" failures
    of 2026-11-30), and writes through `.data` do not bump the version either. One copy of the weight
    per call is the price of never computing with stale weights.
    """
    f, c, kh, kw = w.shape
    wk = w.permute(2, 3, 1, 0).reshape(kh * kw * c, f)
    if kp == wk.shape[0] and fp == f:
        return wk.contiguous()
    out = torch.zeros(kp, fp, dtype=w.dtype, device=w.device)
    out[: wk.shape[0], :f] = wk
    return out


def conv2d(x, w, bias=None, act=None, stride=1, padding=0, dilation=1, groups: int = 1, *,
           out: torch.Tensor | None = None, arch: str | None = None):
    """act(conv2d(x, w) + bias) for NCHW x and (F, C, KH, KW) w; returns NCHW (channels_last memory).

    act: None or a GEMM activation ("relu", "gelu", ...). groups=1 only. GPU: fp16/bf16/fp32; cpu: fp32/fp64.
    `out`: optional preallocated contiguous NHWC (N, OH, OW, F) buffer; the result is its NCHW view.

    >>> import torch
    >>> from tkopt.kernels import conv2d
    >>> x, w, b = torch.randn(2, 3, 9, 9), torch.randn(8, 3, 3, 3), torch.randn(8)
    >>> y = conv2d(x, w, b, act="relu", stride=2, padding=1)
    >>> torch.allclose(y, torch.relu(torch.nn.functional.conv2d(x, w, b, stride=2, padding=1)), atol=1e-4)
    True
    """
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if groups != 1:
        raise UnsupportedError(f"conv2d: groups={groups} is not supported (only groups=1)")
    if x.dim() != 4 or w.dim() != 4:
        raise ValueError(f"conv2d expects 4-d x (N, C, H, W) and w (F, C, KH, KW), got {x.dim()}-d and {w.dim()}-d")
    if act not in ACTIVATIONS and act != "none":
        raise ValueError(f"unknown activation {act!r}; expected one of {ACTIVATIONS}")
    stride, padding, dilation = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise ValueError(f"conv2d: bad stride {stride} / padding {padding} / dilation {dilation}")
    nb, c, h, wd = x.shape
    f, cw, kh, kw = w.shape
    if cw != c:
        if c % cw == 0:
            raise UnsupportedError(f"conv2d: grouped convolution (x has {c} channels, w has {cw}) is not supported")
        raise ValueError(f"conv2d: w has {cw} input channels but x has {c}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w ({w.dtype}, {w.device}) must match x ({x.dtype}, {x.device})")
    if bias is not None and (bias.shape != (f,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be a ({f},) {x.dtype} tensor on {x.device}, got {tuple(bias.shape)} {bias.dtype}")
    arch = arch_of(x, arch)
    allowed = CPU_DTYPES if arch == "cpu" else GPU_DTYPES
    if x.dtype not in allowed:
        raise UnsupportedError(f"conv2d on {arch}: dtype {x.dtype} not supported (supported: {allowed})")
    oh, ow = _out_hw(h, wd, kh, kw, stride, padding, dilation)
    if oh <= 0 or ow <= 0:
        raise ValueError(f"conv2d: output size ({oh}, {ow}) is empty for input ({h}, {wd}) and kernel ({kh}, {kw})")
    if out is not None and (out.shape != (nb, oh, ow, f) or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous NHWC {x.dtype} tensor of shape {(nb, oh, ow, f)} on {x.device}")
    y = out if out is not None else torch.empty(nb, oh, ow, f, dtype=x.dtype, device=x.device)
    if nb == 0 or f == 0:
        return y.permute(0, 3, 1, 2)
    if c == 0:
        raise ValueError("conv2d: x has zero channels")
    xh = x.permute(0, 2, 3, 1)
    if not xh.is_contiguous():
        xh = xh.contiguous()
    dt = tl_dtype(x.dtype)
    act_key = None if act == "none" else act
    k_total = kh * kw * c
    shape_key = (c, h, wd, f, kh, kw, stride, padding, dilation)
    if arch == "cpu":
        wk = w.permute(2, 3, 1, 0).reshape(k_total, f).contiguous()
        bb = bias.contiguous() if bias is not None else wk[0]
        key = ("conv2d", *shape_key, dt, act_key, bias is not None, "cpu")
        kern = compile_cached(key, "cpu", lambda: conv2d_program_cpu(*shape_key, dt, act_key, bias is not None))
        kern(xh, wk, bb, y.view(-1, f))
        return y.permute(0, 3, 1, 2)

    ck = (*shape_key, dt, act_key, bias is not None, arch)
    cfg = _cfg_cache.get(ck)
    if cfg is None:
        default = default_conv_config(c, f, k_total, dt, arch)

        def bench(cf):
            kp_, fp_ = _ceil_to(k_total, cf["block_k"]), _ceil_to(f, cf["block_n"])
            a = _launch_args(xh, w, bias, y, kp_, fp_, f)
            kern_ = _gpu_kernel(shape_key, dt, act_key, bias is not None, arch, cf)
            return median_ms(lambda: kern_(*a))

        cfg = _pick_config("conv2d", arch, ck, conv_candidates(c, f, k_total, dt, arch), default, bench)
        if not tuning_suspended():  # a config picked while tuning is suspended is not final
            _cfg_cache[ck] = cfg
    kp, fp = _ceil_to(k_total, cfg["block_k"]), _ceil_to(f, cfg["block_n"])
    args = _launch_args(xh, w, bias, y, kp, fp, f)
    _gpu_kernel(shape_key, dt, act_key, bias is not None, arch, cfg)(*args)
    return y.permute(0, 3, 1, 2)


def _launch_args(xh, w, bias, y, kp, fp, f):
    wk = _weight_operand(w, kp, fp)
    if bias is None:
        bb = wk[0]
    elif fp != f:
        bb = torch.zeros(fp, dtype=bias.dtype, device=bias.device)
        bb[:f] = bias
    else:
        bb = bias.contiguous()
    return xh, wk, bb, y.view(-1, f)


def _gpu_kernel(shape_key, dt, act_key, has_bias, arch, cfg):
    key = ("conv2d", *shape_key, dt, act_key, has_bias, arch, tuple(sorted(cfg.items())))
    return compile_cached(key, arch, lambda: conv2d_program_gpu(*shape_key, dt, act_key, has_bias, **cfg))
