"""Residual add + LayerNorm / RMSNorm (and the plain norms) over the last dim, as TileLang kernels.

Public API (semantics: tkopt/kernels/reference.py):
    add_layer_norm(x, residual, weight, bias, eps=1e-5, *, return_sum=True, out=None, sum_out=None)
    add_rms_norm(x, residual, weight, eps=1e-6, *, return_sum=True, out=None, sum_out=None)
        -> (normed, x + residual), or only normed when return_sum=False (the sum is then never written).
    layer_norm(x, weight, bias, eps=1e-5), rms_norm(x, weight, eps=1e-6) -> normed
    planned_kernels(kind, x, residual, weight, bias, eps, return_sum, build)
        -> the compiles such a call uses, tuning candidates included (for a build wave ahead of the calls).

Program builders (for lowering to CUDA / C source elsewhere):
    norm_program_gpu(kind, n, dtype, w_dtype, *, has_residual, has_weight, has_bias, write_sum, eps,
                     block_rows, threads_per_row)
    norm_program_cpu(kind, n, dtype, w_dtype, *, has_residual, has_weight, has_bias, write_sum, eps)
The row count M is a dynamic dim (T.dynamic("m")): one compiled kernel serves every batch*seq size.
Every program has the fixed signature (X, R, W, B, Y, S): X, R, Y, S are (m, n) in `dtype`, W and B are
(n,) in `w_dtype`. Arguments the flags switch off (R without residual, W/B without weight/bias, S when
write_sum=False) are never read or written: pass any tensor of that shape and dtype (the wrappers pass x /
its first row / y).

GPU design (sm90 and sm80 share the template; they differ in config): each CTA holds `block_rows` rows
entirely in registers (fp32), `threads_per_row` threads per row, each thread owning 16-byte chunks so that
loads are 128-bit (a layout annotated, not left to TileLang's inference: see row_fragment); x and residual
are read once, statistics are two-pass from registers (exact mean, then sum of squared deviations, each a
per-row all-reduce over the row's threads), y (and the sum) written once with 128-bit stores: the sum right
after it is formed, y at the end, each from a loop with a single store (see the comment at the sum's loop). A weight
wider than x (fp32 weight, 16-bit x) limits y's loop to 4-wide vectors (64-bit y stores). Hidden sizes that
are not a multiple of 16 bytes * threads_per_row are padded inside the CTA and guarded (row/column guards
keep 128-bit accesses when a row is a multiple of 16 bytes; other n give unaligned rows: scalar accesses). A
CTA's padding rows past m read row m - 1 and are never stored (`read_row`: unpredicated loads go out together).
Max hidden size on GPU: MAX_N_GPU (registers); larger raises UnsupportedError.
CPU design: serial C loops per row, same math (float32 statistics, float64 stays float64).
"""

import threading
import time
from collections.abc import Callable

import torch

from .arch import Build, UnsupportedError, arch_of, device_sm, run_pass_configs, run_target
from .constants import const
from .libraries import gpu_compile
from .tuning import median_ms, tuning_suspended
from .tuning import pick_config as _pick_config
from .workers import Compile

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
              torch.float64: "float64"}
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_DTYPES = (torch.float32, torch.float64)
MAX_N_GPU = 32768
_ELEMS_PER_THREAD_CAP = 64  # fp32 registers per thread for the row (x2 with temporaries)


# ----------------------------------------------------------------------------------------------
# Shared helpers (also used by softmax.py and conv.py)
# ----------------------------------------------------------------------------------------------

def tl_dtype(dt: torch.dtype) -> str:
    return _TL_DTYPES[dt]


def acc_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


_compile_lock = threading.Lock()
_compiled: dict[tuple, object] = {}
COMPILE_LOG: list[tuple[str, float]] = []  # (key, seconds) of every compile this process did


def compile_cached(key: tuple, arch: str, build: Callable[[], object], device: str | None = None):
    """Compile build() for arch, to run on `device` ("sm_90"; None: this machine's GPU), once per process per
    key (TileLang also caches on disk across processes)."""
    kern = _compiled.get(key)
    if kern is not None:
        return kern
    with _compile_lock:
        kern = _compiled.get(key)
        if kern is None:
            t0 = time.perf_counter()
            if arch == "cpu":
                import tilelang
                from tilelang import tvm

                with tvm.target.Target("c"):
                    kern = tilelang.compile(build(), target="c", target_host="c", execution_backend="cython")
            else:
                # sm80 on a newer GPU is built for that GPU with Hopper features off (arch.run_target).
                kern = gpu_compile(key, build, run_target(arch, device), run_pass_configs(arch, device))
            COMPILE_LOG.append((repr(key), time.perf_counter() - t0))
            _compiled[key] = kern
    return kern


def _ceil_to(a: int, b: int) -> int:
    return (a + b - 1) // b * b


# ----------------------------------------------------------------------------------------------
# Programs
# ----------------------------------------------------------------------------------------------

def in_bounds(m, n: int, col_guard: bool, row_guard: bool):
    """The predicate `ok(row, j)` for element j of a row in a tile padded to vector width and block rows:
    only the guards the padding needs, so exact tiles keep unguarded (vectorizable) loads."""
    import tilelang.language as T

    def ok(row, j):
        if col_guard and row_guard:
            return T.And(row < m, j < n)
        if col_guard:
            return j < n
        return row < m

    return ok


def read_row(m, n: int, col_guard: bool, row_guard: bool):
    """The loader `read(buf, row, j, fill)` of a row tile: buf[row, j], with the row guard as a clamp (a padding
    row past m reads row m - 1; nothing computed from it is stored: the stores keep `in_bounds`) and `fill` past n.
    Under a row predicate ptxas branched around each chunk's use and issued the next chunk's loads only after the
    previous chunk's had arrived (add + LayerNorm, n = 768 fp16: two round trips to memory where one does);
    clamped, a thread's loads are unconditional and go out together."""
    import tilelang.language as T

    def read(buf, row, j, fill):
        value = buf[T.min(row, m - 1) if row_guard else row, j]
        return T.if_then_else(j < n, value, fill) if col_guard else value

    return read


def row_fragment(block_rows: int, np_: int, vec: int, threads_per_row: int):
    """The register layout of a (block_rows, np_) row tile: row i lives on threads [i*tpr, (i+1)*tpr), thread t of
    the row owns the 16-byte chunks t, t + tpr, t + 2*tpr, ... (vec elements each), i.e. np_/tpr registers.

    Stated explicitly (T.annotate_layout) because TileLang's free layout inference (0.1.15) does not give it: its
    loop planner (PlanLoopPartition) deals the flattened (i, j) chunks round-robin over ALL the CTA's threads,
    ignoring threads_per_row. Where a row's chunk count and the CTA's thread count divide one another that is a
    valid but different layout (n=1024 fp16, 2 rows: each thread holds a chunk of both rows, 128-thread
    all-reduces instead of 64); where they do not (n=768 fp16: 96 chunks a row, 4 rows on 128 threads) the plan
    cannot be reduced per row and inference falls back to a layout with every row replicated on all its threads
    (`float s[np_]` per thread, serial np_-long reductions: 32x the work, spilled to local memory; 0.77 ms for
    4096 x 768 on the H200)."""
    import tilelang.language as T

    return T.Fragment(
        (block_rows, np_),
        forward_thread_fn=lambda i, j: i * threads_per_row + (j // vec) % threads_per_row,
        forward_index_fn=lambda i, j: (j // (vec * threads_per_row)) * vec + j % vec,
    )


def norm_program_gpu(
    kind: str,
    n: int,
    dtype: str,
    w_dtype: str,
    *,
    has_residual: bool,
    has_weight: bool,
    has_bias: bool,
    write_sum: bool,
    eps: float,
    block_rows: int,
    threads_per_row: int,
):
    """GPU program: Y = norm(X (+ R)) * W + B over the last dim, S = X + R. kind: 'layer' or 'rms'."""
    import tilelang.language as T

    if kind not in ("layer", "rms"):
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    acc = "float32"
    elem = 4 if dtype == "float32" else 2
    vec = 16 // elem
    np_ = _ceil_to(n, vec * threads_per_row)
    threads = block_rows * threads_per_row
    col_guard = np_ != n
    row_guard = block_rows > 1
    is_ln = kind == "layer"
    has_bias = has_bias and is_ln
    inv_n = 1.0 / n
    m = T.dynamic("m")

    ok = in_bounds(m, n, col_guard, row_guard)
    read = read_row(m, n, col_guard, row_guard)

    @T.prim_func
    def main(
        X: T.Tensor((m, n), dtype),
        R: T.Tensor((m, n), dtype),
        W: T.Tensor((n,), w_dtype),
        B: T.Tensor((n,), w_dtype),
        Y: T.Tensor((m, n), dtype),
        S: T.Tensor((m, n), dtype),
    ):
        with T.Kernel(T.ceildiv(m, block_rows), threads=threads) as bx:
            s = T.alloc_fragment((block_rows, np_), acc)
            d = T.alloc_fragment((block_rows, np_), acc)
            mean = T.alloc_fragment((block_rows,), acc)
            rstd = T.alloc_fragment((block_rows,), acc)
            layout = row_fragment(block_rows, np_, vec, threads_per_row)
            T.annotate_layout({s: layout, d: layout})
            for i, j in T.Parallel(block_rows, np_):
                row = bx * block_rows + i
                zero = T.cast(0, dtype)
                if has_residual:
                    s[i, j] = T.Cast(acc, read(X, row, j, zero)) + T.Cast(acc, read(R, row, j, zero))
                else:
                    s[i, j] = T.Cast(acc, read(X, row, j, zero))
            if write_sum:
                # The sum goes out from the fp32 registers in a loop of its own, right after it is formed (its
                # stores then overlap the reductions below; x and r are still read once). Keep ONE global
                # store per T.Parallel body: TileLang's DecoupleTypeCast pass (transform/decouple_type_cast.py)
                # only stages a mixed-dtype loop through a local `dtype` buffer when the body is a single
                # statement, which is what makes the store 128-bit (8 fp32 registers -> uint4 of 8 x fp16).
                # With Y and S stored in one body the pass skips the loop, which is then vectorized at the fp32
                # width (4): 64-bit stores of both outputs and 64-bit weight/bias loads, 64 instead of 48
                # registers (add+LN fp16 n=4096 sm90), and 170-175 us vs 100 us without the sum on the H200.
                for i, j in T.Parallel(block_rows, np_):
                    row = bx * block_rows + i
                    if col_guard or row_guard:
                        if ok(row, j):
                            S[row, j] = T.Cast(dtype, s[i, j])
                    else:
                        S[row, j] = T.Cast(dtype, s[i, j])
            if is_ln:
                T.reduce_sum(s, mean, dim=1)
                for i in T.Parallel(block_rows):
                    mean[i] = mean[i] * const(inv_n, acc)
                for i, j in T.Parallel(block_rows, np_):
                    if col_guard:
                        d[i, j] = T.if_then_else(j < n, (s[i, j] - mean[i]) * (s[i, j] - mean[i]),
                                                 T.float32(0))
                    else:
                        d[i, j] = (s[i, j] - mean[i]) * (s[i, j] - mean[i])
            else:
                for i, j in T.Parallel(block_rows, np_):
                    d[i, j] = s[i, j] * s[i, j]
            T.reduce_sum(d, rstd, dim=1)
            for i in T.Parallel(block_rows):
                rstd[i] = T.rsqrt(rstd[i] * const(inv_n, acc) + const(eps, acc))
            for i, j in T.Parallel(block_rows, np_):
                row = bx * block_rows + i
                if is_ln:
                    v = (s[i, j] - mean[i]) * rstd[i]
                else:
                    v = s[i, j] * rstd[i]
                if has_weight:
                    v = v * T.Cast(acc, W[j])
                if has_bias:
                    v = v + T.Cast(acc, B[j])
                if col_guard or row_guard:  # one store per loop body: see the sum's loop above
                    if ok(row, j):
                        Y[row, j] = T.Cast(dtype, v)
                else:
                    Y[row, j] = T.Cast(dtype, v)

    return main


def norm_program_cpu(
    kind: str,
    n: int,
    dtype: str,
    w_dtype: str,
    *,
    has_residual: bool,
    has_weight: bool,
    has_bias: bool,
    write_sum: bool,
    eps: float,
):
    """CPU (C backend) program with the same signature and math as norm_program_gpu; serial per row."""
    import tilelang.language as T
    from tilelang.cpu.language import Kernel

    if kind not in ("layer", "rms"):
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    acc = acc_dtype(dtype)
    is_ln = kind == "layer"
    has_bias = has_bias and is_ln
    m = T.dynamic("m")

    @T.prim_func
    def main(
        X: T.Tensor((m, n), dtype),
        R: T.Tensor((m, n), dtype),
        W: T.Tensor((n,), w_dtype),
        B: T.Tensor((n,), w_dtype),
        Y: T.Tensor((m, n), dtype),
        S: T.Tensor((m, n), dtype),
    ):
        with Kernel(m) as bx:
            # No row buffer: each pass re-reads x (+ residual); a local (n,) array would live on the C stack.
            st = T.alloc_local((2,), acc)
            st[0] = T.cast(0, acc)
            if is_ln:
                for j in T.serial(n):
                    if has_residual:
                        st[0] += T.Cast(acc, X[bx, j]) + T.Cast(acc, R[bx, j])
                    else:
                        st[0] += T.Cast(acc, X[bx, j])
                st[0] = st[0] / T.cast(n, acc)
            st[1] = T.cast(0, acc)
            for j in T.serial(n):
                if has_residual:
                    st[1] += (T.Cast(acc, X[bx, j]) + T.Cast(acc, R[bx, j]) - st[0]) * (
                        T.Cast(acc, X[bx, j]) + T.Cast(acc, R[bx, j]) - st[0])
                else:
                    st[1] += (T.Cast(acc, X[bx, j]) - st[0]) * (T.Cast(acc, X[bx, j]) - st[0])
            st[1] = T.cast(1, acc) / T.sqrt(st[1] / T.cast(n, acc) + const(eps, acc))
            for j in T.serial(n):
                if has_residual:
                    v = T.Cast(acc, X[bx, j]) + T.Cast(acc, R[bx, j])
                else:
                    v = T.Cast(acc, X[bx, j])
                if write_sum:
                    S[bx, j] = T.Cast(dtype, v)
                u = (v - st[0]) * st[1]
                if has_weight:
                    u = u * T.Cast(acc, W[j])
                if has_bias:
                    u = u + T.Cast(acc, B[j])
                Y[bx, j] = T.Cast(dtype, u)

    return main


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------

def _valid_cfg(n: int, elem: int, block_rows: int, tpr: int) -> bool:
    vec = 16 // elem
    per_thread = _ceil_to(n, vec * tpr) // tpr
    return per_thread <= _ELEMS_PER_THREAD_CAP and block_rows * tpr <= 1024 and tpr >= 32 and tpr & (tpr - 1) == 0


def default_norm_config(n: int, elem: int, arch: str) -> dict:
    """threads_per_row: a power of two >= 32 giving each thread 1-4 16-byte chunks, preferring exact division
    (no padding guard); block_rows so that a CTA has >= 128 threads for small rows."""
    vec = 16 // elem
    chunks = -(-n // vec)
    target = 2 if arch == "sm90" else 2  # chunks per thread; candidates explore 1..4
    best = None
    for tpr in (32, 64, 128, 256, 512, 1024):  # TileLang's AllReduce needs a power-of-two width
        per = -(-chunks // tpr)
        if per > _ELEMS_PER_THREAD_CAP // vec:
            continue
        exact = n % (vec * tpr) == 0
        score = (not exact, abs(per - target), tpr)
        if best is None or score < best[0]:
            best = (score, tpr)
    if best is None:
        raise UnsupportedError(f"hidden size {n} is too large for the register-resident norm (max {MAX_N_GPU})")
    tpr = best[1]
    block_rows = max(1, 128 // tpr)
    return {"block_rows": block_rows, "threads_per_row": tpr}


def norm_candidates(n: int, elem: int, arch: str) -> list[dict]:
    d = default_norm_config(n, elem, arch)
    out = [d]
    vec = 16 // elem
    for tpr in (d["threads_per_row"] // 2, d["threads_per_row"] * 2):
        if tpr >= 32 and (n % (vec * tpr) == 0 or n % (vec * d["threads_per_row"])):
            out.append({"block_rows": max(1, 128 // tpr), "threads_per_row": tpr})
    out.append({"block_rows": d["block_rows"] * 2, "threads_per_row": d["threads_per_row"]})
    return [c for c in out if _valid_cfg(n, elem, c["block_rows"], c["threads_per_row"])]


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------

def _check_vec(name: str, t: torch.Tensor | None, n: int, x: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) (the last dim of x), got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if not t.is_floating_point():
        raise UnsupportedError(f"{name} dtype {t.dtype} is not a floating dtype")
    return t


def _norm_keys(kind, x, residual, weight, bias, eps, return_sum, arch):
    """(n, the weight dtype, flags): what a norm call on `arch` compiles its kernel for with x's dtype, the inputs
    validated. Reads shapes and dtypes only, so meta tensors give the keys real ones will."""
    allowed = CPU_DTYPES if arch == "cpu" else GPU_DTYPES
    if x.dtype not in allowed:
        raise UnsupportedError(f"{kind} norm on {arch}: dtype {x.dtype} not supported (supported: {allowed})")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("x has an empty last dim: nothing to normalize over")
    if arch != "cpu" and n > MAX_N_GPU:
        raise UnsupportedError(f"{kind} norm on {arch}: hidden size {n} > {MAX_N_GPU} is not supported")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual ({residual.dtype}, {residual.device}) must match x ({x.dtype}, {x.device})")
    weight = _check_vec("weight", weight, n, x)
    bias = _check_vec("bias", bias, n, x)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise ValueError(f"weight dtype {weight.dtype} and bias dtype {bias.dtype} differ")
    wt = weight if weight is not None else bias
    w_dtype = x.dtype if wt is None else wt.dtype
    if arch == "cpu" and w_dtype not in CPU_DTYPES:
        raise UnsupportedError(f"{kind} norm on cpu: weight dtype {w_dtype} not supported")
    if arch != "cpu" and w_dtype not in GPU_DTYPES:
        raise UnsupportedError(f"{kind} norm on {arch}: weight dtype {w_dtype} not supported")
    flags = dict(has_residual=residual is not None, has_weight=weight is not None,
                 has_bias=bias is not None and kind == "layer", write_sum=bool(return_sum), eps=float(eps))
    return n, w_dtype, flags


def planned_kernels(kind: str, x, residual, weight, bias, eps: float, return_sum: bool, build: Build) -> list[Compile]:
    """The compiles a `kind` ("layer" / "rms") norm call on tensors like these (meta tensors do) uses on `build`:
    the cached winner, else where it would tune every candidate, else the default config."""
    from .tuning import planned_configs

    n, w_dtype, flags = _norm_keys(kind, x, residual, weight, bias, eps, return_sum, build.arch)
    if x.numel() == 0:
        return []
    dt, wdt = tl_dtype(x.dtype), tl_dtype(w_dtype)
    fkey = tuple(sorted(flags.items()))
    if build.arch == "cpu":
        return [Compile.of(compile_norm, kind, n, dt, wdt, "cpu", fkey, None)]
    default, cands = _tuning_space(n, dt, build.arch)
    configs = planned_configs(f"{kind}_norm", build.arch, (n, dt, wdt, fkey), cands, default)
    return [Compile.of(compile_norm, kind, n, dt, wdt, build.arch, fkey, tuple(sorted(c.items())), build.gpu)
            for c in configs]


def _add_norm(kind, x, residual, weight, bias, eps, return_sum, out, sum_out, arch):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim (normalization is over the last dim)")
    arch = arch_of(x, arch)
    n, w_dtype, flags = _norm_keys(kind, x, residual, weight, bias, eps, return_sum, arch)
    shape = x.shape
    m = x.numel() // n
    x2 = x.reshape(m, n)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(m, n)
        if not r2.is_contiguous():
            r2 = r2.contiguous()
    for name, o in (("out", out), ("sum_out", sum_out)):
        if o is not None and (o.shape != shape or o.dtype != x.dtype or o.device != x.device
                              or not o.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {x.dtype} tensor of shape {tuple(shape)} on {x.device}")
    y = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    write_sum = bool(return_sum)
    s = None
    if write_sum:
        s = sum_out if sum_out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    if m > 0:
        y2 = y.view(m, n)
        s2 = s.view(m, n) if s is not None else y2
        w = weight.contiguous() if weight is not None else None
        b = bias.contiguous() if bias is not None else None
        dummy_w = w if w is not None else (b if b is not None else None)
        if dummy_w is None:
            dummy_w = x2[0] if w_dtype == x.dtype else torch.empty(n, dtype=w_dtype, device=x.device)
        args = (x2, r2 if r2 is not None else x2, w if w is not None else dummy_w,
                b if b is not None else dummy_w, y2, s2)
        kern = get_norm_kernel(kind, n, tl_dtype(x.dtype), tl_dtype(w_dtype), arch, flags, args)
        kern(*args)
    if write_sum:
        return y, s
    return y


def get_norm_kernel(kind: str, n: int, dtype: str, w_dtype: str, arch: str, flags: dict, args=None):
    """The compiled kernel for these compile-time keys (config from pick_config on GPU)."""
    fkey = tuple(sorted(flags.items()))
    if arch == "cpu":
        return compile_norm(kind, n, dtype, w_dtype, arch, fkey, None)
    cfg_key = ("norm", kind, n, dtype, w_dtype, arch, fkey)
    cfg = _cfg_cache.get(cfg_key)
    if cfg is None:
        default, cands = _tuning_space(n, dtype, arch)

        def bench(c: dict) -> float:
            k = compile_norm(kind, n, dtype, w_dtype, arch, fkey, tuple(sorted(c.items())))
            return median_ms(lambda: k(*args))

        cfg = _pick_config(f"{kind}_norm", arch, (n, dtype, w_dtype, fkey), cands, default,
                           bench) if args is not None else default
        if not tuning_suspended():  # a config picked while tuning is suspended is not final
            _cfg_cache[cfg_key] = cfg
    return compile_norm(kind, n, dtype, w_dtype, arch, fkey, tuple(sorted(cfg.items())))


_cfg_cache: dict[tuple, dict] = {}


def _tuning_space(n: int, dtype: str, arch: str) -> tuple[dict, list[dict]]:
    """(the default config, the tuning candidates) of a GPU norm over rows of n: the one definition
    get_norm_kernel and planned_kernels share."""
    elem = 4 if dtype == "float32" else 2
    return default_norm_config(n, elem, arch), norm_candidates(n, elem, arch)


def compile_norm(kind: str, n: int, dtype: str, w_dtype: str, arch: str, flags: tuple, config: tuple | None,
                 device: str | None = None):
    """The compiled norm kernel for its keys: `flags` and (GPU only) `config` as sorted items, to run on `device`
    (the GPU's "sm_90"; None: this machine's, asked of CUDA). The build wave names it, as it does for every
    kernel: its jobs only compile, and need no GPU."""
    if arch == "cpu":
        key = ("norm", kind, n, dtype, w_dtype, arch, flags, config)
        return compile_cached(key, arch, lambda: norm_program_cpu(kind, n, dtype, w_dtype, **dict(flags)))
    device = device or device_sm()
    key = ("norm", kind, n, dtype, w_dtype, arch, flags, config, device)
    return compile_cached(key, arch, lambda: norm_program_gpu(kind, n, dtype, w_dtype, **dict(flags),
                                                              **dict(config or ())), device)


def add_layer_norm(x, residual=None, weight=None, bias=None, eps: float = 1e-5, *, return_sum: bool = True,
                   out=None, sum_out=None, arch: str | None = None):
    """(LayerNorm(x + residual) * weight + bias, x + residual) over the last dim; only normed if not return_sum.

    Inputs of any leading dims; non-contiguous inputs are copied to contiguous first. fp16/bf16/fp32 on GPU
    (fp32 statistics), fp32/fp64 on CPU. `out`/`sum_out`: optional preallocated contiguous outputs.
    `arch` forces a variant ('sm80' on an H200), as TKOPT_ARCH does.

    >>> import torch
    >>> from tkopt.kernels import add_layer_norm
    >>> x, res, w, b = torch.randn(3, 7, 40), torch.randn(3, 7, 40), torch.randn(40), torch.randn(40)
    >>> y, s = add_layer_norm(x, res, w, b)  # s = x + res, the next residual
    >>> torch.allclose(y, torch.nn.functional.layer_norm(x + res, (40,), w, b), atol=1e-5)
    True
    """
    return _add_norm("layer", x, residual, weight, bias, eps, return_sum, out, sum_out, arch)


def add_rms_norm(x, residual=None, weight=None, eps: float = 1e-6, *, return_sum: bool = True,
                 out=None, sum_out=None, arch: str | None = None):
    """(RMSNorm(x + residual) * weight, x + residual) over the last dim; only normed if not return_sum.

    Same inputs, dtypes and extras as add_layer_norm, without a bias.

    >>> import torch
    >>> from tkopt.kernels import add_rms_norm
    >>> x, res, w = torch.randn(5, 24), torch.randn(5, 24), torch.randn(24)
    >>> y = add_rms_norm(x, res, w, eps=1e-6, return_sum=False)
    >>> torch.allclose(y, torch.nn.functional.rms_norm(x + res, (24,), w, eps=1e-6), atol=1e-5)
    True
    """
    return _add_norm("rms", x, residual, weight, None, eps, return_sum, out, sum_out, arch)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, *, out=None, arch: str | None = None):
    """LayerNorm(x) * weight + bias over the last dim (add_layer_norm without a residual).

    >>> import torch
    >>> from tkopt.kernels import layer_norm
    >>> x, w = torch.randn(4, 33), torch.randn(33)
    >>> torch.allclose(layer_norm(x, w), torch.nn.functional.layer_norm(x, (33,), w), atol=1e-5)
    True
    """
    return _add_norm("layer", x, None, weight, bias, eps, False, out, None, arch)


def rms_norm(x, weight=None, eps: float = 1e-6, *, out=None, arch: str | None = None):
    """RMSNorm(x) * weight over the last dim (add_rms_norm without a residual).

    >>> import torch
    >>> from tkopt.kernels import rms_norm
    >>> x, w = torch.randn(4, 33), torch.randn(33)
    >>> torch.allclose(rms_norm(x, w), torch.nn.functional.rms_norm(x, (33,), w, eps=1e-6), atol=1e-5)
    True
    """
    return _add_norm("rms", x, None, weight, None, eps, False, out, None, arch)
