"""Softmax as a TileLang kernel (semantics: tkopt/kernels/reference.py softmax_ref).

Public API:
    softmax(x, dim=-1, *, out=None, arch=None)
`dim` other than the last is handled by moving it last (movedim + contiguous copy), running the last-dim
kernel and moving it back: the result is then a permuted view of a contiguous buffer.

Program builders (dynamic row count m = T.dynamic("m"), signature (X, Y), both (m, n) in dtype):
    softmax_program_gpu(n, dtype, *, block_rows, threads_per_row)   # row resident in registers
    softmax_program_cpu(n, dtype)
GPU: same template and register layout (norm.row_fragment) as the norms (tkopt/kernels/norm.py): 128-bit loads, fp32
max / exp / sum from registers, one read and one write per element; n up to norm.MAX_N_GPU.
"""

import torch

from .arch import UnsupportedError, arch_of
from .constants import const
from .norm import (
    CPU_DTYPES,
    GPU_DTYPES,
    MAX_N_GPU,
    _ceil_to,
    _pick_config,
    acc_dtype,
    compile_cached,
    default_norm_config,
    in_bounds,
    norm_candidates,
    read_row,
    row_fragment,
    tl_dtype,
)
from .tuning import median_ms, tuning_suspended

_LOG2E = 1.4426950408889634


def softmax_program_gpu(n: int, dtype: str, *, block_rows: int, threads_per_row: int):
    import tilelang.language as T

    acc = "float32"
    elem = 4 if dtype == "float32" else 2
    vec = 16 // elem
    np_ = _ceil_to(n, vec * threads_per_row)
    threads = block_rows * threads_per_row
    col_guard = np_ != n
    row_guard = block_rows > 1
    m = T.dynamic("m")

    ok = in_bounds(m, n, col_guard, row_guard)
    read = read_row(m, n, col_guard, row_guard)

    @T.prim_func
    def main(X: T.Tensor((m, n), dtype), Y: T.Tensor((m, n), dtype)):
        with T.Kernel(T.ceildiv(m, block_rows), threads=threads) as bx:
            s = T.alloc_fragment((block_rows, np_), acc)
            mx = T.alloc_fragment((block_rows,), acc)
            sm = T.alloc_fragment((block_rows,), acc)
            # row i on threads [i*tpr, (i+1)*tpr), np_/tpr registers each (inference alone can replicate rows:
            # see norm.row_fragment)
            T.annotate_layout({s: row_fragment(block_rows, np_, vec, threads_per_row)})
            for i, j in T.Parallel(block_rows, np_):
                s[i, j] = T.Cast(acc, read(X, bx * block_rows + i, j, -T.infinity(dtype)))
            T.reduce_max(s, mx, dim=1)
            for i in T.Parallel(block_rows):
                # a row of all -inf gives NaN, as torch does; (rows beyond m are never stored)
                mx[i] = mx[i] * const(_LOG2E, acc)
            for i, j in T.Parallel(block_rows, np_):
                s[i, j] = T.exp2(s[i, j] * const(_LOG2E, acc) - mx[i])
            T.reduce_sum(s, sm, dim=1)
            for i in T.Parallel(block_rows):
                sm[i] = T.float32(1) / sm[i]
            for i, j in T.Parallel(block_rows, np_):
                row = bx * block_rows + i
                if col_guard or row_guard:
                    if ok(row, j):
                        Y[row, j] = T.Cast(dtype, s[i, j] * sm[i])
                else:
                    Y[row, j] = T.Cast(dtype, s[i, j] * sm[i])

    return main


def softmax_program_cpu(n: int, dtype: str):
    import tilelang.language as T
    from tilelang.cpu.language import Kernel

    acc = acc_dtype(dtype)
    m = T.dynamic("m")

    @T.prim_func
    def main(X: T.Tensor((m, n), dtype), Y: T.Tensor((m, n), dtype)):
        with Kernel(m) as bx:
            st = T.alloc_local((2,), acc)
            st[0] = T.Cast(acc, X[bx, 0])
            for j in T.serial(n):
                # if_then_else, not T.max: the C vectorizer can emit a max over vectors gcc rejects
                st[0] = T.if_then_else(T.Cast(acc, X[bx, j]) > st[0], T.Cast(acc, X[bx, j]), st[0])
            st[1] = T.cast(0, acc)
            for j in T.serial(n):
                st[1] += T.exp(T.Cast(acc, X[bx, j]) - st[0])
            st[1] = T.cast(1, acc) / st[1]
            for j in T.serial(n):
                Y[bx, j] = T.Cast(dtype, T.exp(T.Cast(acc, X[bx, j]) - st[0]) * st[1])

    return main


_cfg_cache: dict[tuple, dict] = {}


def _kernel_for(n, dtype, arch, cfg):
    key = ("softmax", n, dtype, arch, tuple(sorted(cfg.items())))
    return compile_cached(key, arch, lambda: softmax_program_gpu(n, dtype, **cfg))


def get_softmax_kernel(n: int, dtype: str, arch: str, args=None):
    if arch == "cpu":
        return compile_cached(("softmax", n, dtype, "cpu"), "cpu", lambda: softmax_program_cpu(n, dtype))
    ck = (n, dtype, arch)
    cfg = _cfg_cache.get(ck)
    if cfg is None:
        elem = 4 if dtype == "float32" else 2
        default = default_norm_config(n, elem, arch)

        def bench(c):
            k = _kernel_for(n, dtype, arch, c)
            return median_ms(lambda: k(*args))

        cfg = default if args is None else _pick_config(
            "softmax", arch, (n, dtype), norm_candidates(n, elem, arch), default, bench)
        if not tuning_suspended():  # a config picked while tuning is suspended is not final
            _cfg_cache[ck] = cfg
    return _kernel_for(n, dtype, arch, cfg)


def softmax(x: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None, arch: str | None = None):
    """softmax over `dim` (fp32 math, result in x.dtype). `out` (contiguous, x's shape) only for dim = last.

    GPU: fp16/bf16/fp32; cpu: fp32/fp64. `arch` forces a variant.

    >>> import torch
    >>> from tkopt.kernels import softmax
    >>> x = torch.randn(2, 3, 50)
    >>> torch.allclose(softmax(x), torch.softmax(x, -1), atol=1e-6)
    True
    >>> torch.allclose(softmax(x, dim=1), torch.softmax(x, 1), atol=1e-6)
    True
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("softmax needs at least one dim")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"dim {dim} out of range for a {x.dim()}-d tensor")
    dim = dim % x.dim()
    arch = arch_of(x, arch)
    allowed = CPU_DTYPES if arch == "cpu" else GPU_DTYPES
    if x.dtype not in allowed:
        raise UnsupportedError(f"softmax on {arch}: dtype {x.dtype} not supported (supported: {allowed})")
    last = dim == x.dim() - 1
    if not last and out is not None:
        raise ValueError("out= is only supported for softmax over the last dim")
    xt = x if last else x.movedim(dim, -1)
    n = xt.shape[-1]
    if arch != "cpu" and n > MAX_N_GPU:
        raise UnsupportedError(f"softmax on {arch}: reduced size {n} > {MAX_N_GPU} is not supported")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}")
    y = out if out is not None else torch.empty(xt.shape, dtype=x.dtype, device=x.device)
    if n == 0 or xt.numel() == 0:
        return y if last else y.movedim(-1, dim)
    m = xt.numel() // n
    x2 = xt.reshape(m, n)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y2 = y.view(m, n)
    args = (x2, y2)
    get_softmax_kernel(n, tl_dtype(x.dtype), arch, args)(*args)
    return y if last else y.movedim(-1, dim)
