"""TileConfig: the compile-time tile knobs of the GEMM-family kernels, with validation per arch.

A config is hashable (frozen dataclass) and round-trips through plain dicts (`as_dict` / `from_dict`),
which is the form the tuning cache stores. `validate(arch, dtype)` raises `UnsupportedError` before
anything is compiled, naming the constraint that failed (shared memory over the arch limit, tiles that
are not multiples of the instruction shape, a warp tile the kernel cannot lay out, accumulators that do
not fit in registers) and suggesting the nearest valid config, computed by searching the neighbours.

How a config computes (`TileConfig.math`): "mma" (16-bit tensor cores), "tf32" (fp32 on tf32 tensor
cores, when torch's matmul precision allows it), "tf32x3" (fp32 on tensor cores at full fp32 accuracy:
each operand split into a tf32 high and low part, three products), "simt" (use_tensorcore=False: FMA on
CUDA cores, exact fp32 arithmetic), "cpu" (TileLang's C backend).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace

import torch

from .arch import ARCHS, UnsupportedError
from .libraries import installed_version
from .precision import PRECISIONS
from .tuning import cache_dir, read_json, store_json

WARP_LAYOUTS = "warp-layouts.json"

# Usable shared memory per block (opt-in maximum, dynamic plus static), bytes.
SMEM_LIMIT = {"sm90": 227 * 1024, "sm80": 163 * 1024}
# Static shared memory besides the dynamic buffer, kept free under SMEM_LIMIT: ptxas reports 1024 bytes for the
# sm90 pipeline's mbarriers (16 bytes a stage, before alignment), none for sm80's cp.async pipeline.
STATIC_SMEM = 1024
# Deepest pipeline a config that leaves `stages` unset gets (it gets the most stages that fit, up to this).
MAX_STAGES = 4
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_TORCH_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64"}
# Max fp32 accumulator registers per thread we accept (255 registers minus addressing/epilogue room).
MAX_ACC_REGS = 192
# The SIMT kernel also holds its operand fragments in registers: accumulators + fragments stay under this.
MAX_SIMT_REGS = 224
# SIMT lanes of a warp: 4 rows x 8 columns, each lane owning a strided (wm/4) x (wn/8) sub-tile.
SIMT_LANES = (4, 8)
# Full-accuracy fp32 on the GPU when no config is given: "simt" or "tf32x3". On the H200 (2026-12-01,
# 1024^3, max error against float64) tf32x3 had 2.2x cuBLAS's error (4.6e-4 vs 2.1e-4: each operand keeps
# ~22 of fp32's 24 bits), the SIMT kernel within 2x: only SIMT is as accurate as `A @ B` at "highest".
FP32_FULL = "simt"


def dtype_name(dtype) -> str:
    """'float16' etc. from a torch dtype or a name."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_NAMES:
            raise UnsupportedError(f"dtype {dtype} is not supported; expected one of {list(_TORCH_NAMES)}")
        return _TORCH_NAMES[dtype]
    if dtype not in DTYPE_BYTES:
        raise UnsupportedError(f"dtype {dtype!r} is not supported; expected one of {list(DTYPE_BYTES)}")
    return dtype


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and pipeline of a GEMM-family kernel.

    block_tile: (bm, bn, bk) output tile rows x cols per block and the K step.
    warp_tile: optional (wm, wn) or (wm, wn, wk), one warp's share of the block tile. Tensor cores: the warps
        must cover the block exactly in a layout TileLang's warp partition can give (it is then used); wk
        must divide bk in whole MMA K steps. SIMT: each warp's 32 lanes (4 x 8) own a strided
        (wm/4) x (wn/8) sub-tile, and wk is the K depth of the register fragments (default: 16 bytes).
        None: the default layout.
    stages: software pipeline depth of the K loop (smem buffers per operand). None: the most that fit in the
        arch's shared memory, up to MAX_STAGES (`validate` returns the config with them set).
    threads: threads per block (sm90: a multiple of 128; TileLang adds a 128-thread TMA producer
        warpgroup of its own when it warp-specializes).
    use_tensorcore: True: tensor cores (fp32: tf32, or three tf32 products for full accuracy). False: FMA on
        CUDA cores (SIMT), exact IEEE fp32 arithmetic. Ignored on cpu (scalar C).
    swizzle: L2 rasterization panel size (T.use_swizzle), 0 = row-major block order.
    stage_c: stage the output tile through shared memory for a wide (TMA / vector) store (tensor cores only;
        the SIMT kernel stores from registers).
    persistent: 0: one block per output tile. n > 0: n resident blocks (one per SM: the GPU's SM count) each
        walk tiles in turn, grouped in panels of `swizzle` column tiles, so that a block's loads for its next
        tile overlap its last tile's epilogue and the grid has no partial last wave (tensor cores only).
    overlap: sm90, 16-bit inputs: the K loop written out as a TMA producer warpgroup and `threads` (128 or 256)
        of consumer warpgroups, each K step's wgmma group left in flight while the next step's is issued and its
        stage given back to the producer one step later. TileLang's own pipeline waits for every group before it
        releases the stage, which idles the tensor cores between K steps.
    pingpong: with overlap and persistent, threads=256: the two consumer warpgroups take a block's tiles in turn,
        each a whole tile (one warpgroup's registers: at most 128 x 192 accumulators), so that one warpgroup's
        epilogue and store run while the other's K loop keeps the tensor cores busy. Off, the two share each
        tile and the tensor cores idle through every epilogue.

    >>> from tkopt.kernels import TileConfig
    >>> cfg = TileConfig(block_tile=(128, 128, 32), warp_tile=(64, 64, 16), use_tensorcore=True)
    >>> cfg.validate("sm90", "float32").math("sm90", "float32")  # fp32 on tensor cores, full accuracy
    'tf32x3'
    >>> cfg.validate("sm90", "float32").stages  # unset: the most that fit (the tf32x3 split tiles need room)
    2
    >>> TileConfig(block_tile=(128, 256, 64), stages=4, threads=256).validate("sm80", "float16")
    Traceback (most recent call last):
    ...
    tkopt.kernels.arch.UnsupportedError: ... the sm80 limit is 163 KB. Nearest valid: TileConfig(...stages=3...)
    """

    block_tile: tuple[int, int, int] = (128, 128, 64)
    warp_tile: tuple[int, ...] | None = None
    stages: int | None = None
    threads: int = 128
    use_tensorcore: bool = True
    swizzle: int = 8
    stage_c: bool = True
    persistent: int = 0
    overlap: bool = False
    pingpong: bool = False

    def __post_init__(self):
        object.__setattr__(self, "block_tile", tuple(int(x) for x in self.block_tile))
        if self.warp_tile is not None:
            object.__setattr__(self, "warp_tile", tuple(int(x) for x in self.warp_tile))

    @property
    def bm(self) -> int:
        return self.block_tile[0]

    @property
    def bn(self) -> int:
        return self.block_tile[1]

    @property
    def bk(self) -> int:
        return self.block_tile[2]

    @property
    def tile_threads(self) -> int:
        """Threads that compute one output tile: one warpgroup in a pingpong kernel, else all of them."""
        return 128 if self.pingpong else self.threads

    def as_dict(self) -> dict:
        d = asdict(self)
        d["block_tile"] = list(self.block_tile)
        d["warp_tile"] = None if self.warp_tile is None else list(self.warp_tile)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TileConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"TileConfig: unknown fields {sorted(unknown)}; expected {sorted(names)}")
        return cls(**d)

    def describe(self) -> str:
        """The constructor call for this config, fields at their defaults left out."""
        defaults = TileConfig()
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if getattr(self, f.name) != getattr(defaults, f.name) or f.name == "block_tile"]
        return f"TileConfig({', '.join(parts)})"

    def math(self, arch: str, dtype, precision: str = "ieee") -> str:
        """How this config computes on `arch` for `dtype` under torch's fp32 matmul `precision` (module doc)."""
        if arch == "cpu":
            return "cpu"
        if not self.use_tensorcore:
            return "simt"
        if dtype_name(dtype) != "float32":
            return "mma"
        return "tf32" if precision == "tf32" else "tf32x3"

    def smem_bytes(self, arch: str, dtype, accumulators: int = 1, precision: str = "ieee") -> int:
        """Dynamic shared memory the lowered kernel allocates (a CPU test compares it with TileLang's lowering).

        T.Pipelined gives every tile written in the K loop `stages` buffers: A and B (one B per accumulator),
        and on sm90 also the tf32x3 split tiles (sm80 keeps one copy of those). The output tile staged for the
        store (stage_c) is live only after the loop, so TileLang places it over the loop's buffers, except in a
        persistent kernel, where the next tile's loop follows it, and in the overlap kernel, whose buffers
        TileLang lays out side by side. SIMT rows are padded by 16 bytes; its B tile is counted in the larger of
        its two layouts (B or B transposed)."""
        if self.stages is None:
            raise ValueError(f"{self.describe()}: stages is unset; validate(arch, dtype) sets it")
        e = DTYPE_BYTES[dtype_name(dtype)]
        bm, bn, bk = self.block_tile
        if arch == "cpu":
            return 0
        if not self.use_tensorcore:
            pad = 16 // e  # one 16-byte chunk per row keeps the fragment loads free of bank conflicts
            b = max(bk * (bn + pad), bn * (bk + pad))
            return self.stages * (bm * (bk + pad) + accumulators * b) * e
        tiles = (bm * bk + accumulators * bk * bn) * e
        loop = self.stages * tiles
        if self.math(arch, dtype, precision) == "tf32x3":  # hi and lo copies of A and of each B
            loop += 2 * tiles * (self.stages if arch == "sm90" else 1)
        staged_c = bm * bn * e * (2 if self.pingpong else 1) if self.stage_c else 0  # pingpong: one per warpgroup
        return loop + staged_c if self.persistent or self.overlap else max(loop, staged_c)

    def with_stages(self, arch: str, dtype, accumulators: int = 1, precision: str = "ieee") -> TileConfig:
        """This config with `stages` set: as pinned, else the most (up to MAX_STAGES) whose shared memory fits
        `arch` (1 when none does: validate then says how much it needs)."""
        if self.stages is not None:
            return self
        if arch == "cpu":
            return replace(self, stages=1)
        fits = [s for s in range(1, MAX_STAGES + 1)
                if replace(self, stages=s).smem_bytes(arch, dtype, accumulators, precision) + STATIC_SMEM
                <= SMEM_LIMIT[arch]]
        return replace(self, stages=max(fits, default=1))

    def simt_tiles(self, dtype) -> tuple[int, int, int, int, int]:
        """(wm, wn, wk, tm, tn) of the SIMT kernel: warp tile, fragment K depth, per-lane sub-tile.
        Raises UnsupportedError when the block cannot be laid out (validate says why first)."""
        problem, tiles = self._simt_layout(dtype_name(dtype))
        if problem:
            raise UnsupportedError(f"{self.describe()}: {problem}")
        return tiles

    def simt_owner(self, dtype, thread, i, j):
        """(row, col) in the block tile of SIMT thread `thread`'s accumulator (i, j): warps tile the block by
        warp_tile, and lane (r, c) of a warp's 4x8 lanes owns rows r, r+4, ... and columns c, c+8, ... of its
        warp tile, so that a warp's fragment loads read 4 (A) and 8 (B) consecutive shared-memory rows.
        Ints or TIR expressions."""
        wm, wn, _, _, _ = self.simt_tiles(dtype)
        lm, ln = SIMT_LANES
        warp, lane = thread // 32, thread % 32
        warps_n = self.bn // wn
        return (warp // warps_n) * wm + lane // ln + i * lm, (warp % warps_n) * wn + lane % ln + j * ln

    def _simt_layout(self, dt: str) -> tuple[str | None, tuple[int, int, int, int, int]]:
        bm, bn, bk = self.block_tile
        warps = self.threads // 32
        lm, ln = SIMT_LANES
        if self.warp_tile is None:
            layouts = [(bm // pm, bn // (warps // pm)) for pm in range(1, warps + 1)
                       if warps % pm == 0 and bm % pm == 0 and bn % (warps // pm) == 0]
            layouts = [(wm, wn) for wm, wn in layouts if wm % lm == 0 and wn % ln == 0]
            if not layouts:
                return (f"{bm}x{bn} cannot be split over {warps} warps of {lm}x{ln} lanes"), (0,) * 5
            wm, wn = min(layouts, key=lambda t: (abs(math.log2((t[0] // lm) / (t[1] // ln))), t))
            wk = 0
        else:
            wm, wn = self.warp_tile[:2]
            wk = self.warp_tile[2] if len(self.warp_tile) == 3 else 0
            if bm % wm or bn % wn:
                return f"warp_tile {self.warp_tile} does not divide the block tile", (0,) * 5
            if (bm // wm) * (bn // wn) != warps:
                return (f"warp_tile {self.warp_tile} gives {(bm // wm) * (bn // wn)} warps but threads={self.threads} "
                        f"is {warps} warps"), (0,) * 5
            if wm % lm or wn % ln:
                return f"SIMT warp_tile {self.warp_tile} is not a multiple of the {lm}x{ln} lanes", (0,) * 5
        if bk * DTYPE_BYTES[dt] % 16:
            return f"SIMT bk={bk} must span whole 16-byte chunks ({16 // DTYPE_BYTES[dt]} x {dt})", (0,) * 5
        if not wk:
            wk = 16 // DTYPE_BYTES[dt]
        if bk % wk:
            return f"SIMT wk={wk} does not divide bk={bk}", (0,) * 5
        return None, (wm, wn, wk, wm // lm, wn // ln)

    def validate(self, arch: str, dtype, accumulators: int = 1, precision: str = "ieee") -> TileConfig:
        """Raise UnsupportedError (the failed constraint and the nearest valid config) unless this config
        works on `arch` for `dtype` with `accumulators` B operands under fp32 matmul `precision`."""
        if arch not in ARCHS:
            raise UnsupportedError(f"unknown arch {arch!r}; expected one of {ARCHS}")
        if precision not in PRECISIONS:
            raise UnsupportedError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
        dt = dtype_name(dtype)
        problem = self.problem(arch, dt, accumulators, precision)
        if problem is None:
            return self.with_stages(arch, dt, accumulators, precision)
        msg = f"{self.describe()} on {arch} ({dt}): {problem}"
        near = self._nearest_valid(arch, dt, accumulators, precision)
        raise UnsupportedError(msg + (f". Nearest valid: {near.describe()}" if near else ""))

    def problem(self, arch: str, dt: str, accumulators: int = 1, precision: str = "ieee") -> str | None:
        """The first constraint this config fails on `arch` for dtype name `dt`, or None if it is valid."""
        bm, bn, bk = self.block_tile if len(self.block_tile) == 3 else (0, 0, 0)
        if len(self.block_tile) != 3 or min(self.block_tile) <= 0:
            return f"block_tile must be three positive ints (bm, bn, bk), got {self.block_tile}"
        if self.warp_tile is not None and (len(self.warp_tile) not in (2, 3) or min(self.warp_tile) <= 0):
            return f"warp_tile must be (wm, wn) or (wm, wn, wk) of positive ints, got {self.warp_tile}"
        if self.stages is not None and self.stages < 1:
            return f"stages must be >= 1, got {self.stages}"
        if self.swizzle < 0:
            return f"swizzle must be >= 0, got {self.swizzle}"
        if self.persistent < 0:
            return f"persistent must be >= 0 (0: one block per tile), got {self.persistent}"
        if arch == "cpu":
            return None if dt in ("float32", "float64") else "the cpu variant supports float32 and float64"
        if dt not in ("float16", "bfloat16", "float32"):
            return "GPU variants support float16, bfloat16 and float32"
        if self.threads <= 0 or self.threads > 1024 or self.threads % 32:
            return f"threads must be a positive multiple of 32 and <= 1024, got {self.threads}"
        if self.overlap and (arch != "sm90" or not self.use_tensorcore or DTYPE_BYTES[dt] != 2):
            return "overlap is the sm90 wgmma pipeline: tensor cores and 16-bit inputs only"
        if self.overlap and self.threads not in (128, 256):
            # its register split (producer 24, consumers 240 per thread) fits one or two consumer warpgroups
            return f"overlap runs one or two consumer warpgroups: threads must be 128 or 256, got {self.threads}"
        if self.pingpong and not (self.overlap and self.persistent and self.threads == 256):
            return "pingpong alternates a persistent block's tiles between two warpgroups: it needs overlap, " \
                   "persistent and threads=256"
        if self.pingpong and accumulators * self.bm * self.bn // 128 > MAX_ACC_REGS:
            return (f"a pingpong tile is one warpgroup's: {accumulators} x {self.bm}x{self.bn} fp32 accumulators are "
                    f"{accumulators * self.bm * self.bn // 128} registers per thread (> {MAX_ACC_REGS})")
        if self.use_tensorcore:
            problem = self._tensorcore_problem(arch, dt)
        elif self.persistent:
            problem = "persistent applies to the tensor-core kernels, not SIMT (use_tensorcore=False)"
        else:
            problem, (_, _, wk, tm, tn) = self._simt_layout(dt)
            if problem is None:
                regs = accumulators * tm * tn + (tm + accumulators * tn) * wk * DTYPE_BYTES[dt] // 4
                if accumulators * tm * tn > MAX_ACC_REGS or regs > MAX_SIMT_REGS:
                    problem = (f"SIMT lanes own {tm}x{tn} outputs x {accumulators} accumulator(s) plus wk={wk} "
                               f"fragments: {regs} registers per thread (> {MAX_SIMT_REGS}); use more threads, a "
                               "smaller tile or a smaller wk")
        if problem:
            return problem
        staged = self.with_stages(arch, dt, accumulators, precision)
        smem = staged.smem_bytes(arch, dt, accumulators, precision) + STATIC_SMEM
        if smem > SMEM_LIMIT[arch]:
            what = ", tf32 split tiles" if self.math(arch, dt, precision) == "tf32x3" else ""
            return (f"needs {-(-smem // 1024)} KB of shared memory ({staged.stages} stage(s){what}); the {arch} "
                    f"limit is {SMEM_LIMIT[arch] // 1024} KB")
        acc_regs = accumulators * bm * bn // self.threads
        if self.use_tensorcore and acc_regs > MAX_ACC_REGS:
            return (f"{accumulators} fp32 accumulator(s) of {bm}x{bn} over {self.threads} threads need {acc_regs} "
                    f"registers per thread (> {MAX_ACC_REGS}); use more threads or a smaller tile")
        return None

    def _tensorcore_problem(self, arch: str, dt: str) -> str | None:
        bm, bn, bk = self.block_tile
        kmul = 16 if DTYPE_BYTES[dt] == 2 else 8  # MMA K: 16 for 16-bit inputs, 8 for tf32
        if bk % kmul:
            return f"bk={bk} is not a multiple of the MMA K ({kmul} for {dt})"
        if arch == "sm90":
            if self.threads % 128:
                return f"wgmma needs whole warpgroups: threads={self.threads} is not a multiple of 128"
            groups = self.tile_threads // 128
            if bm % 64:
                return f"bm={bm} is not a multiple of the wgmma M (64)"
            if bn % 8 or bn > 256 * groups:
                return f"bn={bn} must be a multiple of 8 and <= 256 per warpgroup"
        else:
            if bm % 16 or bn % 8:
                return f"bm={bm} must be a multiple of 16 and bn={bn} of 8 (mma m16n8)"
            if (bm // 16) * (bn // 8) < self.threads // 32:
                return f"tile too small for {self.threads // 32} warps"
        if self.warp_tile is None:
            return None
        wm, wn = self.warp_tile[:2]
        if len(self.warp_tile) == 3 and (bk % self.warp_tile[2] or self.warp_tile[2] % kmul):
            return f"warp_tile wk={self.warp_tile[2]} must divide bk={bk} in whole MMA K steps ({kmul} for {dt})"
        if bm % wm or bn % wn:
            return f"warp_tile {self.warp_tile} does not divide the block tile"
        warps = self.tile_threads // 32
        if (bm // wm) * (bn // wn) != warps:
            return (f"warp_tile {self.warp_tile} gives {(bm // wm) * (bn // wn)} warps but a tile's "
                    f"{self.tile_threads} threads are {warps} warps")
        layouts = _warp_layouts(arch, dt, bm, bn, self.tile_threads)
        if (bm // wm, bn // wn) not in layouts.values():
            options = sorted({(bm // m, bn // n) for m, n in layouts.values()})
            return f"warp_tile {self.warp_tile} is not a layout TileLang's warp partition gives; possible: {options}"
        return None

    def warp_policy(self, arch: str, dtype) -> int:
        """TileLang's GemmWarpPolicy (0 square, 1 full row, 2 full col) that lays warps out as warp_tile."""
        if self.warp_tile is None:
            return 0
        grid = (self.bm // self.warp_tile[0], self.bn // self.warp_tile[1])
        return next(p for p, g in _warp_layouts(arch, dtype_name(dtype), self.bm, self.bn, self.tile_threads).items()
                    if g == grid)

    def _nearest_valid(self, arch: str, dt: str, accumulators: int, precision: str) -> TileConfig | None:
        """The valid config fewest changes away (one field, then two), ties broken by the smallest change."""
        moves = self._moves()
        for depth in (1, 2):
            found = []
            for combo in itertools.combinations(moves, depth):
                if len({name for name, _, _ in combo}) < depth:
                    continue
                cfg = self
                for name, value, _ in combo:
                    cfg = replace(cfg, **{name: value})
                try:
                    ok = cfg.problem(arch, dt, accumulators, precision) is None
                except (ValueError, ZeroDivisionError):
                    ok = False
                if ok:
                    found.append((sum(cost for _, _, cost in combo), cfg.describe(), cfg))
            if found:
                return min(found, key=lambda f: f[:2])[2]
        return None

    def _moves(self) -> list[tuple[str, object, float]]:
        """Single-field changes (field, new value, cost): halve/double a size, other stage counts."""
        moves: list[tuple[str, object, float]] = []
        for i, x in enumerate(self.block_tile):
            # halve/double, and the powers of two either side (a size that is not a multiple of anything)
            below = 1 << max(x.bit_length() - 1, 0)
            for v in {x // 2, x * 2, x // 4, x * 4, below, below * 2} - {x}:
                if v >= 8:
                    t = list(self.block_tile)
                    t[i] = v
                    moves.append(("block_tile", tuple(t), abs(math.log2(v / x))))
        # Both block dims halved/doubled together (a smaller square tile), and the K step with them.
        for f in (0.5, 2):
            moves.append(("block_tile", (int(self.bm * f), int(self.bn * f), self.bk), 1.5))
        if self.stages is not None:
            moves += [("stages", s, 0.5 * abs(s - self.stages)) for s in range(1, 7) if s != self.stages]
        moves += [("threads", t, abs(math.log2(t / self.threads))) for t in (64, 128, 256, 512) if t != self.threads]
        moves.append(("stage_c", not self.stage_c, 1.0))
        if self.warp_tile is not None:
            moves.append(("warp_tile", None, 2.0))
            for i in range(len(self.warp_tile)):
                for f in (0.5, 2):
                    w = list(self.warp_tile)
                    w[i] = int(w[i] * f)
                    if w[i] >= 1:
                        moves.append(("warp_tile", tuple(w), 1.0))
        if self.overlap:
            moves.append(("overlap", False, 1.0))
        if self.pingpong:
            moves.append(("pingpong", False, 1.0))
        return moves


@functools.lru_cache(maxsize=256)
def _warp_layouts(arch: str, dt: str, bm: int, bn: int, threads: int) -> dict[int, tuple[int, int]]:
    """{policy: (warps along M, warps along N)} as TileLang partitions warps for this tile and instruction; kept on
    disk per TileLang version, so that checking a config (planning a warm compile's GEMMs) imports no TileLang."""
    path = os.path.join(cache_dir(), WARP_LAYOUTS)
    key = json.dumps([installed_version("tilelang"), arch, dt, bm, bn, threads])
    known = read_json(path).get(key)
    if isinstance(known, dict):
        return {int(p): (int(w[0]), int(w[1])) for p, w in known.items()}
    import tilelang  # noqa: F401  (puts its bundled tvm on the path)
    from tilelang import ir

    from .arch import target_of

    inst = "cuda.wgmma" if arch == "sm90" and DTYPE_BYTES[dt] == 2 else "cuda.mma"
    target = target_of(arch)
    layouts = {p: tuple(int(w) for w in ir.GemmWarpPolicy(p, 0, 0).compute_warp_partition(bm, bn, threads, target,
                                                                                         inst))
               for p in (0, 1, 2)}
    with contextlib.suppress(OSError):  # a read-only cache: computed again next time
        store_json(path, key, {str(p): list(w) for p, w in layouts.items()})
    return layouts


def default_config(arch: str, dtype, accumulators: int = 1, m: int | None = None, n: int | None = None,
                   sms: int | None = None, precision: str = "ieee") -> TileConfig:
    """Heuristic config per arch (no tuning). Given the output size (m, n) and the GPU's SM count, the
    largest tile whose grid still covers every SM: a 128x256 tile leaves most of an H200 idle on a
    2048x512 projection (32 CTAs for 132 SMs). fp32 at precision "ieee" gets the FP32_FULL kernel."""
    dt = dtype_name(dtype)
    if arch == "cpu":
        return TileConfig(block_tile=(32, 32, 32), stages=1, threads=1, use_tensorcore=False, swizzle=0,
                          stage_c=False)
    if dt == "float32":
        if precision == "ieee" and FP32_FULL == "simt":
            if accumulators == 2:
                return TileConfig(block_tile=(64, 128, 16), stages=3, threads=256, use_tensorcore=False)
            return TileConfig(block_tile=(128, 128, 16), stages=3, threads=256, use_tensorcore=False)
        if precision == "ieee":
            if accumulators == 2:  # four accumulators (gate and up, each with its tf32x3 correction)
                return TileConfig(block_tile=(64, 64, 32), stages=2, threads=256)
            if arch == "sm80":
                return TileConfig(block_tile=(128, 128, 32), stages=2, threads=256, stage_c=False)
            return TileConfig(block_tile=(128, 128, 32), stages=2, threads=256)
        if arch == "sm80" and accumulators == 2:
            return TileConfig(block_tile=(64, 64, 32), stages=2, threads=128)
        return TileConfig(block_tile=(128, 128, 32), stages=3 if arch == "sm90" else 2,
                          threads=256 if arch == "sm90" else 128)
    if m is not None and m <= 64:
        if arch == "sm90":
            return TileConfig(block_tile=(64, 128, 64), stages=4, threads=128)
        return TileConfig(block_tile=(64, 64, 64), stages=3, threads=128)
    if arch == "sm90":
        options = [TileConfig(block_tile=(128, 128, 64), stages=3, threads=256),
                   TileConfig(block_tile=(64, 128, 64), stages=4, threads=128)]
        if accumulators == 1:
            options.insert(0, TileConfig(block_tile=(128, 256, 64), stages=3, threads=256))
    elif accumulators == 2:
        options = [TileConfig(block_tile=(128, 64, 32), stages=3, threads=128),
                   TileConfig(block_tile=(64, 64, 64), stages=3, threads=128)]
    else:
        options = [TileConfig(block_tile=(128, 128, 32), stages=3, threads=128),
                   TileConfig(block_tile=(64, 64, 64), stages=3, threads=128)]
    if m is None or n is None or sms is None:
        return options[0]
    for c in options:
        if -(-m // c.bm) * -(-n // c.bn) >= sms:
            return c
    return options[-1]
