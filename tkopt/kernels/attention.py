"""Flash attention forward: softmax(q k^T * scale + mask) v, online softmax, fp32 accumulate.

Semantics are exactly `reference.flash_attention_ref`. One public entry point, `flash_attention` (and
`planned_kernels`: the compiles its call on such tensors uses, tuning candidates included, for a build wave
ahead of the calls), and two public program builders that another engineer lowers to C / CUDA source:

- `gpu_program(arch, ...)`: the sm90 (wgmma, TMA loads, T.Pipelined; TileLang's producer/consumer
  warp specialization applies automatically to the TMA pipeline) and sm80 (mma.sync, cp.async;
  num_stages=1, see DEFAULT_CONFIGS) variants. Same template; they differ in target, pass configs and
  tile config. Forced sm80 on a Hopper GPU is built for sm_90 with wgmma/TMA off. Two loop schedules
  (config key `pipelined`): plain (QK^T, softmax, PV in sequence; T.gemm waits for each wgmma) and, sm90
  fp16/bf16 only, pipelined (FlashAttention-3's overlap of block t's softmax with PV of block t-1, with
  explicitly async wgmma). fp32 inputs run on tensor cores as tf32 (P goes through shared memory; plain
  schedule only); not yet checked on a GPU. A third sm90 schedule (config key `persistent`, optionally with
  `pingpong`): resident CTAs walk the tiles with the TMA loads written out, so that a CTA's next tile loads
  while its current one finishes; lowered and built by the CI tests, not yet run on a GPU, so it is no tuning
  candidate (TUNE_CANDIDATES) until its GPU tests pass.
- `cpu_program(...)`: the C-backend variant (serial, one query row per program, blocked online softmax).

Compile-time keys (all hashable; see the builders' docstrings): dtype, head dim, query heads, kv heads,
causal, per-tensor layouts of q / k / v / out ("bhsd" or "bshd"), mask kind (None, "add" float32 or
"bool" uint8), which mask dims are broadcast (size 1), the softmax scale, the additive mask's scale, the
bool mask's fill, the guard for fully masked / NaN rows, and the tile config.
Batch, query length and key/value length are dynamic (`T.dynamic`), so one compiled kernel serves
every batch size and sequence length; compiled kernels are cached in memory per key.

Layouts: each of q, k, v is indexed in whichever of BHSD / BSHD / SBHD (MEMORY_LAYOUTS) it is contiguous
in, so a BSHD tensor, a transposed view of a BHSD one, or nn.MultiheadAttention's heads of a (seq, batch,
embed) projection are read in place through the kernel's indexing, never copied. The sm90 programs take
q/k/v strides at run time, so they also read in place a tensor whose rows are apart in one of those orders
(the heads of a packed QKV projection, split and viewed: GPT-2's c_attn), where TMA can (`_rows`). Other
tensors are copied (`.contiguous()` in the requested layout); the output is written in that layout.

Masks: any tensor broadcastable to (B, Hq, Sq, Skv). Leading dims are added as size 1; every size-1
dim is a broadcast dim the kernel indexes at 0 (stride-0 semantics, nothing is expanded). A float mask
is read as float32 (float64 by the cpu variant of float64 inputs; converted if given in another float
dtype) and added after scaling, the sum then scaled by
`mask_scale` ((S * scale + M) * mask_scale, the graph's order); a bool mask is read as uint8 through a
zero-copy view, keeps where it equals `mask_keeps`
(True; False for masked_fill's mask) and puts
`mask_fill` elsewhere (finite fills stay finite: GPU scores move to the log2 domain only where the fill
times log2 e stays finite, so finfo.min never overflows to -inf). `guard` says what a row
gives whose every score is -inf ("none": NaN, "masked": 0) or that holds a NaN ("nan": 0).
"""

import functools
import itertools
import math
import operator
from collections.abc import Sequence

import torch

from .arch import OWN_SYNCS_PASS_CONFIGS, Build, UnsupportedError, arch_of, device_sm, run_pass_configs, run_target
from .config import DTYPE_BYTES
from .constants import const
from .libraries import gpu_compile
from .tuning import pick_config, tuning_suspended
from .workers import Compile

LOG2E = 1.4426950408889634
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
LAYOUTS = ("bhsd", "bshd")  # what q, k, v and the output are given in
# The memory layouts the kernels index a tensor in, as the logical (batch, heads, seq, dim) axis each of its
# dims holds. "sbhd" is nn.MultiheadAttention's: its q / k / v are (seq, batch, embed) projections viewed as
# heads, contiguous in neither given layout (each was copied before this layout existed).
MEMORY_LAYOUTS = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}
# The GPU programs take every head dim that is a multiple of the tensor cores' k step (16 for 16-bit inputs) up
# to 256: MiniLM's 32, BERT's and GPT-2's 64, Phi's 80, Llama's 128, Gemma's 256. Every such dim lowers and
# compiles without spills at its default tile (checked across 16..256 on sm90 and sm80, 2026-12-07).
GPU_HEAD_DIM_STEP = 16
GPU_MAX_HEAD_DIM = 256
GPU_HEAD_DIMS_TEXT = f"multiples of {GPU_HEAD_DIM_STEP} up to {GPU_MAX_HEAD_DIM}"  # for refusals
CPU_MAX_HEAD_DIM = 256
_GPU_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_CPU_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
GUARDS = ("none", "masked", "nan")

# Default tile configs per arch; fp32 (tf32 tensor-core math) uses FP32_CONFIG, smaller tiles.
# `pipelined` (sm90 only): FlashAttention-3's overlap of one block's softmax with the next block's wgmma
# GEMMs (see gpu_program). TileLang 0.1.15 has no `group=` for T.Pipelined, and its automatic warp
# specialization (which the TMA loads need) drops a loop's order=/stage= annotations; order/stage without
# warp specialization turn the loads into cp.async plus __syncthreads (checked on the lowered source). So
# the schedule is written out by hand: async T.wgmma_gemm + T.wait_wgmma inside the warp-specialized loop.
# The plain schedule stays a tuning candidate: which one wins is only known on the device.
# sm80: 128 threads with block_M=128, D=128 spill (255 regs + 128 B spills per ptxas): use 256.
# num_stages=1: TileLang 0.1.15 cannot generate code for a deeper cp.async pipeline over a dynamic
# trip count (its epilogue's ptx_wait_group count is not a constant: "Downcast from tirx.Sub to
# ir.IntImm failed"); the pass config tl.UnrollLoop explicit_unroll works around it but takes ~250 s
# to lower (196 KB of unrolled source), so it is not used.
# Head dims over 128 ("wide": Gemma's and GPT-J's 256) take narrower key blocks: on sm90 128x64 fits two stages
# in 192 KB of shared memory at D=256 (128x128 would need 288); on sm80 128x64 runs at ptxas' 255-register
# limit at D=256 (4 bytes spilled with a causal GQA key) and 128x32 at 240.
DEFAULT_CONFIGS = {
    ("sm90", "narrow"): dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=True),
    ("sm90", "wide"): dict(block_M=128, block_N=64, num_stages=2, threads=256, pipelined=True),
    ("sm80", "narrow"): dict(block_M=128, block_N=64, num_stages=1, threads=256),
    ("sm80", "wide"): dict(block_M=128, block_N=32, num_stages=1, threads=256),
}
FP32_CONFIG = dict(block_M=64, block_N=32, num_stages=1, threads=128)
CPU_BLOCK_N = 32
_CONFIG_MEMO: dict[tuple, dict] = {}  # (arch, key, size bucket) -> config, so warm calls skip pick_config
last_config: dict[str, dict] = {}  # the GPU config used by the latest call, per arch (for benchmarks)

# Small tuning spaces, timed by tuning.pick_config (TKOPT_AUTOTUNE unset or 1) for fp16/bf16: per arch, and
# where these keys exist per (arch, 64) for head dims up to 64 and (arch, "wide") for those over 128. Kept
# small: each candidate is a compile on the device.
# sm90 D=128 (H200, plain schedule, 2026-11-30): 128x128 stages 2 won non-causal, stages 1 causal by
# 1.5%; 128x64 and 64x128 (threads 128) lost by 10-45% and were dropped. 128x176 is FA3's non-causal
# tile for D=128 (smem 32 + 2*2*44 KB; O_shared reuses Q_shared's bytes), 192x128 with 3 consumer
# warpgroups (TileLang lowers their register budget to 160, no spills) its tile for D=64.
# D=64, 64x128 with one consumer warpgroup and two CTAs per SM (min_blocks: __launch_bounds__ and a setmaxnreg
# split of 24/232 that fits them, `_register_split`): one CTA's prologue, epilogue and softmax run while the
# other's wgmma do. H200, 2026-12-02 (CUDA-graph replays, benchmarks/results/2026-12-02-h200): GPT-2's causal
# node 0.0687 -> 0.0604 ms, BERT-base's 0.0615 -> 0.0554, the encoder's 0.0384 -> 0.0356; every D=64 key of
# the benchmark models tuned to it. At D=128 its 64x128 twin (one stage, to fit two CTAs' shared memory) lost:
# Llama's node 0.196 against 0.166 ms. A 64x64 tile with three CTAs per SM (a 24/136 split) ran faster still: BERT's
# node 0.0508 ms (H200, 2026-12-02), and without its mask 47.6 us against 51.2 (H100, 2026-12-07,
# benchmarks/results/2026-12-07-h100-d). Its error against SDPA's output is 12x the other tiles' (1.8e-4 against
# 1.5e-5), and so is that of 64x64 with two CTAs: likely because SDPA's flash kernel also takes keys 128 at a time,
# so 128-key tiles round P to fp16 against the same running maxes. Against float32 attention every tile and SDPA
# are alike (2.74-2.75e-4 relative): the extra agreement is not accuracy.
TUNE_CANDIDATES = {
    "sm90": [
        dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=True),
        dict(block_M=128, block_N=176, num_stages=2, threads=256, pipelined=True),
        dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=False),
    ],
    ("sm90", "wide"): [
        dict(block_M=128, block_N=64, num_stages=2, threads=256, pipelined=True),
        dict(block_M=128, block_N=80, num_stages=2, threads=256, pipelined=True),  # FA3's D=256 tile: 224 KB
        dict(block_M=128, block_N=64, num_stages=2, threads=256, pipelined=False),
    ],
    ("sm80", "wide"): [
        dict(block_M=128, block_N=32, num_stages=1, threads=256),
        dict(block_M=64, block_N=32, num_stages=1, threads=128),
    ],
    ("sm90", 64): [
        dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=True),
        dict(block_M=192, block_N=128, num_stages=2, threads=384, pipelined=True),
        dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=False),
        dict(block_M=64, block_N=128, num_stages=2, threads=128, pipelined=True, min_blocks=2),
        dict(block_M=64, block_N=64, num_stages=2, threads=128, pipelined=True, min_blocks=3),
    ],
    "sm80": [
        dict(block_M=128, block_N=64, num_stages=1, threads=256),
        dict(block_M=128, block_N=128, num_stages=1, threads=256),
        dict(block_M=64, block_N=64, num_stages=1, threads=128),
    ],
}


def gpu_head_dim(dim: int) -> bool:
    """Whether the GPU programs take head dim `dim`."""
    return 0 < dim <= GPU_MAX_HEAD_DIM and dim % GPU_HEAD_DIM_STEP == 0


def _width(dim: int) -> str:
    return "wide" if dim > 128 else "narrow"


def default_config(arch: str, dim: int) -> dict:
    """The 16-bit GPU kernel's tile config on `arch` ("sm90" or "sm80") at head dim `dim` before tuning."""
    return dict(DEFAULT_CONFIGS[(arch, _width(dim))])


def tune_candidates(arch: str, dim: int, masked: bool = False) -> list[dict]:
    """The tuning candidates for `arch` at head dim `dim`. With a mask, tiles larger than 128x128 are left
    out: their pipelined kernels spill (ptxas, fp16: a (B, 1, S, S) bool mask 1220 B at 192x128 and 1508 B at
    128x176, a key padding mask 24 B at both; 128x128 spills nothing with a mask or without one, nor do the
    larger tiles without one)."""
    key = (arch, "wide") if _width(dim) == "wide" else (arch, 64) if dim <= 64 else arch
    cands = TUNE_CANDIDATES.get(key, TUNE_CANDIDATES[arch])
    if masked:
        cands = [c for c in cands if c["block_M"] * c["block_N"] <= 128 * 128]
    return cands


def _index(layout: str, b, h, s, d) -> tuple:
    """(b, h, s, d) in the order of memory layout `layout`: a shape, an index, or slices of a tile."""
    return tuple((b, h, s, d)[axis] for axis in MEMORY_LAYOUTS[layout])


def _io_shape(layout: str, b, h, s, d) -> list:
    return list(_index(layout, b, h, s, d))


def _mask_shape(bcast: tuple[bool, bool, bool, bool], full: Sequence) -> list:
    return [1 if bc else n for bc, n in zip(bcast, full, strict=True)]


def _key_only(bcast: tuple[bool, bool, bool, bool]) -> bool:
    """Whether a mask broadcast as `bcast` over (B, Hq, Sq, Skv) is a key padding mask: one value per (batch, key)."""
    return bcast[1] and bcast[2]


def summarizes(mask_shape: Sequence) -> bool:
    """Whether the GPU programs read a summary per batch row (`kept_rows`) of a mask of this shape: a key-only
    one, by its dims as given (a symbolic dim is not known to be 1)."""
    if len(mask_shape) > 4:
        return False
    full = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    return _key_only(tuple(isinstance(n, int) and n == 1 for n in full))


def kept_rows(mask: torch.Tensor, mask_keeps: bool = True) -> torch.Tensor:
    """Per batch row of a key-only mask (`summarizes` its shape; bool or float), the value from which the GPU
    program reads whether the row keeps every key (gpu_program's Kept), in the program's dtype: for a bool mask
    as uint8, whether every value is True where True keeps (whether any is otherwise: `_keeps` of it reads
    whether all keep), for a float mask its largest magnitude as float32 (0: adds nothing; NaN is not 0). A
    function of the mask alone, so that a graph whose attention nodes share a mask computes it once
    (`fused_ops.attention`'s derived input, by `kept_rows_ops`); `flash_attention` computes it per call where it
    is not given."""
    return kept_rows_ops(mask, mask_keeps, mask.dim(), mask.dtype == torch.bool)


def kept_rows_ops(mask: torch.Tensor, mask_keeps: bool, rank: int, is_bool: bool) -> torch.Tensor:
    """`kept_rows` of a mask of this rank and kind, in aten ops alone, which take FX proxies too: the torch
    backend emits them so, and inductor fuses them into the kernel that builds the mask (a Python function's
    node would keep AOTAutograd's cache from serving the program: every warm compile would trace it again)."""
    aten = torch.ops.aten
    dims = [1, 2, 3] if rank == 4 else None  # a mask of rank < 4 has one batch row
    if is_bool:
        out = aten._to_copy.default((aten.all.dims if mask_keeps else aten.any.dims)(mask, dims), dtype=torch.uint8)
    else:  # exact in float32: a largest |value| converts where the kernel's float32 mask does
        out = aten._to_copy.default(aten.linalg_vector_norm.default(mask, math.inf, dims), dtype=torch.float32)
    return out if rank == 4 else aten.reshape.default(out, [1])


def _register_split(threads: int, min_blocks: int) -> tuple[int, int]:
    """(producer, consumer) registers per thread that warp-specialized CTAs of `threads` consumer threads (and
    TileLang's one producer warpgroup) set with setmaxnreg so that `min_blocks` of them fit an SM: each launches
    with what __launch_bounds__(threads + 128, min_blocks) leaves a thread (65536 registers per SM, in steps of
    8), and the consumers take what the producer gives back. TileLang's own split (24/240) fits one CTA of two
    consumer warpgroups per SM; asked for more than the CTA holds, setmaxnreg.inc would wait forever."""
    total = threads + 128
    launch = min(255, 65536 // (min_blocks * total)) // 8 * 8
    producer = 24
    return producer, min(240, (launch * total - producer * 128) // threads // 8 * 8)


def _visible(q_idx, k_idx, seq_kv, causal: bool):
    """Whether key k_idx enters query q_idx's softmax: it exists (not padding of a partial key block) and,
    causal, is not after the query."""
    return (k_idx < seq_kv) & (q_idx >= k_idx) if causal else k_idx < seq_kv


# The K/V bytes that one section of causal CTAs reads (`causal_order`): within the L2 of an A100 (40 MB), H100 and
# H200 (50 MB) with room for Q and O, as FlashAttention-3's longest-first scheduler sizes its sections.
L2_SECTION_BYTES = 32 * 1024 * 1024
# The named barrier the persistent kernel's consumer warpgroups sync on around the staged output (0 is
# __syncthreads, 1 TileLang's cross-warp reductions).
_OUTPUT_BARRIER = 3
_TURN_BARRIER = 4  # and 5: the pingpong turns of consumer warpgroups 0 and 1


def causal_order(idx, n_q, pairs, section, ops: tuple | None = None):
    """Causal CTA `idx`, in launch order, -> (query block, (batch, head) pair) of `n_q` query blocks over
    `pairs` pairs: sections of `section` consecutive pairs in turn; within one, the query blocks from the last
    (the most keys) to the first, each over the section's pairs. Longest first lets the short CTAs fill the
    last wave; sections keep the K/V that the running CTAs read within L2. All heads at once, as the launch
    order was, read 128 heads' K/V at D=128, seq 2048 (128 MB) from HBM: the causal kernel took 85% of the
    non-causal one's time for half its work. `ops`: (div, mod, minimum, bind), `_tir_order_ops()` in a kernel; by
    default Python's, on ints."""
    div, mod, minimum, bind = ops or (operator.floordiv, operator.mod, min, lambda x: x)
    first = bind(div(idx, section * n_q) * section)  # the section's first pair
    size = bind(minimum(section, pairs - first))  # the last section may be smaller
    rest = bind(idx - first * n_q)
    return n_q - 1 - div(rest, size), first + mod(rest, size)


def _tir_order_ops() -> tuple:
    """causal_order's ops in a kernel: C's division (every operand is >= 0) and each step in a register. With
    floordiv and the steps as expressions, the divisions and their sign cases were rewritten into every index
    that reads them: 7x the CUDA source, 17x the lowering time; registers alone still left 2x the source."""
    import tilelang.language as T

    return T.truncdiv, T.truncmod, T.min, lambda x: T.alloc_var("int32", init=x)[0]


def _keeps(m, mask_keeps: bool):
    """Whether a bool mask's value m (uint8) keeps its score: m != 0, or m == 0 for masked_fill's mask."""
    import tilelang.language as T

    m = T.cast(m, "int32")  # a uint8 condition breaks TVM's bound solver on the C backend (-1 as uint)
    return (m != 0) if mask_keeps else (m == 0)


def _masked_score(s, m, mask_kind: str, mask_scale, fill):
    """One softmax input as the reference computes it, before visibility: from s (q.k, scaled unless a GPU
    program keeps it raw) and m, for a bool mask whether it keeps s (`_keeps`): s where it does, `fill`
    elsewhere; a float mask's value m is added, then the sum is scaled by mask_scale unless it is None. The
    one definition of masking, for both programs; each applies visibility after it (a finite fill must never
    give weight to a padding key or to one causality hides: the reference applies causality after the mask)."""
    import tilelang.language as T

    if mask_kind == "bool":
        return T.if_then_else(m, s, fill)
    return s + m if mask_scale is None else (s + m) * mask_scale


def _normalized(acc, total, guard: str, dtype: str):
    """acc / total, or what the guard gives a row with total 0 (every score -inf) or NaN."""
    import tilelang.language as T

    zero, nan = T.cast(0, dtype), T.cast(float("nan"), dtype)
    if guard == "nan":
        return T.if_then_else((total == 0) | T.isnan(total), zero, acc / total)
    return T.if_then_else(total == 0, zero if guard == "masked" else nan, acc / total)


# ---------------------------------------------------------------------------------------------------
# GPU program (sm90 / sm80)
# ---------------------------------------------------------------------------------------------------
def gpu_program(
    dtype: str,
    dim: int,
    heads_q: int,
    heads_kv: int,
    causal: bool,
    layouts: tuple[str, str, str, str] = ("bhsd",) * 4,
    mask_kind: str | None = None,
    mask_bcast: tuple[bool, bool, bool, bool] = (False,) * 4,
    scale: float | None = None,
    mask_scale: float = 1.0,
    mask_fill: float = -math.inf,
    guard: str = "masked",
    mask_keeps: bool = True,
    block_M: int = 128,
    block_N: int = 128,
    num_stages: int = 2,
    threads: int = 256,
    pipelined: bool = False,
    strided_qkv: bool = False,
    kept_rows: bool = False,
    min_blocks: int = 1,
    persistent: int = 0,
    pingpong: bool = False,
):
    """The flash attention forward `T.prim_func` for CUDA (sm90 and sm80 use this same template).

    Parameters (Q, K, V[, Mask[, Kept]], Output); batch, seq_q, seq_kv are dynamic. `layouts` gives the layout
    of (q, k, v, out) each; `mask_kind` None | "add" (float32 mask) | "bool" (uint8 mask);
    `mask_bcast` marks which of the mask's (B, Hq, Sq, Skv) dims it broadcasts over (size 1). `scale` defaults to
    1/sqrt(dim); `mask_scale`, `mask_fill`, `guard` and `mask_keeps` as `reference.flash_attention_ref`.
    Config: block_M (query rows per CTA), block_N (keys per step), num_stages, threads, and `pipelined`
    (sm90 fp16/bf16 only: the FlashAttention-3 style schedule, see `pipelined_loop` below; ignored for
    fp32, which keeps the plain schedule). `strided_qkv`: q, k, v strides are run-time values (compile_gpu
    sets it where `reads_strided(arch)`). `kept_rows` (compile_gpu sets it): a key-only mask comes with
    Kept, its summary per batch row (`kept_rows`), after Mask. `persistent` (sm90 fp16/bf16): that many resident
    CTAs walk the tiles, with the loads written out (`persistent_body`); `pingpong` (persistent, two consumer
    warpgroups) takes turns between them at issuing QK^T.
    """
    import tilelang.language as T

    if heads_q % heads_kv:
        raise UnsupportedError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if scale <= 0:  # the softmax's running max is taken over unscaled q.k where the scale is in the exponent
        raise UnsupportedError(f"flash_attention: the GPU programs take a positive scale, not {scale}")
    group = heads_q // heads_kv
    accum = "float32"
    batch, seq_q, seq_kv = T.dynamic("batch, seq_q, seq_kv")
    lq, lk, lv, lo = layouts
    q_shape = _io_shape(lq, batch, heads_q, seq_q, dim)
    k_shape = _io_shape(lk, batch, heads_kv, seq_kv, dim)
    v_shape = _io_shape(lv, batch, heads_kv, seq_kv, dim)
    o_shape = _io_shape(lo, batch, heads_q, seq_q, dim)
    # strided_qkv (sm90): q, k, v strides are run-time values (the head dim's is 1), which TMA takes as they
    # come, so `_rows` reads packed projections in place. sm80 keeps them contiguous: its cp.async loads,
    # unable to prove run-time strides 16-byte aligned, would go narrow (2.7x the global loads in the SASS).
    q_t, k_t, v_t = (
        T.StridedTensor(shape, (*(T.dynamic(f"{t}_stride{i}") for i in range(3)), 1), dtype)
        if strided_qkv
        else T.Tensor(shape, dtype)
        for t, shape in zip("qkv", (q_shape, k_shape, v_shape), strict=True)
    )
    has_mask = mask_kind is not None
    m_shape = _mask_shape(mask_bcast, (batch, heads_q, seq_q, seq_kv))
    m_dtype = "uint8" if mask_kind == "bool" else "float32"
    bb, bh, bq, bk = mask_bcast
    key_only = has_mask and _key_only(mask_bcast)
    # Kept (kept_rows): per batch row of a key-only mask, whether it keeps every key (`kept_rows`), read once
    # per CTA. Such a row (all of a batch without padding: what the decoders' benchmarks and most served
    # batches have) skips the mask: no loads, no selects, as eager's SDPA skips an all-ones padding mask.
    kept_rows = bool(kept_rows) and key_only
    # Without a mask the scale is folded into exp2: exp2(s * scale*log2e - max * scale*log2e), with the row
    # term hoisted, is one FFMA + one EX2 per score (FA3's trick). So with a bool mask whose fill is -inf
    # (`raw_scores`): masking only selects q.k or -inf, one FSEL per score. With another mask, scores are
    # scaled and masked before the exponent: in the log2 domain (s * scale*log2e, the fill times log2e;
    # exp2(s - max)) where nothing can overflow there, that is a bool mask whose finite fill times log2e stays
    # finite (-1e4). Otherwise in the natural domain, exponentiated as exp2((s - max) * log2e), one FMUL more
    # per score: an additive mask's values are only known at run time, and a fill such as finfo.min times
    # log2e would be -inf, where a row of equal fills must stay equal finite values that weigh their keys
    # equally.
    raw_scores = mask_kind == "bool" and mask_fill == -math.inf
    log2_scores = mask_kind == "bool" and not raw_scores and abs(mask_fill) * LOG2E < FLOAT32_MAX
    to_scores = LOG2E if log2_scores else 1.0  # what masked scores are in: log2 or natural units
    s_log2, log2e, scores_scale_c = (const(x, accum) for x in (scale * LOG2E, LOG2E, scale * to_scores))
    mask_scale_c = None if mask_scale == 1.0 else const(mask_scale, accum)
    neg_inf = -T.infinity(accum)
    fill = const(mask_fill * to_scores, accum)
    # fp32 (tf32 tensor-core math): P goes through shared memory; a float32 register fragment cannot be
    # reused as the A operand of the second GEMM (TileLang's layout inference rejects the fragment copy).
    fp32 = dtype == "float32"
    # The pipelined schedule issues wgmma explicitly (T.wgmma_gemm), and tf32 wgmma needs K-major operands,
    # which V (block_N x dim, the PV GEMM's B) is not: fp32 keeps the plain schedule (T.gemm picks mma).
    pipelined = bool(pipelined) and not fp32
    if persistent and fp32:
        raise UnsupportedError("flash_attention: the persistent schedule takes fp16/bf16 (wgmma from registers)")
    if pingpong and not (persistent and threads == 256):
        raise UnsupportedError("flash_attention: pingpong takes turns between the persistent schedule's two "
                               "consumer warpgroups (threads=256)")

    def tile(buf, layout, b, h, s0, n):
        return buf[_index(layout, b, h, slice(s0, s0 + n), slice(None))]

    def block_visibility(k, bx):
        """(keys, diagonal): key block k's visible keys for query block bx in block coordinates, as registers:
        key j of the block is visible to query i where `_visible(i + diagonal, j, keys, causal)` (diagonal None
        without causality). Written out per score as bx * block_M + i and k * block_N + j, TileLang's
        simplifier works over the dynamic lengths per fragment element: causal GPT-2's kernel lowered in 15 s
        instead of 12 (the build wave's longest job); a register is opaque to it, and equal per score."""
        keys = T.alloc_var("int32", init=seq_kv - k * block_N)
        diagonal = T.alloc_var("int32", init=bx * block_M - k * block_N) if causal else None
        return keys, diagonal

    def visible(i, j, keys, diagonal):
        return _visible(i + diagonal, j, keys, causal) if causal else j < keys

    @T.macro
    def init_scores(acc_s, k, bx):
        """Plain schedule without a mask: -inf where key k*block_N + j is out of range (or after the query,
        causal), 0 elsewhere; the QK^T GEMM accumulates onto it."""
        keys, diagonal = block_visibility(k, bx)
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.if_then_else(visible(i, j, keys, diagonal), 0, neg_inf)

    @T.macro
    def mask_scores(acc_s, k, bx):
        """-inf for invisible keys after the GEMM (which cleared acc_s) and the mask, only on the blocks that
        have any (the last one, past seq_kv; those crossing the diagonal): the pipelined schedule. The plain
        schedule hides them per score on every block: TileLang 0.1.15 cannot lower its warp-specialized loop
        with a masked causal kernel's second pass over the scores ("[ThreadSync] Cannot lower a required
        shared-memory sync inside a divergent region")."""
        keys, diagonal = block_visibility(k, bx)
        partial = keys < block_N  # the block reaches past seq_kv
        if causal:
            partial = partial | (diagonal + 1 < block_N)  # or crosses the diagonal
        if partial:
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.if_then_else(visible(i, j, keys, diagonal), acc_s[i, j], neg_inf)

    @T.macro
    def read_keys(Mask, kmask, k, bz, clamp: bool):
        """load_key_mask's reads, with the keys clamped to seq_kv or not."""
        for j in T.Parallel(block_N):
            kj = k * block_N + j
            m = Mask[0 if bb else bz, 0, 0, 0 if bk else (T.min(kj, seq_kv - 1) if clamp else kj)]
            if mask_kind == "bool":
                kmask[j] = T.if_then_else(_keeps(m, mask_keeps), T.float32(1), T.float32(0))
            else:
                kmask[j] = m

    @T.macro
    def read_block_keys(Mask, kmask, k, bz):
        """load_key_mask's reads of key block k: only the last block clamps its keys to seq_kv."""
        if (k + 1) * block_N <= seq_kv:
            read_keys(Mask, kmask, k, bz, clamp=False)
        else:
            read_keys(Mask, kmask, k, bz, clamp=True)

    @T.macro
    def load_key_mask(Mask, kmask, all_kept, k, bz):
        """A key-only mask's values for key block k, read once per block into `kmask` (a bool mask as its keep
        flag), not once per score, issued before the wait for QK^T so that the loads overlap the GEMM; nothing
        for a row that keeps every key (`all_kept`, with kept_rows). Only the last block clamps its keys to
        seq_kv: unclamped, a thread's 32 loads share one address register (with the clamp, each computed its
        own 64-bit address: more instructions than the softmax at D=64). The pipelined schedule only:
        TileLang 0.1.15 cannot lower this fragment in the plain schedule's loop (the error mask_scores names),
        which reads the mask per score."""
        if kept_rows:
            if not all_kept:
                read_block_keys(Mask, kmask, k, bz)
        else:
            read_block_keys(Mask, kmask, k, bz)

    @T.macro
    def apply_mask(Mask, kmask, acc_s, k, bx, by, bz, hide: bool, clamp: bool = True, kept: bool = False):
        """acc_s (the raw q.k of block k, the GEMM cleared it) masked (a key-only mask from `kmask`, which
        load_key_mask filled, else read per score, with the indices clamped into the mask unless `clamp` is
        False, for a block inside both lengths; with `kept`, a row that keeps every key: the mask's neutral
        value, nothing read), scaled into `to_scores` units first unless `raw_scores`; then, with `hide`, -inf
        for invisible keys, else the caller hides them (mask_scores): after the mask, never under it, or a
        finite fill would overwrite the -inf of padding and causality."""
        keys, diagonal = block_visibility(k, bx) if hide else (None, None)
        for i, j in T.Parallel(block_M, block_N):
            if kept:
                m = True if mask_kind == "bool" else T.float32(0)
            elif kmask is not None:
                m = kmask[j] != 0 if mask_kind == "bool" else kmask[j]
            else:
                qi, kj = bx * block_M + i, k * block_N + j
                mq = 0 if bq else (T.min(qi, seq_q - 1) if clamp else qi)
                mk = 0 if bk else (T.min(kj, seq_kv - 1) if clamp else kj)
                m = Mask[0 if bb else bz, 0 if bh else by, mq, mk]
                m = _keeps(m, mask_keeps) if mask_kind == "bool" else m
            s = acc_s[i, j] if raw_scores else acc_s[i, j] * scores_scale_c
            s = _masked_score(s, m, mask_kind, mask_scale_c, fill)
            if hide:
                s = T.if_then_else(visible(i, j, keys, diagonal), s, neg_inf)
            acc_s[i, j] = s

    @T.macro
    def apply_row_mask(Mask, kmask, all_kept, acc_s, k, bx, by, bz, hide: bool):
        """apply_mask, with its neutral value for a row that keeps every key (`all_kept`, with kept_rows)."""
        if kept_rows:
            if all_kept:
                apply_mask(Mask, kmask, acc_s, k, bx, by, bz, hide=hide, kept=True)
            else:
                apply_mask(Mask, kmask, acc_s, k, bx, by, bz, hide=hide)
        else:
            apply_mask(Mask, kmask, acc_s, k, bx, by, bz, hide=hide)

    @T.macro
    def softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum):
        """Online softmax of one block: new running max, rescale factor, P = exp2(.) in place, row sums."""
        T.copy(scores_max, scores_max_prev)
        T.fill(scores_max, neg_inf)
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(block_M):
            scores_max[i] = T.max(scores_max[i], scores_max_prev[i])
        if has_mask:
            # The shift (scores_sum is scratch until the reduce_sum below): the running max, or 0 for a row
            # whose every key so far is -inf, so exp2 gives 0, not NaN. The running max itself stays -inf: a
            # later block shifted by 0 instead of its own max could underflow to 0 (scores of -1e4, say).
            shift = scores_sum
            for i in T.Parallel(block_M):
                shift[i] = T.if_then_else(scores_max[i] == neg_inf, 0, scores_max[i])
            if raw_scores:
                for i in T.Parallel(block_M):
                    scores_scale[i] = T.exp2(scores_max_prev[i] * s_log2 - shift[i] * s_log2)
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * s_log2 - shift[i] * s_log2)
            elif log2_scores:
                for i in T.Parallel(block_M):
                    scores_scale[i] = T.exp2(scores_max_prev[i] - shift[i])
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] - shift[i])
            else:
                for i in T.Parallel(block_M):
                    scores_scale[i] = T.exp2((scores_max_prev[i] - shift[i]) * log2e)
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.exp2((acc_s[i, j] - shift[i]) * log2e)
        else:
            for i in T.Parallel(block_M):
                scores_scale[i] = T.exp2(scores_max_prev[i] * s_log2 - scores_max[i] * s_log2)
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * s_log2 - scores_max[i] * s_log2)
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def rescale(acc_o, scores_scale):
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def plain_loop(Q_shared, K_shared, V_shared, P_buf, acc_s, acc_o, stats, K, V, Mask, all_kept, loop_range, bx, by,
                   bz):
        """One K/V block per step, in order: QK^T, softmax, rescale, PV. Every T.gemm waits for its wgmma
        at once, so each consumer warpgroup runs the softmax between its two GEMMs, unhidden. TileLang's
        producer/consumer warp specialization overlaps the TMA loads (num_stages buffers) with all of it."""
        scores_max, scores_max_prev, scores_scale, scores_sum, logsum = stats
        hk = by // group
        for k in T.Pipelined(loop_range, num_stages=num_stages):
            T.copy(tile(K, lk, bz, hk, k * block_N, block_N), K_shared)
            if has_mask:
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                apply_row_mask(Mask, None, all_kept, acc_s, k, bx, by, bz, hide=True)
            else:
                init_scores(acc_s, k, bx)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
            T.copy(acc_s, P_buf)
            rescale(acc_o, scores_scale)
            T.copy(tile(V, lv, bz, hk, k * block_N, block_N), V_shared)
            T.gemm(P_buf, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def scores_of(acc_s, Mask, kmask, all_kept, k, bx, by, bz):
        """The pipelined schedule's masked scores. A mask read per score skips the index clamps on the blocks
        inside both lengths (as read_block_keys does)."""
        if has_mask:
            if kmask is None and ((bx + 1) * block_M <= seq_q) & ((k + 1) * block_N <= seq_kv):
                apply_mask(Mask, kmask, acc_s, k, bx, by, bz, hide=False, clamp=False)
            else:
                apply_row_mask(Mask, kmask, all_kept, acc_s, k, bx, by, bz, hide=False)
        mask_scores(acc_s, k, bx)

    @T.macro
    def pipelined_loop(Q_shared, K_shared, V_shared, P_buf, acc_s, acc_o, stats, K, V, Mask, kmask, all_kept, n, bx,
                       by, bz):
        """FlashAttention-3's intra-warpgroup overlap: step t issues QK^T of block t, then PV of block t-1,
        both as async wgmma (T.wgmma_gemm), waits for QK^T only (wgmma groups retire in issue order:
        wait_wgmma(1) leaves the PV in flight), and runs the softmax of block t while the tensor cores do
        PV(t-1); then waits for PV and writes P(t) (the registers PV(t-1) was reading). Steps t = 0..n:
        t = 0 has no PV yet, t = n only the last PV. The three cases are separate straight-line branches:
        ptxas must see that no path reads a wgmma's registers before its wait, or it serializes every
        wgmma (ptxas info C7514/C7517; the CI test checks for that).

        TMA loads and buffer recycling stay TileLang's automatic warp specialization (num_stages stages),
        with the loads shifted to match: step t loads K block min(t, n-1) and V block max(t-1, 0) (one
        redundant K and V load per CTA, the loads must not be conditional). The whole compute is one
        statement (the if/elif/else), so the consumer waits for both loads before it and releases both
        stage buffers after it, that is after the wgmma waits: the warp-specialization pass places a
        release after the last statement touching the buffer, and cannot know a wgmma is still reading.
        The rescale of O by the factor of block t-1 runs while QK^T(t) executes, before PV(t-1) is issued.
        This is the schedule of TileLang's removed example_mha_fwd_bhsd_wgmma_pipelined.py, T.Pipelined
        with MMA0 = QK^T, Softmax, Rescale, MMA1 = PV at order=[-1, 0, 3, 1, -1, 2], stage=[-1, 0, 0, 1, -1,
        1] (step t: QK^T(t), Rescale(t-1), PV(t-1), Softmax(t)), which TileLang 0.1.15 cannot express
        (see the comment at DEFAULT_CONFIGS); the loads here sit at the step that first needs them."""
        scores_max, scores_max_prev, scores_scale, scores_sum, logsum = stats
        hk = by // group
        for t in T.Pipelined(n + 1, num_stages=num_stages):
            kk = T.min(t, n - 1)
            kv = T.max(t - 1, 0)
            T.copy(tile(K, lk, bz, hk, kk * block_N, block_N), K_shared)
            T.copy(tile(V, lv, bz, hk, kv * block_N, block_N), V_shared)
            if t == 0:
                T.wgmma_gemm(Q_shared, K_shared, acc_s, transpose_B=True, clear_accum=True,
                             policy=T.GemmWarpPolicy.FullRow)  # fmt: skip
                if kmask is not None:
                    load_key_mask(Mask, kmask, all_kept, t, bz)
                T.wait_wgmma(0)
                scores_of(acc_s, Mask, kmask, all_kept, t, bx, by, bz)
                softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                T.copy(acc_s, P_buf)
            elif t < n:
                T.wgmma_gemm(Q_shared, K_shared, acc_s, transpose_B=True, clear_accum=True,
                             policy=T.GemmWarpPolicy.FullRow)  # fmt: skip
                rescale(acc_o, scores_scale)
                T.wgmma_gemm(P_buf, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)
                if kmask is not None:
                    load_key_mask(Mask, kmask, all_kept, t, bz)
                T.wait_wgmma(1)
                scores_of(acc_s, Mask, kmask, all_kept, t, bx, by, bz)
                softmax(acc_s, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                # Always true: a branch ptxas cannot see through (a warp vote), so that the PV wait starts a
                # basic block after the softmax. Without it ptxas hoists the wait above the softmax (in the
                # SASS, WARPGROUP.DEPBAR.LE gsb0, 0x0 came before every MUFU.EX2), silently undoing the
                # overlap; the branch costs a uniform vote and jump per step. Checked by the CI test.
                if T.activemask() != 0:
                    T.wait_wgmma(0)
                    T.copy(acc_s, P_buf)
                else:
                    T.wait_wgmma(0)
            else:
                rescale(acc_o, scores_scale)
                T.wgmma_gemm(P_buf, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(0)

    @T.macro
    def finish(acc_o, logsum):
        """O divided by the softmax's row sums."""
        if has_mask or guard == "nan":  # without a mask no row is fully masked (seq_kv >= 1, top-left)
            for i, j in T.Parallel(block_M, dim):
                acc_o[i, j] = _normalized(acc_o[i, j], logsum[i], guard, accum)
        else:
            for i, j in T.Parallel(block_M, dim):
                acc_o[i, j] /= logsum[i]

    def softmax_state():
        """(O's accumulator, the online softmax's row state: running max, its previous value, the rescale factor,
        a block's row sums, the running sum), allocated in the calling kernel."""
        acc_o = T.alloc_fragment([block_M, dim], accum)
        scores_max = T.alloc_fragment([block_M], accum)
        scores_max_prev = T.alloc_fragment([block_M], accum)
        scores_scale = T.alloc_fragment([block_M], accum)
        scores_sum = T.alloc_fragment([block_M], accum)
        logsum = T.alloc_fragment([block_M], accum)
        return acc_o, (scores_max, scores_max_prev, scores_scale, scores_sum, logsum)

    def tile_of(t, n_q):
        """(query block, q head, batch) of tile t in launch order: the non-persistent grid's order (causal:
        `causal_order`'s), so that the tiles that run together share K/V in L2 either way."""
        if causal:
            kv_heads_fit = T.max(1, T.truncdiv(L2_SECTION_BYTES // (2 * dim * DTYPE_BYTES[dtype]), seq_kv))
            q_block, pair = causal_order(t, n_q, heads_q * batch, kv_heads_fit * group, _tir_order_ops())
            return q_block, T.truncmod(pair, heads_q), T.truncdiv(pair, heads_q)
        pair = T.alloc_var("int32", init=T.truncdiv(t, n_q))[0]
        return T.truncmod(t, n_q), T.truncmod(pair, heads_q), T.truncdiv(pair, heads_q)

    def key_blocks(bx):
        """How many key blocks query block bx attends to: all, or causal, those up to its diagonal."""
        if causal:
            return T.min(T.ceildiv(seq_kv, block_N), T.ceildiv((bx + 1) * block_M, block_N))
        return T.ceildiv(seq_kv, block_N)

    @T.macro
    def body(Q, K, V, Mask, Kept, Output):
        # Causal: CTA bx has bx + 1 key blocks' work, so the longest go first, by sections of heads whose K/V
        # fit L2 (`causal_order`); in plain launch order the last wave held the heaviest CTAs of the last heads.
        # Without causality every CTA has the same work, and a head's query blocks stay adjacent (they share
        # its K/V in L2). A section counts the q heads of whole K/V heads (GQA: `group` q heads read one).
        n_q = T.ceildiv(seq_q, block_M)
        grid = (n_q * heads_q * batch,) if causal else (n_q, heads_q, batch)
        with T.Kernel(*grid, threads=threads) as ids:
            bx, by, bz = tile_of(ids, n_q) if causal else ids
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
                producer, consumer = _register_split(threads, min_blocks)
                T.annotate_producer_reg_dealloc(producer)
                T.annotate_consumer_reg_alloc(consumer)
            Q_shared = T.alloc_shared([block_M, dim], dtype)
            K_shared = T.alloc_shared([block_N, dim], dtype)
            V_shared = T.alloc_shared([block_N, dim], dtype)
            O_shared = T.alloc_shared([block_M, dim], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum)
            if fp32:
                P_buf = T.alloc_shared([block_M, block_N], dtype)
            else:
                P_buf = T.alloc_fragment([block_M, block_N], dtype)
            acc_o, stats = softmax_state()
            scores_max, scores_max_prev, scores_scale, scores_sum, logsum = stats  # named: the CUDA source's names
            kmask = T.alloc_fragment([block_N], accum) if key_only and pipelined else None
            all_kept = None
            if kept_rows:
                row = Kept[0 if bb else bz]
                all_kept = _keeps(row, mask_keeps) if mask_kind == "bool" else row == 0

            T.copy(tile(Q, lq, bz, by, bx * block_M, block_M), Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(scores_max, neg_inf)

            loop_range = key_blocks(bx)

            if pipelined:
                pipelined_loop(Q_shared, K_shared, V_shared, P_buf, acc_s, acc_o, stats, K, V, Mask, kmask,
                               all_kept, loop_range, bx, by, bz)  # fmt: skip
            else:
                plain_loop(Q_shared, K_shared, V_shared, P_buf, acc_s, acc_o, stats, K, V, Mask, all_kept,
                           loop_range, bx, by, bz)  # fmt: skip

            finish(acc_o, logsum)
            T.copy(acc_o, O_shared)
            T.copy(O_shared, tile(Output, lo, bz, by, bx * block_M, block_M))

    @T.macro
    def qk_in_turn(acc_s, Q_shared, K_stage, wg):
        """QK^T issued in warpgroup wg's turn (named barrier _TURN_BARRIER + wg), the turn handed over as soon as
        it is issued, waited for after: each warpgroup's softmax then runs while the other's QK^T is on the tensor
        cores, where both would otherwise reach their GEMMs and their softmax together (FlashAttention-3's
        inter-warpgroup pingpong). Each turn pairs one warpgroup's bar.sync with the other's bar.arrive."""
        T.sync_threads(_TURN_BARRIER + wg, threads)
        T.gemm(Q_shared, K_stage, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})  # fmt: skip
        T.named_barrier_arrive(_TURN_BARRIER + 1 - wg, threads)
        T.wait_wgmma(0)

    @T.macro
    def persistent_body(Q, K, V, Mask, Kept, Output):
        """`persistent` resident CTAs, each walking tiles t = its index, + persistent, ...: a TMA producer
        warpgroup (the last) loads every tile's Q and its K/V blocks into num_stages stages, running ahead of
        the consumers across tiles, so that a tile's first blocks are in shared memory while the previous
        tile's last steps and epilogue run; in the non-persistent grid each CTA waits for its Q and first K
        after launch. The consumer warpgroups run the plain schedule per block (QK^T, softmax, rescale, PV)
        and give a stage back (`kv_empty`) once PV has read it; Q goes back (`q_empty`) after a tile's last
        step. Both sides count blocks across the tiles (`step`), which fixes each block's stage and phase, as
        gemm_epilogue._overlap_body does; TileLang's thread-sync pass is off (it would sync the two sides:
        deadlock), so the consumers' syncs around the staged output tile are placed here."""
        n_q = T.ceildiv(seq_q, block_M)
        tiles = n_q * heads_q * batch
        producer_regs, consumer_regs = _register_split(threads, min_blocks)
        with T.Kernel(persistent, threads=threads + 128) as cta:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            Q_shared = T.alloc_shared([block_M, dim], dtype)
            K_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_shared = T.alloc_shared([num_stages, block_N, dim], dtype)
            O_shared = T.alloc_shared([block_M, dim], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum)
            P_buf = T.alloc_fragment([block_M, block_N], dtype)
            acc_o, stats = softmax_state()
            scores_max, scores_max_prev, scores_scale, scores_sum, logsum = stats  # named: the CUDA source's names
            kmask = T.alloc_fragment([block_N], accum) if key_only else None
            q_full = T.alloc_barrier([128])
            q_empty = T.alloc_barrier([threads])
            k_full = T.alloc_barrier([128] * num_stages)
            v_full = T.alloc_barrier([128] * num_stages)
            kv_empty = T.alloc_barrier([threads] * num_stages)
            step = T.alloc_local((1,), "int32")
            step[0] = 0
            with T.ws(threads // 128):
                T.dec_max_nreg(producer_regs)
                for it in T.serial(T.ceildiv(tiles - cta, persistent)):
                    bx, by, bz = tile_of(cta + it * persistent, n_q)
                    hk = by // group
                    T.mbarrier_wait_parity(q_empty[0], it % 2 ^ 1)
                    T.tma_copy(tile(Q, lq, bz, by, bx * block_M, block_M), Q_shared, barrier=q_full[0])
                    T.mbarrier_arrive(q_full[0])
                    for k in T.serial(key_blocks(bx)):
                        s = step[0] % num_stages
                        T.mbarrier_wait_parity(kv_empty[s], (step[0] // num_stages) % 2 ^ 1)
                        T.tma_copy(tile(K, lk, bz, hk, k * block_N, block_N), K_shared[s, :, :], barrier=k_full[s])
                        T.mbarrier_arrive(k_full[s])
                        T.tma_copy(tile(V, lv, bz, hk, k * block_N, block_N), V_shared[s, :, :], barrier=v_full[s])
                        T.mbarrier_arrive(v_full[s])
                        step[0] = step[0] + 1
            with T.ws(*range(threads // 128)):
                T.inc_max_nreg(consumer_regs)
                wg = T.alloc_var("int32", init=T.get_thread_binding() // 128)[0] if pingpong else None
                if pingpong and wg == 1:
                    T.named_barrier_arrive(_TURN_BARRIER, threads)  # warpgroup 0 takes the first turn
                for it in T.serial(T.ceildiv(tiles - cta, persistent)):
                    bx, by, bz = tile_of(cta + it * persistent, n_q)
                    all_kept = None
                    if kept_rows:
                        row = Kept[0 if bb else bz]
                        all_kept = _keeps(row, mask_keeps) if mask_kind == "bool" else row == 0
                    T.fill(acc_o, 0)
                    T.fill(logsum, 0)
                    T.fill(scores_max, neg_inf)
                    T.mbarrier_wait_parity(q_full[0], it % 2)
                    for k in T.serial(key_blocks(bx)):
                        s = step[0] % num_stages
                        phase = (step[0] // num_stages) % 2
                        if kmask is not None:
                            load_key_mask(Mask, kmask, all_kept, k, bz)
                        T.mbarrier_wait_parity(k_full[s], phase)
                        if pingpong:
                            qk_in_turn(acc_s, Q_shared, K_shared[s, :, :], wg)
                        else:
                            T.gemm(Q_shared, K_shared[s, :, :], acc_s, transpose_B=True, clear_accum=True,
                                   policy=T.GemmWarpPolicy.FullRow)  # fmt: skip
                        scores_of(acc_s, Mask, kmask, all_kept, k, bx, by, bz)
                        softmax(acc_s, *stats)
                        T.copy(acc_s, P_buf)
                        rescale(acc_o, scores_scale)
                        T.mbarrier_wait_parity(v_full[s], phase)
                        T.gemm(P_buf, V_shared[s, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        T.mbarrier_arrive(kv_empty[s])
                        step[0] = step[0] + 1
                    T.mbarrier_arrive(q_empty[0])
                    finish(acc_o, logsum)
                    T.sync_threads(_OUTPUT_BARRIER, threads)  # every consumer is past the last tile's O_shared
                    T.copy(acc_o, O_shared)
                    T.sync_threads(_OUTPUT_BARRIER, threads)
                    T.copy(O_shared, tile(Output, lo, bz, by, bx * block_M, block_M))
                if pingpong and wg == 0:
                    T.sync_threads(_TURN_BARRIER, threads)  # warpgroup 1's last hand-over

    main_body = persistent_body if persistent else body

    if kept_rows:

        @T.prim_func
        def flash_attention_fwd(
            Q: q_t,
            K: k_t,
            V: v_t,
            Mask: T.Tensor(m_shape, m_dtype),
            Kept: T.Tensor(m_shape[:1], m_dtype),
            Output: T.Tensor(o_shape, dtype),
        ):
            main_body(Q, K, V, Mask, Kept, Output)

    elif has_mask:

        @T.prim_func
        def flash_attention_fwd(
            Q: q_t,
            K: k_t,
            V: v_t,
            Mask: T.Tensor(m_shape, m_dtype),
            Output: T.Tensor(o_shape, dtype),
        ):
            main_body(Q, K, V, Mask, None, Output)

    else:

        @T.prim_func
        def flash_attention_fwd(
            Q: q_t,
            K: k_t,
            V: v_t,
            Output: T.Tensor(o_shape, dtype),
        ):
            main_body(Q, K, V, Q, None, Output)

    return flash_attention_fwd


# ---------------------------------------------------------------------------------------------------
# CPU program (C backend)
# ---------------------------------------------------------------------------------------------------
def cpu_program(
    dtype: str,
    dim: int,
    heads_q: int,
    heads_kv: int,
    causal: bool,
    layouts: tuple[str, str, str, str] = ("bhsd",) * 4,
    mask_kind: str | None = None,
    mask_bcast: tuple[bool, bool, bool, bool] = (False,) * 4,
    scale: float | None = None,
    mask_scale: float = 1.0,
    mask_fill: float = -math.inf,
    guard: str = "masked",
    mask_keeps: bool = True,
    block_N: int = CPU_BLOCK_N,
):
    """The C-backend `T.prim_func`: one program per (query row, head, batch), blocks of `block_N` keys.

    Same parameters and dynamic dims as `gpu_program` (float32 or float64; accumulation in float32, or
    float64 for float64). Serial and scalar: for portability and CI numerics, not speed.
    """
    import tilelang.language as T
    from tilelang.cpu.language import Kernel as CpuKernel

    if heads_q % heads_kv:
        raise UnsupportedError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    group = heads_q // heads_kv
    accum = "float64" if dtype == "float64" else "float32"
    batch, seq_q, seq_kv = T.dynamic("batch, seq_q, seq_kv")
    lq, lk, lv, lo = layouts
    q_shape = _io_shape(lq, batch, heads_q, seq_q, dim)
    k_shape = _io_shape(lk, batch, heads_kv, seq_kv, dim)
    v_shape = _io_shape(lv, batch, heads_kv, seq_kv, dim)
    o_shape = _io_shape(lo, batch, heads_q, seq_q, dim)
    has_mask = mask_kind is not None
    m_shape = _mask_shape(mask_bcast, (batch, heads_q, seq_q, seq_kv))
    m_dtype = "uint8" if mask_kind == "bool" else accum  # a float64 mask stays float64 (finfo.min included)
    bb, bh, bq, bk = mask_bcast
    neg_inf = -T.infinity(accum)

    def at(buf, layout, b, h, s, d):
        return buf[_index(layout, b, h, s, d)]

    @T.macro
    def body(Q, K, V, Mask, Output):
        with CpuKernel(seq_q, heads_q, batch) as (qi, hq, b):
            acc = T.alloc_local([dim], accum)
            s = T.alloc_local([block_N], accum)
            stat = T.alloc_local([4], accum)  # running max, running sum, block max, rescale factor
            scale_c, fill = const(scale, accum), const(mask_fill, accum)
            mask_scale_c = None if mask_scale == 1.0 else const(mask_scale, accum)
            hk = hq // group
            for d in T.serial(dim):
                acc[d] = 0
            stat[0] = neg_inf
            stat[1] = 0
            n_keys = T.min(seq_kv, qi + 1) if causal else seq_kv
            for kb in T.serial(T.ceildiv(n_keys, block_N)):
                for j in T.serial(block_N):
                    kj = kb * block_N + j
                    s[j] = 0
                    if kj < n_keys:  # keys past the end or hidden by causality: no q.k to compute
                        for d in T.serial(dim):
                            s[j] += T.cast(at(Q, lq, b, hq, qi, d), accum) * T.cast(at(K, lk, b, hk, kj, d), accum)
                    s[j] = s[j] * scale_c
                    # Masked like the GPU programs, padding keys of the last block included (the mask read
                    # at the last key): the same _masked_score, so a masking defect shows here too.
                    if has_mask:
                        mb = 0 if bb else b
                        mh = 0 if bh else hq
                        mq = 0 if bq else qi
                        mk = 0 if bk else T.min(kj, seq_kv - 1)
                        m = Mask[mb, mh, mq, mk]
                        m = _keeps(m, mask_keeps) if mask_kind == "bool" else T.cast(m, accum)
                        s[j] = _masked_score(s[j], m, mask_kind, mask_scale_c, fill)
                    s[j] = T.if_then_else(_visible(qi, kj, seq_kv, causal), s[j], neg_inf)
                stat[2] = stat[0]
                for j in T.serial(block_N):
                    stat[2] = T.if_then_else(s[j] > stat[2], s[j], stat[2])
                # All keys so far masked: keep the max at -inf but exponentiate against 0 (gives 0, not NaN).
                stat[3] = T.if_then_else(stat[2] == neg_inf, T.cast(0, accum), stat[2])
                stat[1] = stat[1] * T.exp(stat[0] - stat[3])
                for d in T.serial(dim):
                    acc[d] = acc[d] * T.exp(stat[0] - stat[3])
                for j in T.serial(block_N):
                    s[j] = T.exp(s[j] - stat[3])
                    stat[1] = stat[1] + s[j]
                for j in T.serial(block_N):
                    kj = kb * block_N + j
                    if kj < n_keys:
                        for d in T.serial(dim):
                            acc[d] += s[j] * T.cast(at(V, lv, b, hk, kj, d), accum)
                stat[0] = stat[2]
            for d in T.serial(dim):
                Output[_index(lo, b, hq, qi, d)] = T.cast(_normalized(acc[d], stat[1], guard, accum), dtype)

    if has_mask:

        @T.prim_func
        def flash_attention_fwd_cpu(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(k_shape, dtype),
            V: T.Tensor(v_shape, dtype),
            Mask: T.Tensor(m_shape, m_dtype),
            Output: T.Tensor(o_shape, dtype),
        ):
            body(Q, K, V, Mask, Output)

    else:

        @T.prim_func
        def flash_attention_fwd_cpu(
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(k_shape, dtype),
            V: T.Tensor(v_shape, dtype),
            Output: T.Tensor(o_shape, dtype),
        ):
            body(Q, K, V, Q, Output)

    return flash_attention_fwd_cpu


# ---------------------------------------------------------------------------------------------------
# Compilation (cached per compile-time key; dynamic dims make the key shape-free apart from heads/dim)
# ---------------------------------------------------------------------------------------------------
def program_pass_configs(arch: str, config: dict | None = None) -> dict[str, bool]:
    """The pass configs a GPU attention program with tile `config` is lowered with, on every path: fast math, and
    for the persistent schedule TileLang's thread syncs off (`persistent_body` places its own)."""
    if arch == "cpu":
        return {}
    own_syncs = OWN_SYNCS_PASS_CONFIGS if (config or {}).get("persistent") else {}
    return {"tl.enable_fast_math": True, **own_syncs}


def _pass_configs(arch: str = "sm90", device: str | None = None, config: dict | None = None) -> dict:
    """The program's own, plus what keeps the sm80 template Ampere-style when built for a newer GPU
    (arch.run_target)."""
    return {**program_pass_configs(arch, config), **run_pass_configs(arch, device)}


def reads_strided(arch: str) -> bool:
    """Whether `arch`'s programs take q/k/v strides at run time (gpu_program's `strided_qkv`): sm90's, whose TMA
    loads take them as they come, so `_rows` inputs are read in place there and copied elsewhere."""
    return arch == "sm90"


@functools.cache
def compile_gpu(arch: str, key: tuple, config_items: tuple, device: str | None = None):
    """Compile (and cache) the GPU kernel for `key` = gpu_program's keys and a config as sorted items,
    to run on `device` (the cache key: the sm80 variant is built per GPU arch)."""
    config = dict(config_items)
    if arch != "sm90" and (config.get("pipelined") or config.get("persistent")):
        raise UnsupportedError(f"flash_attention: the pipelined and persistent schedules need wgmma (sm90), not {arch}")
    return gpu_compile(("attention", arch, key, config_items),
                       lambda: gpu_program(*key, **config, strided_qkv=reads_strided(arch), kept_rows=True),
                       run_target(arch, device), _pass_configs(arch, device, config))


@functools.cache
def compile_cpu(key: tuple):
    import tilelang
    from tilelang import tvm

    func = cpu_program(*key)
    with tvm.target.Target("c"):
        return tilelang.compile(func, target="c", target_host="c", execution_backend="cython")


def _tuning_space(arch: str, key: tuple) -> tuple[dict, list[dict]]:
    """(the default config, the tuning candidates) of a 16-bit GPU kernel with compile key `key`: the one
    definition _pick_config and planned_kernels share."""
    dim, masked = key[1], key[6] is not None  # gpu_program's head dim and mask_kind
    return default_config(arch, dim), tune_candidates(arch, dim, masked)


def _pick_config(arch: str, key: tuple, dtype: str, dim: int, run_with) -> dict:
    if dtype == "float32":
        return dict(FP32_CONFIG)
    default, cands = _tuning_space(arch, key)
    return pick_config("flash_attention", arch, key, cands, default, run_with)


def _kernel_dtype(q: torch.Tensor, arch: str, guard: str) -> str:
    """The kernel's dtype name for q on `arch`; UnsupportedError where no variant takes q's dtype or head dim."""
    if guard not in GUARDS:
        raise ValueError(f"flash_attention: guard must be one of {GUARDS}, got {guard!r}")
    dim = q.shape[3]
    if arch == "cpu":
        if q.dtype not in _CPU_DTYPES:
            raise UnsupportedError(f"flash_attention: the cpu variant supports float32/float64, not {q.dtype}")
        if dim > CPU_MAX_HEAD_DIM:
            raise UnsupportedError(f"flash_attention: the cpu variant supports head dim <= 256, not {dim}")
        return _CPU_DTYPES[q.dtype]
    if q.dtype not in _GPU_DTYPES:
        raise UnsupportedError(f"flash_attention: {arch} supports float16/bfloat16/float32, not {q.dtype}")
    if not gpu_head_dim(dim):
        raise UnsupportedError(f"flash_attention: {arch} supports head dims that are {GPU_HEAD_DIMS_TEXT}, not {dim}")
    return _GPU_DTYPES[q.dtype]


def _size(b: int, sq: int, skv: int) -> tuple[int, int, int]:
    """The problem size in the tuning key (tuned configs depend on it): batch, both lengths rounded up to a
    power of two."""
    return b, 1 << max(0, (sq - 1).bit_length()), 1 << max(0, (skv - 1).bit_length())


def _prepared(q, k, v, mask, arch, dtype, causal, scale, layout, mask_scale, mask_fill, guard, mask_keeps,
              kept=None):
    """(the compile key: the program's keys in gpu_program / cpu_program order, (q, k, v) as views in the
    layouts the kernel indexes, the mask arguments). Reads shapes, strides and dtypes, and where strided GPU
    inputs are read in place their addresses' alignment (meta tensors count as aligned). `kept`: the mask's
    `kept_rows`, where the caller has it."""
    h = 1 if layout == "bhsd" else 2
    dims = (q.shape[3], q.shape[h], k.shape[h])  # head dim, query heads, key/value heads
    batch = q.shape[0]
    layouts, (q, k, v) = kernel_layouts(q, k, v, layout, strided=reads_strided(arch))
    mask_kind, bcast, margs = None, (False,) * 4, ()
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        # A mask of one batch row over a batch of one is read per batch row, as a batch's own mask is: a model
        # compiled at batch 4 and served at batch 1 then needs no kernel of its own.
        bcast = (m.shape[0] == 1 and batch != 1, *(n == 1 for n in m.shape[1:]))
        if m.dtype == torch.bool:
            mask_kind, m = "bool", m.contiguous().view(torch.uint8)
        else:
            wide = arch == "cpu" and q.dtype == torch.float64  # the cpu kernel reads float64 masks as float64
            mask_kind, m = "add", m.to(torch.float64 if wide else torch.float32).contiguous()
        margs = (m,)
        if arch != "cpu" and _key_only(bcast):
            margs = (m, kept_rows(mask, mask_keeps) if kept is None else _checked_kept(kept, m))
    key = (dtype, *dims, bool(causal), layouts, mask_kind, bcast, None if scale is None else float(scale),
           float(mask_scale), float(mask_fill), guard, bool(mask_keeps))
    return key, (q, k, v), margs


def _checked_kept(kept: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """A given `kept_rows` summary, if it has the shape, dtype and device `kept_rows` gives for kernel mask m."""
    want = torch.uint8 if m.dtype == torch.uint8 else torch.float32
    if kept.shape != (m.shape[0],) or kept.dtype != want or kept.device != m.device:
        raise ValueError(f"flash_attention: kept must be the mask's kept_rows, a {want} tensor of shape "
                         f"({m.shape[0]},) on {m.device}, got {kept.dtype} {tuple(kept.shape)} on {kept.device}")
    return kept.contiguous()


def planned_kernels(q, k, v, mask, build: Build, *, causal: bool = False, scale: float | None = None,
                    layout: str = "bhsd", mask_scale: float = 1.0, mask_fill: float = -math.inf,
                    guard: str = "masked", mask_keeps: bool = True) -> list[Compile]:
    """The compiles `flash_attention`'s call on tensors like these (shapes, strides, dtypes: meta tensors do)
    will use on `build`: the cached winner, else where it would tune every candidate, else the default config."""
    from .tuning import planned_configs

    b, hq, hkv, sq, skv = _check_inputs(q, k, v, mask, layout)
    dtype = _kernel_dtype(q, build.arch, guard)
    if b * hq * sq == 0 or skv == 0:
        return []
    gkey, _, _ = _prepared(q, k, v, mask, build.arch, dtype, causal, scale, layout, mask_scale, mask_fill, guard,
                           mask_keeps)
    if build.arch == "cpu":
        return [Compile.of(compile_cpu, gkey)]
    if dtype == "float32":
        configs = [dict(FP32_CONFIG)]
    else:
        default, cands = _tuning_space(build.arch, gkey)
        configs = planned_configs("flash_attention", build.arch, gkey + _size(b, sq, skv), cands, default)
    return [Compile.of(compile_gpu, build.arch, gkey, tuple(sorted(c.items())), build.gpu) for c in configs]


# ---------------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------------
def _rows(view: torch.Tensor) -> torch.Tensor | None:
    """view (in some memory layout's dim order) as the sm90 programs read it in place, or None: its dims in
    memory order (strides not increasing), head dim unit-strided, and every other stride and the address on
    16 bytes, as TMA descriptors and 16-byte cp.async loads need, in int32 (the programs' stride type). Size-1
    dims get the stride they would have contiguous (never read, but a TMA descriptor checks it). Rows may be
    apart, as the heads of a packed QKV projection's output are (GPT-2's c_attn, split and viewed)."""
    strides, run = [], 1
    for n, st in zip(reversed(view.shape), reversed(view.stride()), strict=True):
        strides.insert(0, run if n == 1 else st)
        run = n * strides[0]
    size = view.element_size()
    if strides[3] != 1 or any(a < b for a, b in itertools.pairwise(strides)) or view.data_ptr() % 16:
        return None
    if any(st * size % 16 or st >= 2**31 for st in strides[:3]):
        return None
    return view.as_strided(view.shape, strides)


def _layout_of(t: torch.Tensor, given: str, strided: bool) -> tuple[str, torch.Tensor]:
    """(memory layout the kernel indexes t in, t viewed in it): t, given in layout `given`, is read in place
    where one of MEMORY_LAYOUTS makes it contiguous, or with `strided` (the sm90 programs) has its rows in that
    layout's order (`_rows`), `given` first; else it is copied to `given`."""
    logical = t if given == "bhsd" else t.transpose(1, 2)  # (batch, heads, seq, dim)
    for layout in sorted(MEMORY_LAYOUTS, key=lambda m: m != given):
        view = logical.permute(MEMORY_LAYOUTS[layout])
        rows = _rows(view) if strided else None
        if rows is not None:
            return layout, rows
        if view.is_contiguous():
            return layout, view
    return given, logical.permute(MEMORY_LAYOUTS[given]).contiguous()


def kernel_layouts(q, k, v, layout: str, strided: bool = False):
    """((layout of q, k, v, out) as the kernel indexes them, (q, k, v) as views in those layouts).

    Each of q/k/v (given in `layout`) is read in whichever of MEMORY_LAYOUTS it is contiguous in (a zero-copy
    view), with `strided` (the sm90 programs, whose q/k/v strides are run-time values) also where only its rows
    are apart; other tensors are copied to `layout`. The output is always written contiguous in `layout`.
    """
    lays, views = zip(*(_layout_of(t, layout, strided) for t in (q, k, v)), strict=True)
    return (*lays, layout), views


def _check_inputs(q, k, v, mask, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"flash_attention: {name} must be 4-D ({layout}: "
                f"{'(batch, heads, seq, dim)' if layout == 'bhsd' else '(batch, seq, heads, dim)'}), "
                f"got shape {tuple(t.shape)}"
            )
    if layout not in LAYOUTS:
        raise ValueError(f"flash_attention: layout must be 'bhsd' or 'bshd', got {layout!r}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    hd = (1, 2) if layout == "bhsd" else (2, 1)  # (heads dim, seq dim)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"flash_attention: batch of q ({q.shape[0]}) and k/v ({k.shape[0]}) differ")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attention: head dim of q ({q.shape[3]}) and k/v ({k.shape[3]}) differ")
    hq, hkv = q.shape[hd[0]], k.shape[hd[0]]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"flash_attention: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    b, sq, skv = q.shape[0], q.shape[hd[1]], k.shape[hd[1]]
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"flash_attention: mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.device != q.device:
            raise ValueError(f"flash_attention: mask is on {mask.device}, q on {q.device}")
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise ValueError(f"flash_attention: mask must be bool or floating, got {mask.dtype}")
        full = (b, hq, sq, skv)
        if mask.dim() > 4 or any(
            m not in (1, f) for m, f in zip(mask.shape, full[4 - mask.dim() :], strict=True)
        ):
            raise ValueError(
                f"flash_attention: mask of shape {tuple(mask.shape)} does not broadcast to "
                f"(B, Hq, Sq, Skv) = {full}"
            )
    return b, hq, hkv, sq, skv


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    layout: str = "bhsd",
    mask_scale: float = 1.0,
    mask_fill: float = -math.inf,
    guard: str = "masked",
    mask_keeps: bool = True,
    kept: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    arch: str | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per head, as `reference.flash_attention_ref` (same arguments).

    layout "bhsd" (batch, heads, seq, dim) or "bshd" (batch, seq, heads, dim), for q, k, v and the output.
    GQA: k/v may have fewer heads, dividing q's. mask: float (added, the sum then times mask_scale) or bool (keep where
    it equals mask_keeps, mask_fill elsewhere), broadcastable to (B, Hq, Sq, Skv). causal: top-left
    aligned. guard: what a row whose every score is -inf ("none": NaN; "masked": 0) or that holds a NaN
    ("nan": 0) gives.
    Extras: `kept` (the mask's `kept_rows`, where a caller computes it once for several calls on one mask; the
    GPU programs read it for a key-only mask), `out` (written in place and returned; q's shape and dtype,
    contiguous in `layout`), `arch` (force "sm90" / "sm80"; else arch_of), `config` (tile config dict for GPU
    variants; else default / tuned).
    GPU: fp16, bf16, fp32; head dim 64 or 128. CPU: fp32, fp64; head dim <= 256.

    >>> import torch
    >>> from tkopt.kernels import flash_attention
    >>> q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))  # (batch, heads, seq, head dim)
    >>> o = flash_attention(q, k, v, causal=True)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(o, ref, atol=1e-5)
    True
    """
    b, hq, hkv, sq, skv = _check_inputs(q, k, v, mask, layout)
    dim = q.shape[3]
    a = arch_of(q, arch)
    dtype = _kernel_dtype(q, a, guard)

    if out is None:
        shape = (b, hq, sq, dim) if layout == "bhsd" else (b, sq, hq, dim)
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    else:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
            raise ValueError(
                f"flash_attention: out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)} "
                f"on {q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
    if out.numel() == 0:
        return out
    if skv == 0:  # no keys: softmax over nothing, and p @ v sums nothing
        return out.zero_()

    gkey, (q, k, v), margs = _prepared(q, k, v, mask, a, dtype, causal, scale, layout, mask_scale, mask_fill, guard,
                                       mask_keeps, kept)
    if a == "cpu":
        kern = compile_cpu(gkey)
        kern(q, k, v, *margs, out)
        return out

    dsm = device_sm()

    def run_with(cfg: dict) -> float:
        import triton.testing

        kk = compile_gpu(a, gkey, tuple(sorted(cfg.items())), dsm)
        return triton.testing.do_bench(lambda: kk(q, k, v, *margs, out), return_mode="median")

    if config is None:
        memo_key = (a, gkey, _size(b, sq, skv))
        config = _CONFIG_MEMO.get(memo_key)
        if config is None:  # first call for this key in this process: cached / tuned / default config
            config = _pick_config(a, gkey + memo_key[2], dtype, dim, run_with)
            if not tuning_suspended():  # a config picked while tuning is suspended is not final
                _CONFIG_MEMO[memo_key] = config
    last_config[a] = dict(config)
    kern = compile_gpu(a, gkey, tuple(sorted(config.items())), dsm)
    kern(q, k, v, *margs, out)
    return out

