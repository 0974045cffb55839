"""GEMM with a fused epilogue: act(a @ b + bias) + residual, fp32 accumulate (semantics: reference.gemm_ref).

Public:
- `gemm(a, b, bias=None, act=None, residual=None, *, b_transposed=False, out=None)`: heuristic or tuned
  config (tkopt/kernels/tuning.py, key bucketed on M); on CUDA, cuBLASLt's bias + relu / gelu_tanh epilogue
  (`library_serves`) unless TileLang's kernel times LIBRARY_MARGIN faster.
- `gemm_custom(a, b, config, bias=None, act=None, residual=None, b_transposed=False, out=None)`: your tiles.
- `gemm_program(...)`: the program builder (a `@T.prim_func`), for lowering to C / CUDA source.
- `planned_kernels(kind, build, M, N, K, ...)`: the compiles calls of M rows will use, tuning candidates
  included (as `workers.Compile` jobs), so that a build wave can compile them ahead in parallel.

Compile-time keys of `gemm_program`: arch ("sm90" | "sm80" | "cpu"), N, K, dtype, TileConfig, b_transposed,
has_bias, act, has_residual, gated (two B operands and accumulators, gate multiplied in the epilogue: the
gated-MLP kernel), `m` (None: M is a dynamic dim `T.dynamic("m")`, so one compiled kernel serves every
row count; an int specializes it) and `precision` (torch's fp32 matmul switch, tkopt/kernels/precision.py).
Argument order of the program: A (M,K), B (K,N) or (N,K) when b_transposed, [B2 (same as B) if gated],
[bias (N,)], [bias2 (N,) if gated and has_bias], [residual (M,N)], C (M,N) -- all row-major contiguous,
dtype `dtype` (C and bias/residual too).

Programs (`TileConfig.math` picks one; per-arch variants differ in target and config):
- tensor cores: T.gemm on shared tiles; on sm90 T.copy of global tiles lowers to TMA and T.Pipelined to a
  warp-specialized producer/consumer pipeline, on sm80 to a cp.async pipeline with mma.sync. fp32 takes
  tf32 tensor cores: one product when torch allows TF32 ("tf32"), else three ("tf32x3": each operand
  split into a tf32 high part and a tf32 low part, a_hi*b_hi in one accumulator and a_lo*b_hi + a_hi*b_lo
  in a second, which keeps fp32 accuracy; _tf32x3_sum says how inf and NaN stay eager's).
- SIMT (use_tensorcore=False): FMA on CUDA cores from register fragments (exact IEEE fp32 arithmetic,
  any GPU dtype, fp32 accumulate); cp.async pipeline into row-padded shared tiles.
- cpu: C backend, serial scalar loops over a tile (portability and CI numerics, not speed); fp32/fp64.
- sm90 overlap (TileConfig.overlap, fp16/bf16): the producer/consumer pipeline written out (_overlap_body), each
  K step's wgmma group left in flight while the next is issued.
The epilogue (bias, activation, residual, gate) runs on the fp32 accumulators before the single store. The
tensor-core programs run one block per output tile, or with TileConfig.persistent resident blocks that each walk
tiles in turn (T.Persistent), so that on sm90 the producer's loads for the next tile overlap the epilogue.
"""


import dataclasses
import functools
import math
import threading
import time

import torch

from .activations import activation
from .arch import OWN_SYNCS_PASS_CONFIGS, Build, UnsupportedError, arch_of, device_sm, run_pass_configs, run_target
from .config import TileConfig, default_config, dtype_name
from .libraries import gpu_compile
from .precision import matmul_precision
from .reference import ACTIVATIONS
from .tuning import median_ms
from .workers import Compile, default_workers, map_in_workers

_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CPU_DTYPES = (torch.float32, torch.float64)

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
    precision: str = "ieee",
    groups: tuple[int, ...] = (),
):
    """The GEMM (or gated two-GEMM, or grouped) program for one set of compile-time keys (module docstring)."""
    import tilelang.language as T

    dtype = dtype_name(dtype)
    config = config.validate(arch, dtype, accumulators=2 if gated else 1, precision=precision)
    if act not in ACTIVATIONS:
        raise UnsupportedError(f"act: unknown activation {act!r}; expected one of {ACTIVATIONS}")
    math_kind = config.math(arch, dtype, precision)
    if groups:
        problem = group_problem(arch, N, groups, config, math_kind, act, has_residual, gated)
        if problem:
            raise UnsupportedError(f"grouped GEMM: {problem}")
    flags = (b_transposed, has_bias, act, has_residual, gated, m)
    if math_kind == "cpu":
        return _cpu_program(N, K, dtype, config, *flags, groups=groups)
    if math_kind == "simt":
        return _simt_program(N, K, dtype, config, *flags)
    return _gpu_program(N, K, dtype, config, *flags, split=math_kind == "tf32x3",
                        policy=T.GemmWarpPolicy(config.warp_policy(arch, dtype)), groups=groups)


def group_problem(arch: str, N: int, groups: tuple[int, ...], config: TileConfig, math_kind: str,
                  act: str | None = None, has_residual: bool = False, gated: bool = False) -> str | None:
    """Why a grouped GEMM (`groups`: each weight's N) has no program with these keys, or None. Grouped: two or
    three weights read the same A, each with its own bias and output; no activation, residual or gate (Q/K/V).
    On sm90 it takes the overlap pipeline: TileLang's own lowers one pipelined loop per group and fails on the
    stage buffers of the second."""
    if len(groups) not in (2, 3) or sum(groups) != N or min(groups) < 1:
        return f"groups {groups} must be two or three positive widths summing to N={N}"
    if act is not None or has_residual or gated:
        return "its epilogue is a bias at most (no activation, residual or gate)"
    if math_kind in ("simt", "tf32x3"):
        return f"the {math_kind} program has no grouped form"
    if arch == "sm90" and not config.overlap:
        return "on sm90 it needs the overlap pipeline (TileConfig.overlap)"
    if config.pingpong:
        return "a pingpong kernel's warpgroups walk tiles of one weight"
    return None


def _dispatcher(N: int, groups: tuple[int, ...], bn: int):
    """(column tiles, a macro `dispatch(col, row, A, B, Bias, C, fn, *args)`) running fn(col, row, A, B, Bias, C,
    *args) on column tile `col`. Grouped, B, Bias and C are tuples of the groups' buffers (None: a side of the
    kernel that does not read them), and fn gets the group's own, with `col` counted from the group's first tile."""
    import tilelang.language as T

    if not groups:
        @T.macro
        def direct(col, row, A, B, Bias, C, fn, *args):
            fn(col, row, A, B, Bias, C, *args)

        return -(-N // bn), direct
    n_tiles, per_group = _per_group(groups, bn)

    @T.macro
    def of_group(g, col, row, A, Bs, Biases, Cs, fn, *args):
        fn(col, row, A, _member(Bs, g), _member(Biases, g), _member(Cs, g), *args)

    @T.macro
    def grouped(col, row, A, B, Bias, C, fn, *args):
        per_group(col, of_group, row, A, B, Bias, C, fn, *args)

    return n_tiles, grouped


def _member(group_buffers, g):
    """Group g's buffer of a tuple, None where the tuple is (a side of the kernel that does not read it)."""
    return None if group_buffers is None else group_buffers[g]


def _per_group(groups: tuple[int, ...], bn: int):
    """(column tiles of all groups, a macro `per_group(col, fn, *args)` calling fn(g, col - start of group g,
    *args) for the group g that column tile `col` falls in). Each group's columns start on a tile of their own,
    so a tile never straddles two weights."""
    import tilelang.language as T

    tiles = [-(-n // bn) for n in groups]
    starts = [sum(tiles[:g]) for g in range(len(groups))]

    @T.macro
    def two(col, fn, *args):
        if col < starts[1]:
            fn(0, col, *args)
        else:
            fn(1, col - starts[1], *args)

    @T.macro
    def three(col, fn, *args):
        if col < starts[1]:
            fn(0, col, *args)
        elif col < starts[2]:
            fn(1, col - starts[1], *args)
        else:
            fn(2, col - starts[2], *args)

    return sum(tiles), two if len(groups) == 2 else three


def _epilogue(acc, acc2, bias_v, bias2_v, res_v, act, gated, acc_dt, out_dt, *, cuda: bool):
    """Epilogue value from accumulator(s) and optional bias / residual values (all TIR expressions), to be
    rounded to `out_dt` (activations.activation)."""
    import tilelang.language as T

    x = acc if bias_v is None else acc + T.cast(bias_v, acc_dt)
    x = activation(x, act, acc_dt, out_dt, cuda=cuda)
    if gated:
        x = x * (acc2 if bias2_v is None else acc2 + T.cast(bias2_v, acc_dt))
    if res_v is not None:
        x = x + T.cast(res_v, acc_dt)
    return x


_TF32_MASK = 0xFFFFE000  # sign, exponent and the 10 mantissa bits a tf32 keeps
_EXP_BITS = 0x7F800000


def _tf32_round(x):
    """fp32 x rounded to the nearest tf32 (ties away from zero), as an fp32 value. Where rounding up
    would overflow to inf (and for inf/NaN) it truncates instead, so a finite value stays finite."""
    import tilelang.language as T

    bits = T.reinterpret(x, "uint32")
    up = T.bitwise_and(bits + T.uint32(0x1000), T.uint32(_TF32_MASK))
    down = T.bitwise_and(bits, T.uint32(_TF32_MASK))
    overflow = T.bitwise_and(up, T.uint32(_EXP_BITS)) == T.uint32(_EXP_BITS)
    return T.reinterpret(T.if_then_else(overflow, down, up), "float32")


def _tf32_split(x):
    """(hi, lo): x's tf32 high part and the tf32 rounding of x - hi, so that hi + lo carries 22 of fp32's 24
    significant bits (subnormals keep tf32 precision only). For inf/NaN, lo is NaN: see _tf32x3_sum."""
    hi = _tf32_round(x)
    return hi, _tf32_round(x - hi)


def _tf32x3_sum(big, small):
    """The tf32x3 result from its two accumulators: big = sum a_hi*b_hi, small = sum a_lo*b_hi + a_hi*b_lo.
    big alone carries eager's inf and NaN (an inf or NaN input, an overflowing product); the correction is
    added only where big is finite, so that a low part's product (NaN for an inf input, or an opposite-signed
    overflow) never turns eager's +-inf into NaN."""
    import tilelang.language as T

    finite = T.bitwise_and(T.reinterpret(big, "uint32"), T.uint32(_EXP_BITS)) != T.uint32(_EXP_BITS)
    return T.if_then_else(finite, big + small, big)  # (not big - big == 0: TIR's simplifier folds that to true)


def _gpu_program(N, K, dtype, cfg, b_t, has_bias, act, has_res, gated, m, *, split, policy, groups=()):
    import tilelang.language as T

    bm, bn, bk = cfg.block_tile
    M = T.dynamic("m") if m is None else m
    acc_dt = "float32"
    b_shape = (N, K) if b_t else (K, N)
    bs_shape = (bn, bk) if b_t else (bk, bn)
    stages, threads, swizzle, stage_c, persistent = cfg.stages, cfg.threads, cfg.swizzle, cfg.stage_c, cfg.persistent
    overlap = cfg.overlap

    @T.macro
    def split_tile(src, hi, lo):
        for i, j in T.Parallel(*src.shape[-2:]):
            h, low = _tf32_split(src[i, j])
            hi[i, j] = h
            lo[i, j] = low

    @T.macro
    def mma(A_s, B_s, C_l, C_lo, A_hi, A_lo, B_hi, B_lo):
        if split:  # three tf32 products, the two small ones in their own accumulator (_tf32x3_sum)
            split_tile(A_s, A_hi, A_lo)
            split_tile(B_s, B_hi, B_lo)
            T.gemm(A_lo, B_hi, C_lo, transpose_B=b_t, policy=policy)
            T.gemm(A_hi, B_lo, C_lo, transpose_B=b_t, policy=policy)
            T.gemm(A_hi, B_hi, C_l, transpose_B=b_t, policy=policy)
        else:
            T.gemm(A_s, B_s, C_l, transpose_B=b_t, policy=policy)

    @T.macro
    def finish(bx, by, Bias, Bias2, R, C, C_s, C_l, C_lo, C2_l, C2_lo, bar):
        # the epilogue on the accumulators, then the tile's one store. The activation's input is written to the
        # accumulator first: inline, every use of it in the activation would load and bounds-check the bias again
        if has_bias or split:
            for i, j in T.Parallel(bm, bn):
                C_l[i, j] = _epilogue(_tf32x3_sum(C_l[i, j], C_lo[i, j]) if split else C_l[i, j], None,
                                      Bias[bx * bn + j] if has_bias else None, None, None, None, False, acc_dt,
                                      acc_dt, cuda=True)
                if gated:
                    C2_l[i, j] = _epilogue(_tf32x3_sum(C2_l[i, j], C2_lo[i, j]) if split else C2_l[i, j], None,
                                           Bias2[bx * bn + j] if has_bias else None, None, None, None, False, acc_dt,
                                           acc_dt, cuda=True)
        if act is not None or has_res or gated:
            for i, j in T.Parallel(bm, bn):
                C_l[i, j] = _epilogue(C_l[i, j], C2_l[i, j] if gated else None, None, None,
                                      R[by * bm + i, bx * bn + j] if has_res else None, act, gated, acc_dt, dtype,
                                      cuda=True)
        if stage_c:
            if overlap:  # thread syncs are ours to place here (_overlap_body): C_s is free, then written
                T.sync_threads(bar, cfg.tile_threads)
            T.copy(C_l, C_s)
            if overlap:
                T.sync_threads(bar, cfg.tile_threads)
            T.copy(C_s, C[by * bm:(by + 1) * bm, bx * bn:(bx + 1) * bn])
        else:
            T.copy(C_l, C[by * bm, bx * bn])

    @T.macro
    def tile(bx, by, A, B, B2, Bias, Bias2, R, C, A_s, B_s, B2_s, C_s, C_l, C_lo, C2_l, C2_lo, A_hi, A_lo, B_hi,
             B_lo, B2_hi, B2_lo):
        # one (bm, bn) output tile: clear, the pipelined K loop, the epilogue, the store
        T.clear(C_l)
        if split:
            T.clear(C_lo)
        if gated:
            T.clear(C2_l)
            if split:
                T.clear(C2_lo)
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
            mma(A_s, B_s, C_l, C_lo, A_hi, A_lo, B_hi, B_lo)
            if gated:
                mma(A_s, B2_s, C2_l, C2_lo, A_hi, A_lo, B2_hi, B2_lo)
        finish(bx, by, Bias, Bias2, R, C, C_s, C_l, C_lo, C2_l, C2_lo, 0)

    n_tiles, dispatch = _dispatcher(N, groups, bn)
    # persistent: that many resident blocks walk the tiles, so that the loads of a block's next tile start while
    # it finishes the last one; else one block per tile. The walk goes in panels of `group` column tiles: a group
    # that does not divide the column tiles pads each panel with empty slots, which unbalances the blocks' work.
    grid = (persistent,) if persistent else (n_tiles, T.ceildiv(M, bm))
    group = max(g for g in range(1, max(swizzle, 1) + 1) if n_tiles % g == 0)

    if overlap:
        body = _overlap_body(M, n_tiles, K, dtype, cfg, b_t, grid, group, gated, bs_shape, finish, policy, dispatch)
        return _group_signature(body, M, K, dtype, groups, b_t, has_bias) if groups else _signature(
            body, M, N, K, dtype, b_shape, has_bias, has_res, gated)

    @T.macro
    def one_tile(col, row, A, B, Bias, C, B2, Bias2, R, bufs):
        tile(col, row, A, B, B2, Bias, Bias2, R, C, *bufs)

    @T.macro
    def body(A, B, B2, Bias, Bias2, R, C):
        with T.Kernel(*grid, threads=threads) as ids:
            A_s = T.alloc_shared((bm, bk), dtype)
            B_s = T.alloc_shared(bs_shape, dtype)
            C_l = T.alloc_fragment((bm, bn), acc_dt)
            A_hi = A_lo = B_hi = B_lo = B2_s = B2_hi = B2_lo = C_lo = C2_lo = C2_l = C_s = None
            if split:
                A_hi = T.alloc_shared((bm, bk), dtype)
                A_lo = T.alloc_shared((bm, bk), dtype)
                B_hi = T.alloc_shared(bs_shape, dtype)
                B_lo = T.alloc_shared(bs_shape, dtype)
                C_lo = T.alloc_fragment((bm, bn), acc_dt)
            if gated:
                B2_s = T.alloc_shared(bs_shape, dtype)
                C2_l = T.alloc_fragment((bm, bn), acc_dt)
                if split:
                    B2_hi = T.alloc_shared(bs_shape, dtype)
                    B2_lo = T.alloc_shared(bs_shape, dtype)
                    C2_lo = T.alloc_fragment((bm, bn), acc_dt)
            if stage_c:
                C_s = T.alloc_shared((bm, bn), dtype)
            bufs = (A_s, B_s, B2_s, C_s, C_l, C_lo, C2_l, C2_lo, A_hi, A_lo, B_hi, B_lo, B2_hi, B2_lo)
            if persistent:
                # the tile's coordinates once per tile, in registers: left inline, every epilogue index repeats the
                # walk's divisions by the (dynamic) row-tile count, and ptxas spills the unrolled epilogue
                row = T.alloc_var("int32")
                col = T.alloc_var("int32")
                for by, bx in T.Persistent([T.ceildiv(M, bm), n_tiles], persistent, ids, group_size=group):
                    row = by
                    col = bx
                    dispatch(col, row, A, B, Bias, C, one_tile, B2, Bias2, R, bufs)
            else:
                if swizzle > 0:
                    T.use_swizzle(panel_size=swizzle)
                dispatch(ids[0], ids[1], A, B, Bias, C, one_tile, B2, Bias2, R, bufs)

    if groups:
        return _group_signature(body, M, K, dtype, groups, b_t, has_bias)
    return _signature(body, M, N, K, dtype, b_shape, has_bias, has_res, gated)


# the named barrier the overlap kernel's consumer warpgroups sync on (0 is __syncthreads); pingpong: this and the next
_CONSUMER_BARRIER = 3


def _overlap_loads(b_t, gated, bm, bn, bk):
    """The producer's TMA loads of K step k into stage s, each arriving on `full`."""
    import tilelang.language as T

    def b_tile(B, bx, k):
        return B[bx * bn:(bx + 1) * bn, k * bk:(k + 1) * bk] if b_t else B[k * bk:(k + 1) * bk, bx * bn:(bx + 1) * bn]

    @T.macro
    def loads(A, B, B2, A_s, B_s, B2_s, full, s, bx, by, k):
        T.tma_copy(A[by * bm:(by + 1) * bm, k * bk:(k + 1) * bk], A_s[s, :, :], barrier=full[s])
        T.tma_copy(b_tile(B, bx, k), B_s[s, :, :], barrier=full[s])
        if gated:
            T.tma_copy(b_tile(B2, bx, k), B2_s[s, :, :], barrier=full[s])

    return loads


def _overlap_body(M, n_tiles, K, dtype, cfg, b_t, grid, group, gated, bs_shape, finish, policy, dispatch):
    """The sm90 kernel of TileConfig.overlap: a TMA producer warpgroup (the last) and cfg.threads of consumer
    warpgroups, written out because TileLang's own pipeline waits for each K step's wgmma group before it gives
    the stage back. Here a consumer issues step g's group, waits until only that one is in flight, and only
    then gives back step g-1's stage (`empty`); a tile's last stage is given back after its final wait, before
    the epilogue. Both sides count K steps across a persistent block's tiles (`step`), which fixes each step's
    stage and barrier phase. TileLang's thread-sync pass would put a __syncthreads between the two sides
    (deadlock), so it is off for this kernel (OWN_SYNCS_PASS_CONFIGS) and the consumers' syncs around the staged
    output tile are placed by `finish`. With cfg.pingpong the two consumer warpgroups take whole tiles in turn
    (`take_turns`) instead of sharing each one. `dispatch` picks a grouped GEMM's weight, bias and output by
    column tile (_gpu_program), where the producer loads and the consumers store."""
    import tilelang.language as T

    bm, bn, bk = cfg.block_tile
    stages, threads, persistent = cfg.stages, cfg.threads, cfg.persistent
    consumers = tuple(range(threads // 128))
    producer = len(consumers)
    acc_dt = "float32"
    loads = _overlap_loads(b_t, gated, bm, bn, bk)
    # a step's groups (two when gated) may stay in flight: the wait after its last one; gated, B's issues unwaited
    b_wait = -1 if gated else 1

    @T.macro
    def produce(A, B, B2, A_s, B_s, B2_s, full, empty, step, bx, by):
        for k in T.serial(T.ceildiv(K, bk)):
            s = step[0] % stages
            T.mbarrier_wait_parity(empty[s], (step[0] // stages) % 2 ^ 1)
            loads(A, B, B2, A_s, B_s, B2_s, full, s, bx, by, k)
            T.mbarrier_arrive(full[s])
            step[0] = step[0] + 1

    @T.macro
    def produce_one(col, row, A, B, Bias, C, B2, A_s, B_s, B2_s, full, empty, step):
        produce(A, B, B2, A_s, B_s, B2_s, full, empty, step, col, row)

    @T.macro
    def finish_one(col, row, A, B, Bias, C, Bias2, R, C_s, C_l, C2_l):
        finish(col, row, Bias, Bias2, R, C, C_s, C_l, None, C2_l, None, _CONSUMER_BARRIER)

    def walk(ids):
        # a persistent block's tiles, (row tile, column tile) in the walk's order
        return T.Persistent([T.ceildiv(M, bm), n_tiles], persistent, ids, group_size=group)

    @T.macro
    def produce_tiles(ids, A, B, B2, A_s, B_s, B2_s, full, empty, step):
        # the producer warpgroup of a persistent block: every tile's K steps, in the walk's order
        T.dec_max_nreg(24)
        row = T.alloc_var("int32")
        col = T.alloc_var("int32")
        for by, bx in walk(ids):
            row = by
            col = bx
            dispatch(col, row, A, B, None, None, produce_one, B2, A_s, B_s, B2_s, full, empty, step)

    @T.macro
    def consume(A_s, B_s, B2_s, C_l, C2_l, full, empty, step):
        T.clear(C_l)
        if gated:
            T.clear(C2_l)
        for k in T.serial(T.ceildiv(K, bk)):
            s = step[0] % stages
            T.mbarrier_wait_parity(full[s], (step[0] // stages) % 2)
            T.gemm(A_s[s, :, :], B_s[s, :, :], C_l, transpose_B=b_t, policy=policy, annotations={"wg_wait": b_wait})
            if gated:
                T.gemm(A_s[s, :, :], B2_s[s, :, :], C2_l, transpose_B=b_t, policy=policy, annotations={"wg_wait": 2})
            if k > 0:
                T.mbarrier_arrive(empty[(step[0] + stages - 1) % stages])
            step[0] = step[0] + 1
        T.warpgroup_wait(0)
        T.mbarrier_arrive(empty[(step[0] + stages - 1) % stages])

    @T.macro
    def take_turns(w, ids, A_s, B_s, C_s, C_l, full, empty, done, step, tiles, Bias, R, C):
        # consumer warpgroup w's share of a pingpong block: the block's tiles t = w, w + 2, ... Before a tile's K
        # loop it waits for the other warpgroup's loop of tile t - 1 (`done`, one phase per loop: for tile 0 the
        # parity of a phase before the first, which passes), so the two K loops run one after the other and each
        # warpgroup's epilogue overlaps the other's loop. Waiting keeps the stage barriers' phases unambiguous: a
        # warpgroup starts on tile t's steps only once tile t - 1's have all been taken.
        row = T.alloc_var("int32")
        col = T.alloc_var("int32")
        for by, bx in walk(ids):
            row = by
            col = bx
            if tiles[0] % 2 == w:
                T.mbarrier_wait_parity(done[1 - w], (tiles[0] // 2 + 1 - w) % 2)
                consume(A_s, B_s, None, C_l, None, full, empty, step)
                T.mbarrier_arrive(done[w])
                finish(col, row, Bias, None, R, C, C_s[w, :, :] if cfg.stage_c else None, C_l, None, None, None,
                       _CONSUMER_BARRIER + w)
            else:
                step[0] = step[0] + T.ceildiv(K, bk)
            tiles[0] = tiles[0] + 1

    @T.macro
    def pingpong(A, B, B2, Bias, Bias2, R, C):
        with T.Kernel(*grid, threads=threads + 128) as ids:
            A_s = T.alloc_shared((stages, bm, bk), dtype)
            B_s = T.alloc_shared((stages, *bs_shape), dtype)
            # one staged output tile per warpgroup, in one buffer: TileLang would lay two buffers used in different
            # warp-specialized branches over each other
            C_s = T.alloc_shared((2, bm, bn), dtype) if cfg.stage_c else None
            C_l0 = T.alloc_fragment((bm, bn), acc_dt)
            C_l1 = T.alloc_fragment((bm, bn), acc_dt)
            full = T.alloc_barrier([128] * stages)
            empty = T.alloc_barrier([128] * stages)  # one warpgroup takes each step
            done = T.alloc_barrier([128, 128])  # a phase per K loop of warpgroup 0, of warpgroup 1
            step = T.alloc_local((1,), "int32")
            step[0] = 0
            tiles = T.alloc_local((1,), "int32")  # tiles of the block walked so far
            tiles[0] = 0
            with T.ws(2):
                produce_tiles(ids, A, B, None, A_s, B_s, None, full, empty, step)
            with T.ws(0):
                T.inc_max_nreg(240)
                take_turns(0, ids, A_s, B_s, C_s, C_l0, full, empty, done, step, tiles, Bias, R, C)
            with T.ws(1):
                T.inc_max_nreg(240)
                take_turns(1, ids, A_s, B_s, C_s, C_l1, full, empty, done, step, tiles, Bias, R, C)

    @T.macro
    def body(A, B, B2, Bias, Bias2, R, C):
        with T.Kernel(*grid, threads=threads + 128) as ids:
            A_s = T.alloc_shared((stages, bm, bk), dtype)
            B_s = T.alloc_shared((stages, *bs_shape), dtype)
            B2_s = T.alloc_shared((stages, *bs_shape), dtype) if gated else None
            C_s = T.alloc_shared((bm, bn), dtype) if cfg.stage_c else None
            C_l = T.alloc_fragment((bm, bn), acc_dt)
            C2_l = T.alloc_fragment((bm, bn), acc_dt) if gated else None
            full = T.alloc_barrier([128] * stages)
            empty = T.alloc_barrier([threads] * stages)
            step = T.alloc_local((1,), "int32")  # a buffer: the macros below advance it
            step[0] = 0
            if persistent:
                with T.ws(producer):
                    produce_tiles(ids, A, B, B2, A_s, B_s, B2_s, full, empty, step)
                with T.ws(*consumers):
                    T.inc_max_nreg(240)
                    row = T.alloc_var("int32")
                    col = T.alloc_var("int32")
                    for by, bx in walk(ids):
                        row = by
                        col = bx
                        consume(A_s, B_s, B2_s, C_l, C2_l, full, empty, step)
                        dispatch(col, row, A, None, Bias, C, finish_one, Bias2, R, C_s, C_l, C2_l)
            else:
                if cfg.swizzle > 0:
                    T.use_swizzle(panel_size=cfg.swizzle)
                with T.ws(producer):
                    T.dec_max_nreg(24)
                    dispatch(ids[0], ids[1], A, B, None, None, produce_one, B2, A_s, B_s, B2_s, full, empty, step)
                with T.ws(*consumers):
                    T.inc_max_nreg(240)
                    consume(A_s, B_s, B2_s, C_l, C2_l, full, empty, step)
                    dispatch(ids[0], ids[1], A, None, Bias, C, finish_one, Bias2, R, C_s, C_l, C2_l)

    return pingpong if cfg.pingpong else body


def _simt_program(N, K, dtype, cfg, b_t, has_bias, act, has_res, gated, m):
    """FMA on CUDA cores from register fragments; each thread owns the accumulators TileConfig.simt_owner
    places. Shared rows are padded by 16 bytes, which puts consecutive rows in distinct banks: the warp's
    16-byte fragment loads along K are conflict-free."""
    import tilelang.language as T

    bm, bn, bk = cfg.block_tile
    _, _, wk, tm, tn = cfg.simt_tiles(dtype)
    e = 2 if dtype in ("float16", "bfloat16") else 4
    pad = 16 // e
    vec = math.gcd(wk, pad)  # fragment loads of up to 16 bytes
    M = T.dynamic("m") if m is None else m
    acc_dt = "float32"
    b_shape = (N, K) if b_t else (K, N)
    bs_shape = (bn, bk + pad) if b_t else (bk, bn + pad)
    bs_view = (slice(0, bn), slice(0, bk)) if b_t else (slice(0, bk), slice(0, bn))
    stages, threads, swizzle = cfg.stages, cfg.threads, cfg.swizzle

    @T.macro
    def load_b(B_s, b_r, kc, tx):
        for j in T.unroll(tn):
            col = cfg.simt_owner(dtype, tx, 0, j)[1]
            if b_t:
                for qo in T.unroll(wk // vec):
                    for qi in T.vectorized(vec):
                        b_r[j, qo * vec + qi] = B_s[col, kc * wk + qo * vec + qi]
            else:  # K runs down B's rows: one element per row
                for q in T.unroll(wk):
                    b_r[j, q] = B_s[kc * wk + q, col]

    @T.macro
    def body(A, B, B2, Bias, Bias2, R, C):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=threads) as (bx, by):
            A_s = T.alloc_shared((bm, bk + pad), dtype)
            B_s = T.alloc_shared(bs_shape, dtype)
            acc = T.alloc_local((tm, tn), acc_dt)
            a_r = T.alloc_local((tm, wk), dtype)
            b_r = T.alloc_local((tn, wk), dtype)
            B2_s = acc2 = b2_r = None
            if gated:
                B2_s = T.alloc_shared(bs_shape, dtype)
                acc2 = T.alloc_local((tm, tn), acc_dt)
                b2_r = T.alloc_local((tn, wk), dtype)
            tx = T.get_thread_binding()
            if swizzle > 0:
                T.use_swizzle(panel_size=swizzle)
            for i, j in T.grid(tm, tn):
                acc[i, j] = T.cast(0, acc_dt)
                if gated:
                    acc2[i, j] = T.cast(0, acc_dt)
            for ko in T.Pipelined(T.ceildiv(K, bk), num_stages=stages):
                # cp.async, not TMA: a TMA box cannot write padded rows
                T.copy(A[by * bm, ko * bk], A_s[0:bm, 0:bk], disable_tma=True)
                if b_t:
                    T.copy(B[bx * bn, ko * bk], B_s[bs_view], disable_tma=True)
                else:
                    T.copy(B[ko * bk, bx * bn], B_s[bs_view], disable_tma=True)
                if gated:
                    if b_t:
                        T.copy(B2[bx * bn, ko * bk], B2_s[bs_view], disable_tma=True)
                    else:
                        T.copy(B2[ko * bk, bx * bn], B2_s[bs_view], disable_tma=True)
                for kc in T.serial(bk // wk):
                    for i in T.unroll(tm):
                        row = cfg.simt_owner(dtype, tx, i, 0)[0]
                        for qo in T.unroll(wk // vec):
                            for qi in T.vectorized(vec):
                                a_r[i, qo * vec + qi] = A_s[row, kc * wk + qo * vec + qi]
                    load_b(B_s, b_r, kc, tx)
                    if gated:
                        load_b(B2_s, b2_r, kc, tx)
                    for q in T.unroll(wk):
                        for i in T.unroll(tm):
                            for j in T.unroll(tn):
                                acc[i, j] += T.cast(a_r[i, q], acc_dt) * T.cast(b_r[j, q], acc_dt)
                                if gated:
                                    acc2[i, j] += T.cast(a_r[i, q], acc_dt) * T.cast(b2_r[j, q], acc_dt)
            for i in T.unroll(tm):
                for j in T.unroll(tn):
                    r, c = cfg.simt_owner(dtype, tx, i, j)
                    r, c = by * bm + r, bx * bn + c
                    if r < M and c < N:
                        C[r, c] = T.cast(
                            _epilogue(
                                acc[i, j],
                                acc2[i, j] if gated else None,
                                Bias[c] if has_bias else None,
                                Bias2[c] if (has_bias and gated) else None,
                                R[r, c] if has_res else None,
                                act,
                                gated,
                                acc_dt,
                                dtype,
                                cuda=True,
                            ),
                            dtype,
                        )

    return _signature(body, M, N, K, dtype, b_shape, has_bias, has_res, gated)


def _cpu_program(N, K, dtype, cfg, b_t, has_bias, act, has_res, gated, m, groups=()):
    import tilelang.language as T
    from tilelang.cpu.language import Kernel as CpuKernel

    bm, bn, bk = cfg.block_tile
    M = T.dynamic("m") if m is None else m
    acc_dt = dtype  # float32 or float64: accumulate in the input precision (fp64 stays fp64)
    b_shape = (N, K) if b_t else (K, N)
    n_tiles, dispatch = _dispatcher(N, groups, bn)

    @T.macro
    def tile(bx, by, A, B, Bias, C, B2, Bias2, R):
        N = C.shape[1]  # grouped: this group's
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
                    dtype,
                    cuda=False,
                )

    @T.macro
    def body(A, B, B2, Bias, Bias2, R, C):
        with CpuKernel(n_tiles, T.ceildiv(M, bm)) as (bx, by):
            dispatch(bx, by, A, B, Bias, C, tile, B2, Bias2, R)

    if groups:
        return _group_signature(body, M, K, dtype, groups, b_t, has_bias)
    return _signature(body, M, N, K, dtype, b_shape, has_bias, has_res, gated)


def _group_signature(body, M, K, dtype, groups, b_t, has_bias):
    """The grouped GEMM's prim_func: A, B0, B1[, B2], [Bias0, Bias1[, Bias2]], C0, C1[, C2]."""
    import tilelang.language as T

    b0_t, b1_t, b2_t = (T.Tensor((n, K) if b_t else (K, n), dtype) for n in (*groups, groups[0])[:3])
    v0_t, v1_t, v2_t = (T.Tensor((n,), dtype) for n in (*groups, groups[0])[:3])
    c0_t, c1_t, c2_t = (T.Tensor((M, n), dtype) for n in (*groups, groups[0])[:3])
    a_t = T.Tensor((M, K), dtype)
    key = (len(groups), has_bias)
    if key == (2, False):

        @T.prim_func
        def gemm_group_kernel(A: a_t, B0: b0_t, B1: b1_t, C0: c0_t, C1: c1_t):
            body(A, (B0, B1), None, (None, None), None, None, (C0, C1))

    elif key == (2, True):

        @T.prim_func
        def gemm_group_kernel(A: a_t, B0: b0_t, B1: b1_t, Bias0: v0_t, Bias1: v1_t, C0: c0_t, C1: c1_t):
            body(A, (B0, B1), None, (Bias0, Bias1), None, None, (C0, C1))

    elif key == (3, False):

        @T.prim_func
        def gemm_group_kernel(A: a_t, B0: b0_t, B1: b1_t, B2: b2_t, C0: c0_t, C1: c1_t, C2: c2_t):
            body(A, (B0, B1, B2), None, (None, None, None), None, None, (C0, C1, C2))

    else:

        @T.prim_func
        def gemm_group_kernel(A: a_t, B0: b0_t, B1: b1_t, B2: b2_t, Bias0: v0_t, Bias1: v1_t, Bias2: v2_t, C0: c0_t,
                              C1: c1_t, C2: c2_t):
            body(A, (B0, B1, B2), None, (Bias0, Bias1, Bias2), None, None, (C0, C1, C2))

    return gemm_group_kernel


def _signature(body, M, N, K, dtype, b_shape, has_bias, has_res, gated):
    """A prim_func with exactly the buffers used (TVMScript signatures cannot be conditional)."""
    import tilelang.language as T

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


def kernel_key(arch, N, K, dtype, config, b_transposed=False, has_bias=False, act=None, has_residual=False,
               gated=False, m=None, precision="ieee", groups=()) -> tuple:
    """compiled_kernel's arguments as its cache key: dtype by name, stages set, precision "tf32" only where it
    changes the program (fp32 on tensor cores), so that equal programs share one compiled kernel."""
    dtype = dtype_name(dtype)
    config = config.with_stages(arch, dtype, 2 if gated else 1, precision)
    precision = "tf32" if config.math(arch, dtype, precision) == "tf32" else "ieee"
    return (arch, N, K, dtype, config, b_transposed, has_bias, act, has_residual, gated, m, precision, tuple(groups))


def _compile(key, device=None):
    arch, N, K, dtype, config, b_t, has_bias, act, has_res, gated, m, precision, groups = key

    def program():
        return gemm_program(arch, N, K, dtype, config, b_transposed=b_t, has_bias=has_bias, act=act,
                            has_residual=has_res, gated=gated, m=m, precision=precision, groups=groups)

    if arch == "cpu":
        import tilelang

        return tilelang.compile(program(), target="c", target_host="c", execution_backend="cython")
    # sm80 on a newer GPU is built for that GPU with Hopper features off (arch.run_target says why).
    configs = {**run_pass_configs(arch, device), **program_pass_configs(config)}
    return gpu_compile(("gemm", *key), program, run_target(arch, device), configs)


def program_pass_configs(config: TileConfig) -> dict[str, bool]:
    """The pass configs `gemm_program(..., config)` must be lowered with (its own, beside the arch's)."""
    return OWN_SYNCS_PASS_CONFIGS if config.overlap else {}


def compiled_kernel(arch, N, K, dtype, config, b_transposed=False, has_bias=False, act=None,
                    has_residual=False, gated=False, m=None, precision="ieee", groups=()):
    """The compiled kernel for a key, cached in memory (never recompiled in a warm process; TileLang
    also caches on disk, so a new process loads instead of compiling)."""
    return kernel_for_key(kernel_key(arch, N, K, dtype, config, b_transposed, has_bias, act, has_residual, gated,
                                     m, precision, groups))


def kernel_for_key(key: tuple, device: str | None = None):
    """compiled_kernel of a `kernel_key`, built to run on `device` ("sm_90"; None: this machine's GPU)."""
    kern = _CACHE.get(key)
    if kern is not None:
        return kern
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _CACHE:
            _CACHE[key] = _compile(key, device)
    return _CACHE[key]


def _timed(compile_fn, *args):
    """(seconds, None) or (None, error) of one compile; the error is reported, and the caller's own compile
    raises it again if the kernel is used."""
    t = time.perf_counter()
    try:
        compile_fn(*args)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"
    return time.perf_counter() - t, None


def _precompile_job(job):
    """One precompile worker job: (key, the parent's GPU as "sm_XY") -> (seconds, error)."""
    return _timed(_compile, *job)


def precompile(keys, workers: int | None = None) -> dict:
    """Compile kernels (tuples of compiled_kernel's positional arguments) in parallel; returns
    {key: (seconds or None, error or None)} for the keys not already compiled in this process.

    Workers are processes forked from a fresh interpreter (tkopt/kernels/workers.py: never the user's __main__) that
    fill TileLang's disk cache, from which later compiled_kernel calls here load. With one worker, compiles
    here, in memory."""
    todo = [k for k in dict.fromkeys(kernel_key(*k) for k in keys) if k not in _CACHE]
    if not todo:
        return {}
    workers = workers or default_workers(len(todo))
    if workers == 1 or len(todo) == 1:
        return {k: _timed(compiled_kernel, *k) for k in todo}
    device = device_sm()
    try:
        return dict(zip(todo, map_in_workers(_precompile_job, [(k, device) for k in todo], workers), strict=True))
    except Exception as exc:  # kernels then compile on first use, serially
        return {k: (None, f"precompile workers failed: {type(exc).__name__}: {exc}") for k in todo}


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


def pad_operands(a2, bs, biases, b_transposed, K, Kp, ns, nps):
    """A (M, K), the weights and their biases as the kernel takes them: TMA / 16-byte vector copies need 16-byte
    aligned row strides, so on GPU K and each weight's N (`ns`) are zero-padded to `Kp` and `nps` (padded_nk; zeros
    in K add nothing, padded N columns are computed and dropped)."""
    pad = torch.nn.functional.pad
    if Kp != K:
        a2 = pad(a2, (0, Kp - K))
        bs = [pad(b, (0, Kp - K) if b_transposed else (0, 0, 0, Kp - K)) for b in bs]
    bs = [b if p == n else pad(b, (0, 0, 0, p - n) if b_transposed else (0, p - n))
          for b, n, p in zip(bs, ns, nps, strict=True)]
    biases = [x if x is None or p == n else pad(x, (0, p - n)) for x, n, p in zip(biases, ns, nps, strict=True)]
    return a2, bs, biases


def _launch(arch, config, a, bs, biases, act, residual, b_transposed, out, out_shape, M, N, K, gated,
            precision="ieee"):
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
    res2 = None if residual is None else residual.reshape(M, N)
    Np, Kp = padded_nk(arch, N, K, a.element_size())
    a2, bs, biases = pad_operands(a.reshape(M, K), bs, biases, b_transposed, K, Kp, [N] * len(bs), [Np] * len(bs))
    if Np != N:
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
                           has_residual=res2 is not None, gated=gated, precision=precision)
    kern(*args, c)
    if direct:
        return out
    if Np != N:
        c = c[:, :N]
    if out is not None:
        return out.copy_(c.reshape(out_shape))
    return c.reshape(out_shape)


def fp32_precision(arch: str, dtype: torch.dtype) -> str:
    """The precision key of a GEMM now: torch's fp32 matmul switch for fp32 on the GPU, else "ieee"."""
    return matmul_precision() if arch != "cpu" and dtype == torch.float32 else "ieee"


def _resolve_config(config, arch, dtype, gated, precision):
    if isinstance(config, dict):
        config = TileConfig.from_dict(config)
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a TileConfig (or its dict), got {type(config).__name__}")
    if arch == "cpu":
        # the cpu variant is scalar: keep the user's tile sizes, drop the GPU-only knobs
        config = TileConfig(block_tile=config.block_tile, stages=1, threads=1, use_tensorcore=False, swizzle=0,
                            stage_c=False)
    return config.validate(arch, dtype, accumulators=2 if gated else 1, precision=precision)


def gemm_custom(a, b, config, bias=None, act=None, residual=None, b_transposed=False, *, out=None, arch=None):
    """`gemm` with your TileConfig (or its dict), validated for the arch first: an invalid config raises
    UnsupportedError naming the failed constraint and the nearest valid config.

    On the GPU, use_tensorcore=False gives the CUDA-core (SIMT) kernel; fp32 on tensor cores follows torch's
    matmul precision like `gemm`. On cpu the tile sizes are kept and the GPU-only knobs dropped.

    >>> import torch
    >>> from tkopt.kernels import TileConfig, gemm_custom
    >>> a, b = torch.randn(50, 40), torch.randn(40, 30)
    >>> config = TileConfig(block_tile=(16, 16, 8))
    >>> torch.allclose(gemm_custom(a, b, config, act="relu"), torch.relu(a @ b), atol=1e-5)
    True
    """
    arch, M, N, K, out_shape = check_inputs(a, b, bias, act, residual, b_transposed, arch)
    precision = fp32_precision(arch, a.dtype)
    config = _resolve_config(config, arch, a.dtype, gated=False, precision=precision)
    return _launch(arch, config, a, [b], [bias], act, residual, b_transposed, out, out_shape, M, N, K, False,
                   precision)


# Small tuning spaces: 16-bit inputs per arch; fp32 per arch and precision ("ieee": SIMT configs only, since
# tf32x3 measured 2.2x cuBLAS's error on the H200, short of `A @ B`'s accuracy; see config.FP32_FULL).
TUNE_CANDIDATES = {
    # sm90: the two wide tiles on TileLang's pipeline; the 128x128 and 128x192 tiles on the overlap pipeline, each
    # consumer warpgroup one m64 x bn wgmma; the 128x128 pingpong tile. On an H100 (2026-12-06, bench_gemm.py
    # --persistent and benchmarks/tuning_db.py): 128x192 persistent was the fastest kernel at BERT's and GPT-2's
    # projections, the wide tiles at Llama's 2048 columns, pingpong at 4 of the models' 37 GEMM keys (by up to 5%)
    "sm90": [
        dict(block_tile=(128, 256, 64), stages=3, threads=256),
        dict(block_tile=(256, 128, 64), stages=3, threads=256),
        dict(block_tile=(128, 128, 64), warp_tile=(16, 128), stages=4, threads=256, overlap=True),
        dict(block_tile=(128, 192, 64), warp_tile=(16, 192), stages=4, threads=256, overlap=True),
        dict(block_tile=(128, 128, 64), warp_tile=(32, 128), stages=4, threads=256, overlap=True, pingpong=True),
    ],
    "sm80": [
        dict(block_tile=(128, 128, 32), stages=3, threads=128),
        dict(block_tile=(128, 256, 32), stages=3, threads=256),
        dict(block_tile=(128, 128, 64), stages=3, threads=256),
        dict(block_tile=(256, 128, 32), stages=3, threads=256),
    ],
}
# gated (two accumulators): tiles at most 128 wide
GATED_TUNE_CANDIDATES = {
    "sm90": [
        dict(block_tile=(256, 128, 64), stages=3, threads=256),
        dict(block_tile=(128, 128, 64), stages=4, threads=256),
        dict(block_tile=(128, 128, 64), stages=3, threads=256),
    ],
    "sm80": [
        dict(block_tile=(128, 128, 32), stages=3, threads=128),
        dict(block_tile=(128, 128, 64), stages=3, threads=256),
        dict(block_tile=(256, 128, 32), stages=3, threads=256),
    ],
}
FP32_TUNE_CANDIDATES = {
    ("sm90", "ieee"): [
        dict(block_tile=(128, 128, 16), stages=3, threads=256, use_tensorcore=False),
        dict(block_tile=(128, 64, 16), stages=3, threads=128, use_tensorcore=False),
    ],
    ("sm90", "tf32"): [
        dict(block_tile=(128, 128, 32), stages=3, threads=256),
        dict(block_tile=(128, 128, 32), stages=4, threads=256, stage_c=False),
        dict(block_tile=(128, 128, 64), stages=2, threads=256),
    ],
    ("sm80", "ieee"): [
        dict(block_tile=(128, 128, 16), stages=3, threads=256, use_tensorcore=False),
        dict(block_tile=(128, 64, 16), stages=3, threads=128, use_tensorcore=False),
    ],
    ("sm80", "tf32"): [
        dict(block_tile=(128, 128, 32), stages=2, threads=128),
        dict(block_tile=(128, 128, 32), stages=3, threads=256, stage_c=False),
        dict(block_tile=(64, 128, 32), stages=3, threads=128),
    ],
}


# sm90 where a 128x128 grid is under one wave (BERT 1x128): smaller tiles put more blocks on the SMs
SMALL_M_CANDIDATES = [
    dict(block_tile=(128, 128, 64), warp_tile=(16, 128), stages=4, threads=256, overlap=True),
    dict(block_tile=(64, 128, 64), warp_tile=(16, 128), stages=4, threads=128, overlap=True),
    dict(block_tile=(64, 64, 64), warp_tile=(16, 64), stages=4, threads=128, overlap=True),
]


def _tiles(M: int, N: int, bm: int, bn: int) -> int:
    """Output tiles of an M x N GEMM in bm x bn tiles, at M's tuning bucket."""
    from .tuning import shape_bucket

    return -(-shape_bucket(M) // bm) * -(-N // bn)


def _persistent_beyond_one_wave(cand: dict, M: int, N: int, sms: int) -> dict:
    """An overlap-pipeline candidate as a persistent kernel where its grid (at M's tuning bucket) is more than one
    wave. On an H100 (2026-12-06, benchmarks/bench_gemm.py --persistent) the persistent 128x128 and 128x192
    overlap kernels ran 1.02-1.16x their one-block-per-tile selves at BERT's and GPT-2's 8192-row projections,
    where the wide tiles on TileLang's pipeline ran 0.85-1.05x theirs; at one wave or less it only adds the walk."""
    if not cand.get("overlap") or _tiles(M, N, *cand["block_tile"][:2]) <= sms:
        return cand
    return {**cand, "persistent": sms}


def _candidate(cfg: TileConfig) -> dict:
    """A config as a tuning candidate: block_tile and the fields that differ from TileConfig's defaults."""
    defaults = TileConfig()
    d = {"block_tile": cfg.block_tile}
    d.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(TileConfig)
              if f.name != "block_tile" and getattr(cfg, f.name) != getattr(defaults, f.name)})
    return d


def _tuning_key(M, N, K, dtype, act, has_bias, has_res, b_t, precision, groups=()) -> tuple:
    from .tuning import shape_bucket

    key = (shape_bucket(M), N, K, str(dtype), act, has_bias, has_res, b_t, precision)
    return (*key, tuple(groups)) if groups else key


def tuning_space(arch, M, N, dtype, gated=False, precision="ieee", sms=None, groups=()) -> tuple[TileConfig,
                                                                                                list[dict]]:
    """(the default config, the tuning candidates) of a GEMM with M rows: candidates only where it tunes (a GPU
    and M > 64). The one definition select_config and planned_kernels share. A grouped GEMM (`groups`) takes
    the candidates that have a grouped program."""
    acc = 2 if gated else 1
    default = default_config(arch, dtype, accumulators=acc, m=M, n=N, sms=sms, precision=precision)
    if groups:
        default = group_default(arch, dtype, M, N, sms, precision, default)
        return default, [c for c in tuning_space(arch, M, N, dtype, precision=precision, sms=sms)[1]
                         if _group_valid(c, arch, dtype, N, groups, precision)]
    if arch == "cpu" or M <= 64:
        return default, []
    if dtype == torch.float32:
        space = FP32_TUNE_CANDIDATES[(arch, precision)]
    elif gated:
        space = GATED_TUNE_CANDIDATES[arch]
    else:
        space = TUNE_CANDIDATES[arch]
        if arch == "sm90" and sms:
            space = SMALL_M_CANDIDATES if _tiles(M, N, 128, 128) < sms else space
            space = [_persistent_beyond_one_wave(c, M, N, sms) for c in space]
    return default, [c for c in space if _valid(c, arch, dtype, acc, precision)]


def select_config(kind, arch, M, N, K, dtype, act, has_bias, has_res, b_t, run, gated=False,
                  precision="ieee", groups=()) -> TileConfig:
    """Default config, or the tuned one (tkopt/kernels/tuning.py) for GPU GEMMs with M > 64. `groups`: a grouped
    GEMM's padded widths (the kernel's), which its tuning key holds."""
    from .tuning import cached_entry, pick_config, tuning_enabled, tuning_suspended

    acc = 2 if gated else 1
    # The memo first: this runs on every call, and building the candidates costs ~100 us of Python.
    key = _tuning_key(M, N, K, dtype, act, has_bias, has_res, b_t, precision, groups)
    mkey = (kind, arch, key, gated)
    hit = _SELECTED.get(mkey)
    if hit is not None:
        return hit
    default, cands = tuning_space(arch, M, N, dtype, gated, precision, _sm_count(arch), groups)
    if not cands:
        _SELECTED[mkey] = default
        return default

    def bench(c):
        return run(TileConfig(**c).validate(arch, dtype, acc, precision))

    if tuning_enabled(arch) and len(cands) > 1 and cached_entry(kind, arch, key) is None:
        # compile every candidate in parallel worker interpreters first (disk cache), then time them one by one;
        # a build wave ahead (planned_kernels) leaves none to compile here
        Np, Kp, gp = _padded(arch, N, K, dtype, groups)
        precompile([(arch, Np, Kp, dtype, TileConfig(**c), b_t, has_bias, act, has_res, gated, None, precision, gp)
                    for c in cands])
    chosen = TileConfig(**pick_config(kind, arch, key, cands, _candidate(default), bench))
    if not tuning_suspended():  # a config picked while tuning is suspended is not final
        _SELECTED[mkey] = chosen
    return chosen


def planned_kernels(kind, build: Build, M, N, K, dtype, act, has_bias, has_res, b_t, gated=False,
                    groups=()) -> list[Compile]:
    """The compiles `gemm` / `gated_mlp` / `gemm_group` calls with M rows will use on `build`: the cached winner,
    else where select_config would tune every candidate (tuning never times the default), else the default config
    (each once, as kernel_key dedupes); none where `gemm` is decided for cuBLASLt's epilogue. `groups`: a grouped
    GEMM's widths."""
    from .tuning import planned_configs

    if M == 0 or N == 0 or K == 0:
        return []
    arch = build.arch
    precision = fp32_precision(arch, dtype)
    if (kind == "gemm" and _library_epilogue(build.gpu is not None, has_bias, act, has_res)
            and _library_choice(arch, _library_key(M, N, K, dtype, act, b_t, precision))):
        return []  # decided for cuBLASLt's epilogue: it builds nothing
    Np, Kp, gp = _padded(arch, N, K, dtype, groups)
    default, cands = tuning_space(arch, M, Np, dtype, gated, precision, build.sms, gp)
    if gp and not _group_valid(_candidate(default), arch, dtype, Np, gp, precision):
        return []  # no grouped program: each weight's own GEMM runs (gemm_group)
    key = _tuning_key(M, Np if gp else N, K, dtype, act, has_bias, has_res, b_t, precision, gp)
    configs = [TileConfig(**c) for c in planned_configs(kind, arch, key, cands, _candidate(default))]
    keys = dict.fromkeys(kernel_key(arch, Np, Kp, dtype, c, b_t, has_bias, act, has_res, gated, None, precision,
                                    gp) for c in configs)
    return [Compile.of(kernel_for_key, k, build.gpu) for k in keys]


def _padded(arch, N, K, dtype, groups=()) -> tuple[int, int, tuple[int, ...]]:
    """(N, K, groups) as the kernel is compiled (padded_nk): a grouped GEMM pads each weight's width, and its N
    is their sum."""
    e = torch.empty((), dtype=dtype).element_size()
    Np, Kp = padded_nk(arch, N, K, e)
    if not groups:
        return Np, Kp, ()
    gp = tuple(padded_nk(arch, n, K, e)[0] for n in groups)
    return sum(gp), Kp, gp


def group_default(arch, dtype, M, N, sms, precision, default: TileConfig) -> TileConfig:
    """A grouped GEMM's heuristic config: on sm90 (16-bit) the first overlap tile of SMALL_M_CANDIDATES whose grid
    covers the SMs, else the smallest (group_problem: sm90's grouped program is the overlap one); elsewhere the
    GEMM's own default."""
    if arch != "sm90" or default.math(arch, dtype_name(dtype), precision) != "mma":
        return default
    options = [TileConfig(**c) for c in SMALL_M_CANDIDATES]
    for c in options:
        if sms is None or _tiles(M, N, c.bm, c.bn) >= sms:
            return c
    return options[-1]


def _group_valid(cand: dict, arch, dtype, N, groups, precision) -> bool:
    """Whether a grouped GEMM has a program with tuning candidate `cand`."""
    cfg = TileConfig(**cand)
    return group_problem(arch, N, groups, cfg, cfg.math(arch, dtype_name(dtype), precision)) is None


_SELECTED: dict[tuple, TileConfig] = {}


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(arch: str) -> int | None:
    """The current GPU's SM count (what the default tile is sized against); None off the GPU."""
    if arch == "cpu" or not torch.cuda.is_available():
        return None
    return _device_sms(torch.cuda.current_device())


def _valid(c, arch, dtype, acc, precision="ieee"):
    return TileConfig(**c).problem(arch, dtype_name(dtype), acc, precision) is None


def gemm(a, b, bias=None, act=None, residual=None, *, b_transposed=False, out=None, arch=None):
    """act(a @ b + bias) + residual with the epilogue fused into the store (semantics: reference.gemm_ref).

    a: (..., K); b: (K, N), or (N, K) with b_transposed=True (a linear weight); bias: (N,); residual: the
    output shape (..., N); act: None, "relu", "gelu", "gelu_tanh", "silu" or "sigmoid". GPU: fp16/bf16/fp32
    (fp32 accumulate); cpu: fp32/fp64. fp32 on the GPU follows torch's matmul precision as `a @ b` does:
    full fp32 accuracy by default ("highest"), TF32 tensor cores when torch allows TF32 ("high", "medium").
    `out=` writes into a given tensor; `arch=` forces a variant ("sm80" on an H200). The tile config is the
    heuristic default or, on the GPU, the tuned one (cached on disk; TKOPT_AUTOTUNE=0 turns tuning off).
    On CUDA, a bias with relu or gelu_tanh and no residual runs on cuBLASLt's fused epilogue instead unless the
    tuning times the TileLang kernel LIBRARY_MARGIN faster at that shape bucket (never with `arch=` given;
    `gemm_custom` always runs the TileLang kernel).

    >>> import torch
    >>> from tkopt.kernels import gemm
    >>> a, b, bias = torch.randn(37, 64), torch.randn(48, 64), torch.randn(48)
    >>> y = gemm(a, b, bias, act="gelu", b_transposed=True)  # a linear layer's weight (N, K)
    >>> torch.allclose(y, torch.nn.functional.gelu(a @ b.T + bias), atol=1e-5)
    True
    """
    forced = arch is not None
    arch, M, N, K, out_shape = check_inputs(a, b, bias, act, residual, b_transposed, arch)
    precision = fp32_precision(arch, a.dtype)
    if M == 0 or N == 0 or K == 0:
        cfg = default_config(arch, a.dtype, precision=precision)
    else:
        def run(cfg):
            return median_ms(lambda: _launch(arch, cfg, a, [b], [bias], act, residual, b_transposed, None,
                                            out_shape, M, N, K, False, precision))

        serves = not forced and library_serves(a, bias, act, residual)
        known = _library_decided(arch, _library_key(M, N, K, a.dtype, act, b_transposed, precision)) if serves else None
        if known:  # decided for cuBLASLt: no TileLang kernel is tuned or built for this call
            return _library_gemm(a, b, bias, act, b_transposed, out)
        cfg = select_config("gemm", arch, M, N, K, a.dtype, act, bias is not None, residual is not None,
                            b_transposed, run, precision=precision)
        if serves and known is None and _library_faster(
                arch, M, N, K, a.dtype, act, b_transposed, precision,
                lambda: _launch(arch, cfg, a, [b], [bias], act, None, b_transposed, None, out_shape, M, N, K, False,
                                precision),
                lambda: _library_gemm(a, b, bias, act, b_transposed, None)):
            return _library_gemm(a, b, bias, act, b_transposed, out)
    return _launch(arch, cfg, a, [b], [bias], act, residual, b_transposed, out, out_shape, M, N, K, False,
                   precision)


# cuBLASLt's fused bias epilogues, reached through torch._addmm_activation: activation -> its use_gelu. On CUDA
# its GELU is the tanh form, in the epilogue and in torch's fallback where cuBLASLt does not apply; on CPU the
# fallback is erf GELU, so it serves CUDA only.
LIBRARY_EPILOGUES = {"relu": False, "gelu_tanh": True}
_TILELANG, _LIBRARY = {"kernel": "tilelang"}, {"kernel": "cublaslt"}


def library_serves(a, bias, act, residual) -> bool:
    """Whether cuBLASLt's fused epilogue computes this `gemm` call."""
    return _library_epilogue(a.is_cuda, bias is not None, act, residual is not None)


def _library_epilogue(cuda: bool, has_bias: bool, act, has_res: bool) -> bool:
    """Whether cuBLASLt's fused epilogue computes a `gemm` call like this: CUDA, a bias, relu or gelu_tanh, no
    residual (`library_serves` on tensors; `planned_kernels` on their description)."""
    return cuda and has_bias and not has_res and act in LIBRARY_EPILOGUES


def _library_gemm(a, b, bias, act, b_transposed, out):
    """act(a @ b + bias) by cuBLASLt's fused epilogue (`library_serves` calls; b 2-D, checked by `gemm`)."""
    y = torch._addmm_activation(bias, a.reshape(-1, a.shape[-1]), b.t() if b_transposed else b,
                                use_gelu=LIBRARY_EPILOGUES[act]).reshape(*a.shape[:-1], -1)
    return y if out is None else out.copy_(y)


# TileLang's kernel serves a call cuBLASLt's epilogue also serves only where it times this much faster: the vendor
# library needs no kernel build, a cold compile's largest cost on a small model, and is the better-trodden code. At
# nn.TransformerEncoderLayer's 4096x4096x1024 relu (H100, 2026-12-06) TileLang timed 0.0575 ms against 0.0581: a
# 1% win that cost the layer's cold compile a 6 s build.
LIBRARY_MARGIN = 1.05


def _library_key(M, N, K, dtype, act, b_t, precision) -> tuple:
    return _tuning_key(M, N, K, dtype, act, True, False, b_t, precision)


def _library_choice(arch, key) -> bool | None:
    """Whether cuBLASLt's epilogue runs, from the stored timing of both (this machine's, else the shipped one): the
    library unless TileLang was LIBRARY_MARGIN faster; None where none is stored."""
    from .tuning import cached_entry

    entry = cached_entry("gemm_library", arch, key)
    if entry is None:
        return None
    ms = {c.get("kernel"): t for c, t in entry.get("timings", [])}
    if _TILELANG["kernel"] in ms and _LIBRARY["kernel"] in ms:
        return ms[_TILELANG["kernel"]] * LIBRARY_MARGIN > ms[_LIBRARY["kernel"]]
    return entry["config"] == _LIBRARY


def _library_decided(arch, key) -> bool | None:
    """The in-process choice, else the stored one (memoized: this runs on every call); None until timed."""
    from .tuning import tuning_suspended

    hit = _LIBRARY_CHOSEN.get((arch, key))
    if hit is None:
        hit = _library_choice(arch, key)
        if hit is not None and not tuning_suspended():
            _LIBRARY_CHOSEN[(arch, key)] = hit
    return hit


def _library_faster(arch, M, N, K, dtype, act, b_t, precision, tilelang_run, library_run) -> bool:
    """Whether cuBLASLt's epilogue runs at this shape bucket, timed against the tuned TileLang kernel with the
    tuning (kernel "gemm_library", cached on disk the same way; TKOPT_AUTOTUNE=0 keeps TileLang) and chosen with
    LIBRARY_MARGIN (`gemm` asks only where nothing is stored)."""
    from .tuning import pick_config, tuning_suspended

    key = _library_key(M, N, K, dtype, act, b_t, precision)
    picked = pick_config("gemm_library", arch, key, [_TILELANG, _LIBRARY], _TILELANG,
                         lambda c: median_ms(library_run if c == _LIBRARY else tilelang_run, calls=8))
    stored = _library_choice(arch, key)
    faster = picked == _LIBRARY if stored is None else stored
    if not tuning_suspended():
        _LIBRARY_CHOSEN[(arch, key)] = faster
    return faster


_LIBRARY_CHOSEN: dict[tuple, bool] = {}
