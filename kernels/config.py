"""TileConfig: the compile-time tile knobs of the GEMM-family kernels, with validation per arch.

A config is hashable (frozen dataclass) and round-trips through plain dicts (`as_dict` / `from_dict`),
which is the form the tuning cache stores. `validate(arch, dtype)` raises `UnsupportedError` naming
what cannot work before anything is compiled: shared memory over the arch limit, tiles that are not
multiples of the matrix-instruction shape, thread counts the instruction cannot use, accumulators
that cannot fit in registers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from .arch import ARCHS, UnsupportedError

# Usable shared memory per block (opt-in maximum), bytes.
SMEM_LIMIT = {"sm90": 227 * 1024, "sm80": 163 * 1024}
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_TORCH_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64"}
# Max fp32 accumulator registers per thread we accept (255 registers minus addressing/epilogue room).
MAX_ACC_REGS = 192


def dtype_name(dtype) -> str:
    """'float16' etc. from a torch dtype or a name."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_NAMES:
            raise UnsupportedError(f"dtype {dtype} is not supported; expected one of {list(_TORCH_NAMES)}")
        return _TORCH_NAMES[dtype]
    if dtype not in _DTYPE_BYTES:
        raise UnsupportedError(f"dtype {dtype!r} is not supported; expected one of {list(_DTYPE_BYTES)}")
    return dtype


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and pipeline of a GEMM-family kernel.

    block_tile: (bm, bn, bk) output tile rows x cols per block and the K step.
    warp_tile: optional (wm, wn) per-warp tile; only validated (TileLang partitions warps itself), so
        it must tile the block and use exactly threads/32 warps (sm80) or threads/128 warpgroups x 4 (sm90).
    stages: software pipeline depth of the K loop (smem buffers per operand).
    threads: threads per block (sm90 wgmma: a multiple of 128; TileLang adds a 128-thread TMA producer
        warpgroup of its own when it warp-specializes).
    use_tensorcore: False only on cpu (the GPU variants are tensor-core kernels).
    swizzle: L2 rasterization panel size (T.use_swizzle), 0 = row-major block order.
    stage_c: stage the output tile through shared memory for a wide (TMA / vector) store.
    """

    block_tile: tuple[int, int, int] = (128, 128, 64)
    warp_tile: tuple[int, int] | None = None
    stages: int = 3
    threads: int = 128
    use_tensorcore: bool = True
    swizzle: int = 8
    stage_c: bool = True

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
        kw = dict(d)
        if "block_tile" in kw:
            kw["block_tile"] = tuple(kw["block_tile"])
        if kw.get("warp_tile") is not None:
            kw["warp_tile"] = tuple(kw["warp_tile"])
        return cls(**kw)

    def smem_bytes(self, dtype, accumulators: int = 1) -> int:
        """Shared memory the kernel allocates: pipelined A and B tiles (B per accumulator) + C staging."""
        e = _DTYPE_BYTES[dtype_name(dtype)]
        ab = self.stages * (self.bm * self.bk + accumulators * self.bk * self.bn) * e
        c = self.bm * self.bn * e if self.stage_c else 0
        return ab + c

    def validate(self, arch: str, dtype, accumulators: int = 1) -> TileConfig:
        """Raise UnsupportedError (naming the problem) if this config cannot work on `arch` for `dtype`."""
        if arch not in ARCHS:
            raise UnsupportedError(f"unknown arch {arch!r}; expected one of {ARCHS}")
        dt = dtype_name(dtype)
        bad = lambda msg: UnsupportedError(f"TileConfig {self.block_tile} on {arch} ({dt}): {msg}")  # noqa: E731
        if len(self.block_tile) != 3 or any(x <= 0 for x in self.block_tile):
            raise bad(f"block_tile must be three positive ints (bm, bn, bk), got {self.block_tile}")
        if self.stages < 1:
            raise bad(f"stages must be >= 1, got {self.stages}")
        if self.swizzle < 0:
            raise bad(f"swizzle must be >= 0, got {self.swizzle}")
        if arch == "cpu":
            if dt not in ("float32", "float64"):
                raise bad("the cpu variant supports float32 and float64")
            return self
        if dt not in ("float16", "bfloat16", "float32"):
            raise bad("GPU variants support float16, bfloat16 and float32 (tf32 tensor cores)")
        if not self.use_tensorcore:
            raise bad("use_tensorcore=False has no GPU variant (only the cpu variant is scalar)")
        if self.threads <= 0 or self.threads > 1024 or self.threads % 32:
            raise bad(f"threads must be a positive multiple of 32 and <= 1024, got {self.threads}")
        kmul = 16 if _DTYPE_BYTES[dt] == 2 else 8  # MMA K: 16 for 16-bit inputs, 8 for tf32
        if self.bk % kmul:
            raise bad(f"bk={self.bk} is not a multiple of the MMA K ({kmul} for {dt})")
        if arch == "sm90":
            if self.threads % 128:
                raise bad(f"wgmma needs whole warpgroups: threads={self.threads} is not a multiple of 128")
            groups = self.threads // 128
            if self.bm % (64 * groups) and self.bn % (8 * groups):
                raise bad(f"bm={self.bm} / bn={self.bn} cannot be split over {groups} warpgroups "
                          "(wgmma M=64 per warpgroup, N a multiple of 8)")
            if self.bm % 64:
                raise bad(f"bm={self.bm} is not a multiple of the wgmma M (64)")
            if self.bn % 8 or self.bn > 256 * groups:
                raise bad(f"bn={self.bn} must be a multiple of 8 and <= 256 per warpgroup")
        else:
            warps = self.threads // 32
            if self.bm % 16 or self.bn % 8:
                raise bad(f"bm={self.bm} must be a multiple of 16 and bn={self.bn} of 8 (mma m16n8)")
            if (self.bm // 16) * (self.bn // 8) < warps:
                raise bad(f"tile too small for {warps} warps")
        if self.warp_tile is not None:
            wm, wn = self.warp_tile
            if self.bm % wm or self.bn % wn:
                raise bad(f"warp_tile {self.warp_tile} does not divide the block tile")
            if wm % 16 or wn % 8:
                raise bad(f"warp_tile {self.warp_tile} is not a multiple of the MMA tile (16, 8)")
            if (self.bm // wm) * (self.bn // wn) != self.threads // 32:
                raise bad(f"warp_tile {self.warp_tile} gives {(self.bm // wm) * (self.bn // wn)} warps "
                          f"but threads={self.threads} is {self.threads // 32} warps")
        smem = self.smem_bytes(dt, accumulators)
        if smem > SMEM_LIMIT[arch]:
            raise bad(f"needs {smem // 1024} KB of shared memory ({self.stages} stages"
                      f"{', C staging' if self.stage_c else ''}); the {arch} limit is {SMEM_LIMIT[arch] // 1024} KB")
        acc_regs = accumulators * self.bm * self.bn // self.threads
        if acc_regs > MAX_ACC_REGS:
            raise bad(f"{accumulators} fp32 accumulator(s) of {self.bm}x{self.bn} over {self.threads} threads "
                      f"need {acc_regs} registers per thread (> {MAX_ACC_REGS}); use more threads or a smaller tile")
        return self


def default_config(arch: str, dtype, accumulators: int = 1, m: int | None = None, n: int | None = None,
                   sms: int | None = None) -> TileConfig:
    """Heuristic config per arch (no tuning). Given the output size (m, n) and the GPU's SM count, the
    largest tile whose grid still covers every SM: a 128x256 tile leaves most of an H200 idle on a
    2048x512 projection (32 CTAs for 132 SMs)."""
    dt = dtype_name(dtype)
    if arch == "cpu":
        return TileConfig(block_tile=(32, 32, 32), stages=1, threads=1, use_tensorcore=False, swizzle=0,
                          stage_c=False)
    if dt == "float32":
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
