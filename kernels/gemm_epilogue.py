"""GEMM with a fused epilogue: act(a @ b + bias) + residual, fp32 accumulate (semantics: reference.gemm_ref).

Public:
- `gemm(a, b, bias=None, act=None, residual=None, *, b_transposed=False, out=None)`: heuristic or tuned
  config (kernels/tuning.py, key bucketed on M).
- `gemm_custom(a, b, config, bias=None, act=None, residual=None, b_transposed=False, out=None)`: your tiles.
- `gemm_program(...)`: the program builder (a `@T.prim_func`), for lowering to C / CUDA source.

Compile-time keys of `gemm_program`: arch ("sm90" | "sm80" | "cpu"), N, K, dtype, TileConfig, b_transposed,
has_bias, act, has_residual, gated (two B operands and accumulators, gate multiplied in the epilogue: the
gated-MLP kernel) and `m` (None: M is a dynamic dim `T.dynamic("m")`, so one compiled kernel serves every
row count; an int specializes it). Argument order of the program: A (M,K), B (K,N) or (N,K) when
b_transposed, [B2 (same as B) if gated], [bias (N,)], [bias2 (N,) if gated and has_bias], [residual (M,N)],
C (M,N) -- all row-major contiguous, dtype `dtype` (C and bias/residual too).

Variants (one template, differing in target and config):
- sm90: T.gemm on shared tiles lowers to wgmma; T.copy of global tiles lowers to TMA; T.Pipelined stages
  with TileLang's automatic producer/consumer warp specialization; output staged through shared memory.
- sm80: T.gemm lowers to mma.sync with ldmatrix; T.copy/T.Pipelined lower to a cp.async pipeline.
- cpu: C backend, serial scalar loops over a tile (portability and CI numerics, not speed); fp32/fp64.
The epilogue (bias, activation, residual, gate) runs on the fp32 accumulator tile before the single store.
GPU fp32 inputs use tf32 tensor cores (relative error ~1e-3).
"""


import functools
import math
import threading

import tilelang
import tilelang.language as T
import torch

from .arch import UnsupportedError, arch_of, run_pass_configs, run_target
from .config import TileConfig, default_config, dtype_name
from .reference import ACTIVATIONS
from .tuning import median_ms

_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CPU_DTYPES = (torch.float32, torch.float64)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def _act_expr(x, act, acc):
    """The activation as a TIR expression on an accumulator-typed value."""
    if act is None:
        return x
    one = T.cast(1.0, acc)
    half = T.cast(0.5, acc)
    if act == "relu":
        return T.max(x, T.cast(0.0, acc))
    if act == "gelu":
        return half * x * (one + T.erf(x * T.cast(_INV_SQRT2, acc)))
    if act == "gelu_tanh":
        inner = T.cast(_SQRT_2_OVER_PI, acc) * (x + T.cast(0.044715, acc) * x * x * x)
        return half * x * (one + T.tanh(inner))
    if act == "silu":
        return x / (one + T.exp(-x))
    if act == "sigmoid":
        return one / (one + T.exp(-x))
    raise UnsupportedError(f"act: unknown activation {act!r}; expected one of {ACTIVATIONS}")


def gemm_program(
    arch: str,
    N: int,
    K: int,
    dtype: str,
    config: TileConfig,
    *,
    b_transposed: bool = False,
    has_bias: bool = False,
    act: str | None = None,
    has_residual: bool = False,
    gated: bool = False,
    m: int | None = None,
):
    """The GEMM (or gated two-GEMM) program for one set of compile-time keys (see the module docstring)."""
    dtype = dtype_name(dtype)
    config.validate(arch, dtype, accumulators=2 if gated else 1)
    if act not in ACTIVATIONS:
        raise UnsupportedError(f"act: unknown activation {act!r}; expected one of {ACTIVATIONS}")
    if arch == "cpu":
        return _cpu_program(N, K, dtype, config, b_transposed, has_bias, act, has_residual, gated, m)
    return _gpu_program(N, K, dtype, config, b_transposed, has_bias, act, has_residual, gated, m)


def _epilogue(acc, acc2, bias_v, bias2_v, res_v, act, gated, acc_dt):
    """Epilogue value from accumulator(s) and optional bias / residual values (all TIR expressions)."""
    x = acc if bias_v is None else acc + T.cast(bias_v, acc_dt)
    x = _act_expr(x, act, acc_dt)
    if gated:
        x = x * (acc2 if bias2_v is None else acc2 + T.cast(bias2_v, acc_dt))
    if res_v is not None:
        x = x + T.cast(res_v, acc_dt)
    return x


def _gpu_program(N, K, dtype, cfg, b_t, has_bias, act, has_res, gated, m):
    bm, bn, bk = cfg.block_tile
    M = T.dynamic("m") if m is None else m
    acc_dt = "float32"
    b_shape = (N, K) if b_t else (K, N)
    bs_shape = (bn, bk) if b_t else (bk, bn)
    stages, threads, swizzle, stage_c = cfg.stages, cfg.threads, cfg.swizzle, cfg.stage_c

    @T.macro
    def body(A, B, B2, Bias, Bias2, R, C):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=threads) as (bx, by):
            A_s = T.alloc_shared((bm, bk), dtype)
            B_s = T.alloc_shared(bs_shape, dtype)
            C_l = T.alloc_fragment((bm, bn), acc_dt)
            if gated:
                B2_s = T.alloc_shared(bs_shape, dtype)
                C2_l = T.alloc_fragment((bm, bn), acc_dt)
            if stage_c:
                C_s = T.alloc_shared((bm, bn), dtype)
            if swizzle > 0:
                T.use_swizzle(panel_size=swizzle)
            T.clear(C_l)
            if gated:
                T.clear(C2_l)
            for k in T.Pipelined(T.ceildiv(K, bk), num_stages=stages):
                T.copy(A[by * bm, k * bk], A_s)
                if b_t:
                    T.copy(B[bx * bn, k * bk], B_s)
                else:
                    T.copy(B[k * bk, bx * bn], B_s)
                if gated:
                    if b_t:
                        T.copy(B2[bx * bn, k * bk], B2_s)
                    else:
                        T.copy(B2[k * bk, bx * bn], B2_s)
                T.gemm(A_s, B_s, C_l, transpose_B=b_t)
                if gated:
                    T.gemm(A_s, B2_s, C2_l, transpose_B=b_t)
            if has_bias or act is not None or has_res or gated:
                for i, j in T.Parallel(bm, bn):
                    C_l[i, j] = _epilogue(
                        C_l[i, j],
                        C2_l[i, j] if gated else None,
                        Bias[bx * bn + j] if has_bias else None,
                        Bias2[bx * bn + j] if (has_bias and gated) else None,
                        R[by * bm + i, bx * bn + j] if has_res else None,
                        act,
                        gated,
                        acc_dt,
                    )
            if stage_c:
                T.copy(C_l, C_s)
                T.copy(C_s, C[by * bm, bx * bn])
            else:
                T.copy(C_l, C[by * bm, bx * bn])

    return _signature(body, M, N, K, dtype, b_shape, has_bias, has_res, gated)


def _cpu_program(N, K, dtype, cfg, b_t, has_bias, act, has_res, gated, m):
    from tilelang.cpu.language import Kernel as CpuKernel

    bm, bn, bk = cfg.block_tile
    M = T.dynamic("m") if m is None else m
    acc_dt = dtype  # float32 or float64: accumulate in the input precision (fp64 stays fp64)
    b_shape = (N, K) if b_t else (K, N)

    @T.macro
    def body(A, B, B2, Bias, Bias2, R, C):
        with CpuKernel(T.ceildiv(N, bn), T.ceildiv(M, bm)) as (bx, by):
            C_l = T.alloc_local((bm, bn), acc_dt)
            C2_l = T.alloc_local((bm, bn), acc_dt)
            for i, j in T.grid(bm, bn):
                C_l[i, j] = T.cast(0, acc_dt)
                C2_l[i, j] = T.cast(0, acc_dt)
            for ko in T.serial(T.ceildiv(K, bk)):
                for i, j, kk in T.grid(bm, bn, bk):
                    r = by * bm + i
                    c = bx * bn + j
                    kx = ko * bk + kk
                    if r < M and c < N and kx < K:
                        if b_t:
                            C_l[i, j] += A[r, kx] * B[c, kx]
                            if gated:
                                C2_l[i, j] += A[r, kx] * B2[c, kx]
                        else:
                            C_l[i, j] += A[r, kx] * B[kx, c]
                            if gated:
                                C2_l[i, j] += A[r, kx] * B2[kx, c]
            for i, j in T.grid(bm, bn):
                r = by * bm + i
                c = bx * bn + j
                if r < M and c < N:
                    C[r, c] = _epilogue(
                        C_l[i, j],
                        C2_l[i, j] if gated else None,
                        Bias[c] if has_bias else None,
                        Bias2[c] if (has_bias and gated) else None,
                        R[r, c] if has_res else None,
                        act,
                        gated,
                        acc_dt,
                    )

    return _signature(body, M, N, K, dtype, b_shape, has_bias, has_res, gated)


def _signature(body, M, N, K, dtype, b_shape, has_bias, has_res, gated):
    """A prim_func with exactly the buffers used (TVMScript signatures cannot be conditional)."""
    # Every parameter needs its own annotation object (a shared one would alias the buffers).
    a_t = T.Tensor((M, K), dtype)
    b_tt = T.Tensor(b_shape, dtype)
    b2_t = T.Tensor(b_shape, dtype)
    v_t = T.Tensor((N,), dtype)
    v2_t = T.Tensor((N,), dtype)
    r_t = T.Tensor((M, N), dtype)
    c_t = T.Tensor((M, N), dtype)
    key = (gated, has_bias, has_res)
    if key == (False, False, False):

        @T.prim_func
        def gemm_kernel(A: a_t, B: b_tt, C: c_t):
            body(A, B, B, A, A, A, C)

    elif key == (False, True, False):

        @T.prim_func
        def gemm_kernel(A: a_t, B: b_tt, Bias: v_t, C: c_t):
            body(A, B, B, Bias, Bias, A, C)

    elif key == (False, False, True):

        @T.prim_func
        def gemm_kernel(A: a_t, B: b_tt, R: r_t, C: c_t):
            body(A, B, B, A, A, R, C)

    elif key == (False, True, True):

        @T.prim_func
        def gemm_kernel(A: a_t, B: b_tt, Bias: v_t, R: r_t, C: c_t):
            body(A, B, B, Bias, Bias, R, C)

    elif key == (True, False, False):

        @T.prim_func
        def gemm_kernel(A: a_t, B: b_tt, B2: b2_t, C: c_t):
            body(A, B, B2, A, A, A, C)

    elif key == (True, True, False):

        @T.prim_func
        def gemm_kernel(A: a_t, B: b_tt, B2: b2_t, Bias: v_t, Bias2: v2_t, C: c_t):
            body(A, B, B2, Bias, Bias2, A, C)

    else:
        raise UnsupportedError("gated GEMM with a residual is not a supported kernel")
    return gemm_kernel


# ---------------------------------------------------------------------------------------------------
# Compile cache and launch

_CACHE: dict[tuple, object] = {}
_LOCKS: dict[tuple, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _compile(arch, N, K, dtype, config, b_t, has_bias, act, has_res, gated, m):
    func = gemm_program(arch, N, K, dtype, config, b_transposed=b_t, has_bias=has_bias, act=act,
                        has_residual=has_res, gated=gated, m=m)
    if arch == "cpu":
        return tilelang.compile(func, target="c", target_host="c", execution_backend="cython")
    # sm80 on a newer GPU is built for that GPU with Hopper features off (arch.run_target says why).
    return tilelang.compile(func, target=run_target(arch), pass_configs=run_pass_configs(arch))


def compiled_kernel(arch, N, K, dtype, config, b_transposed=False, has_bias=False, act=None,
                    has_residual=False, gated=False, m=None):
    """The compiled kernel for a key, cached in memory (never recompiled in a warm process; TileLang
    also caches on disk, so a new process loads instead of compiling)."""
    key = (arch, N, K, dtype_name(dtype), config, b_transposed, has_bias, act, has_residual, gated, m)
    kern = _CACHE.get(key)
    if kern is not None:
        return kern
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _CACHE:
            _CACHE[key] = _compile(*key)
    return _CACHE[key]


def _precompile_worker(key):
    import time

    t = time.perf_counter()
    try:
        _compile(*key)
    except Exception as exc:  # reported; the caller's own compile will raise it again if it is used
        return key, None, f"{type(exc).__name__}: {str(exc)[:300]}"
    return key, time.perf_counter() - t, None


def precompile(keys, workers: int | None = None) -> dict:
    """Compile kernels (compiled_kernel's positional keys) in parallel worker processes, which fill
    TileLang's disk cache; returns {key: (seconds or None, error or None)}. Keys already compiled in this
    process are skipped. Later compiled_kernel calls here load from the disk cache."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    todo = [tuple(k[:3]) + (dtype_name(k[3]),) + tuple(k[4:]) for k in keys]
    todo = [k for k in dict.fromkeys(todo) if k not in _CACHE]
    if not todo:
        return {}
    workers = workers or max(1, min(len(todo), (os.cpu_count() or 2) - 1))
    if workers == 1 or len(todo) == 1:
        return {k: _precompile_worker(k)[1:] for k in todo}
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            return {k: (t, e) for k, t, e in ex.map(_precompile_worker, todo)}
    except Exception as exc:  # e.g. a broken pool: kernels then compile on first use, serially
        return {k: (None, f"precompile pool failed: {type(exc).__name__}: {exc}") for k in todo}


def _check_tensor(name, t, dev, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != dev:
        raise ValueError(f"{name} is on {t.device} but a is on {dev}; all inputs must share a device")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but a has {dtype}; all inputs must share a dtype")


def check_inputs(a, b, bias, act, residual, b_transposed, arch=None, name_b="b"):
    """Validate shapes/dtypes/devices; returns (arch, M, N, K, out_shape)."""
    _check_tensor("a", a, a.device if isinstance(a, torch.Tensor) else None)
    if a.dim() < 1:
        raise ValueError("a must have at least 1 dim (..., K), got a scalar")
    _check_tensor(name_b, b, a.device, a.dtype)
    arch = arch_of(a, arch)
    allowed = _CPU_DTYPES if arch == "cpu" else _GPU_DTYPES
    if a.dtype not in allowed:
        raise UnsupportedError(f"a: dtype {a.dtype} is not supported on {arch}; expected one of {allowed}")
    if b.dim() != 2:
        raise ValueError(f"{name_b} must be 2-D ({'N, K' if b_transposed else 'K, N'}), got shape {tuple(b.shape)}")
    K = a.shape[-1]
    N, Kb = (b.shape[0], b.shape[1]) if b_transposed else (b.shape[1], b.shape[0])
    if Kb != K:
        raise ValueError(f"{name_b}: inner dims differ: a is {tuple(a.shape)} (K={K}) but {name_b} is "
                         f"{tuple(b.shape)} ({'N, K' if b_transposed else 'K, N'}) with K={Kb}")
    if act not in ACTIVATIONS:
        raise UnsupportedError(f"act: unknown activation {act!r}; expected one of {ACTIVATIONS}")
    out_shape = (*a.shape[:-1], N)
    if bias is not None:
        _check_tensor("bias", bias, a.device, a.dtype)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None:
        _check_tensor("residual", residual, a.device, a.dtype)
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"residual must have the output shape {out_shape}, got {tuple(residual.shape)}")
    M = math.prod(a.shape[:-1])
    return arch, M, N, K, out_shape


def _contig(t):
    return t if t.is_contiguous() else t.contiguous()


def padded_nk(arch, N, K, elt_size):
    """(N, K) as the kernel is compiled: on GPU rounded up to 16-byte multiples (TMA / vector copies)."""
    if arch == "cpu":
        return N, K
    al = 16 // elt_size
    return -(-N // al) * al, -(-K // al) * al


def _launch(arch, config, a, bs, biases, act, residual, b_transposed, out, out_shape, M, N, K, gated):
    """Run the kernel; handles empty sizes, contiguity and the `out=` buffer."""
    if out is not None:
        _check_tensor("out", out, a.device, a.dtype)
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {tuple(out.shape)}")
    if M == 0 or N == 0:
        return out if out is not None else a.new_empty(out_shape)
    if K == 0:  # a @ b is all zeros: the epilogue on zeros (the kernel's K loop would be empty, too)
        from .reference import gated_mlp_ref, gemm_ref

        if gated:
            y = gated_mlp_ref(a, bs[0], bs[1], act, biases[0], biases[1], weights_transposed=b_transposed)
        else:
            y = gemm_ref(a, bs[0], biases[0], act, residual, b_transposed=b_transposed)
        return out.copy_(y) if out is not None else y
    a2 = a.reshape(M, K)
    bs = list(bs)
    biases = list(biases)
    res2 = None if residual is None else residual.reshape(M, N)
    # TMA / 16-byte vector copies need 16-byte aligned row strides: on GPU, zero-pad K and N up to a
    # multiple of 16 bytes (zeros in K add nothing; padded N columns are computed and dropped).
    Np, Kp = padded_nk(arch, N, K, a.element_size())
    if Kp != K:
        a2 = torch.nn.functional.pad(a2, (0, Kp - K))
        bs = [torch.nn.functional.pad(b, (0, Kp - K) if b_transposed else (0, 0, 0, Kp - K)) for b in bs]
    if Np != N:
        bs = [torch.nn.functional.pad(b, (0, 0, 0, Np - N) if b_transposed else (0, Np - N)) for b in bs]
        biases = [None if x is None else torch.nn.functional.pad(x, (0, Np - N)) for x in biases]
        res2 = None if res2 is None else torch.nn.functional.pad(res2, (0, Np - N))
    args = [_contig(a2), *[_contig(b) for b in bs]]
    has_bias = biases[0] is not None
    if has_bias:
        args += [_contig(x) for x in biases]
    if res2 is not None:
        args.append(_contig(res2))
    direct = out is not None and out.is_contiguous() and Np == N
    c = out.view(M, N) if direct else torch.empty((M, Np), dtype=a.dtype, device=a.device)
    kern = compiled_kernel(arch, Np, Kp, a.dtype, config, b_transposed=b_transposed, has_bias=has_bias, act=act,
                           has_residual=res2 is not None, gated=gated)
    kern(*args, c)
    if direct:
        return out
    if Np != N:
        c = c[:, :N]
    if out is not None:
        return out.copy_(c.reshape(out_shape))
    return c.reshape(out_shape)


def _resolve_config(config, arch, dtype, gated):
    if isinstance(config, dict):
        config = TileConfig.from_dict(config)
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a TileConfig (or its dict), got {type(config).__name__}")
    if arch == "cpu" and config.use_tensorcore:
        # the cpu variant is scalar: keep the user's tile sizes, drop the GPU-only knobs
        config = TileConfig(block_tile=config.block_tile, stages=1, threads=1, use_tensorcore=False, swizzle=0,
                            stage_c=False)
    return config.validate(arch, dtype, accumulators=2 if gated else 1)


def gemm_custom(a, b, config, bias=None, act=None, residual=None, b_transposed=False, *, out=None, arch=None):
    """gemm with a user-chosen TileConfig (validated for the arch first: UnsupportedError names the problem)."""
    arch, M, N, K, out_shape = check_inputs(a, b, bias, act, residual, b_transposed, arch)
    config = _resolve_config(config, arch, a.dtype, gated=False)
    return _launch(arch, config, a, [b], [bias], act, residual, b_transposed, out, out_shape, M, N, K, False)


# Small tuning space per arch (16-bit inputs); fp32 uses the default config only.
TUNE_CANDIDATES = {
    "sm90": [
        dict(block_tile=(128, 256, 64), stages=3, threads=256),
        dict(block_tile=(256, 128, 64), stages=3, threads=256),
        dict(block_tile=(128, 128, 64), stages=4, threads=256),
        dict(block_tile=(128, 256, 32), stages=4, threads=256),
    ],
    "sm80": [
        dict(block_tile=(128, 128, 32), stages=3, threads=128),
        dict(block_tile=(128, 256, 32), stages=3, threads=256),
        dict(block_tile=(128, 128, 64), stages=3, threads=256),
        dict(block_tile=(256, 128, 32), stages=3, threads=256),
    ],
}


def select_config(kind, arch, M, N, K, dtype, act, has_bias, has_res, b_t, run, gated=False) -> TileConfig:
    """Default config, or the tuned one (kernels/tuning.py) for 16-bit GPU GEMMs with M >= 128."""
    from .tuning import cached_entry, pick_config, shape_bucket, tuning_enabled

    acc = 2 if gated else 1
    # The memo first: this runs on every call, and building the candidates costs ~100 us of Python.
    key = (shape_bucket(M), N, K, str(dtype), act, has_bias, has_res, b_t)
    mkey = (kind, arch, key, gated)
    hit = _SELECTED.get(mkey)
    if hit is not None:
        return hit
    default = default_config(arch, dtype, accumulators=acc, m=M, n=N, sms=_sm_count(arch))
    if arch == "cpu" or dtype == torch.float32 or M <= 64:
        _SELECTED[mkey] = default
        return default
    cands = [c for c in TUNE_CANDIDATES[arch] if _valid(c, arch, dtype, acc)]
    if gated:
        cands = [c for c in cands if c["block_tile"][1] <= 128] + [
            dict(block_tile=(128, 128, 64), stages=3, threads=256)] * (arch == "sm90")
        cands = list({str(c): c for c in cands}.values())
    d = default.as_dict()
    d = {k: d[k] for k in ("block_tile", "stages", "threads")}
    d["block_tile"] = tuple(d["block_tile"])

    def bench(c):
        return run(TileConfig(**c).validate(arch, dtype, acc))

    if tuning_enabled(arch) and len(cands) > 1 and cached_entry(kind, arch, key) is None:
        # compile every candidate in parallel processes first (disk cache), then time them one by one
        Np, Kp = padded_nk(arch, N, K, torch.empty((), dtype=dtype).element_size())
        precompile([(arch, Np, Kp, dtype, TileConfig(**c), b_t, has_bias, act, has_res, gated, None) for c in cands])
    chosen = TileConfig(**pick_config(kind, arch, key, cands, d, bench))
    _SELECTED[mkey] = chosen
    return chosen


_SELECTED: dict[tuple, TileConfig] = {}


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(arch: str) -> int | None:
    """The current GPU's SM count (what the default tile is sized against); None off the GPU."""
    if arch == "cpu" or not torch.cuda.is_available():
        return None
    return _device_sms(torch.cuda.current_device())


def _valid(c, arch, dtype, acc):
    try:
        TileConfig(**c).validate(arch, dtype, acc)
        return True
    except UnsupportedError:
        return False


def gemm(a, b, bias=None, act=None, residual=None, *, b_transposed=False, out=None, arch=None):
    """act(a @ b + bias) + residual with the epilogue fused into the store (semantics: reference.gemm_ref).

    a: (..., K); b: (K, N), or (N, K) with b_transposed=True (a linear weight); bias: (N,); residual: the
    output shape (..., N). GPU: fp16/bf16/fp32 (fp32 accumulate); cpu: fp32/fp64. `out=` writes into a
    given tensor; `arch=` forces a variant ("sm80" on an H200).
    """
    arch, M, N, K, out_shape = check_inputs(a, b, bias, act, residual, b_transposed, arch)
    if M == 0 or N == 0 or K == 0:
        cfg = default_config(arch, a.dtype)
    else:
        def run(cfg):
            return median_ms(lambda: _launch(arch, cfg, a, [b], [bias], act, residual, b_transposed, None,
                                            out_shape, M, N, K, False))

        cfg = select_config("gemm", arch, M, N, K, a.dtype, act, bias is not None, residual is not None,
                            b_transposed, run)
    return _launch(arch, cfg, a, [b], [bias], act, residual, b_transposed, out, out_shape, M, N, K, False)
