"""Shared fixtures and helpers for kernel tests.

Helpers (importable from test files in tests/kernels as `from conftest import ...`, or through the
fixtures of the same purpose below):

- `lower_cuda(func, arch)`: lower a `@T.prim_func` to CUDA C++ source for sm90 or sm80 (no GPU needed;
  the target comes from tkopt.kernels.arch.target_of).
- `lowered_smem(func, arch, device=None)`: the dynamic shared memory bytes the lowered kernel launches with;
  `device` ("sm_90") lowers as `arch`'s program is built to run on that GPU.
- `cuda_compile(src, arch)`: nvcc-compile lowered CUDA source to a cubin for sm_90a / sm_80 with
  TileLang's template and CUTLASS include dirs (the flags TileLang's own libgen uses). Returns a
  `CudaBuild` (cubin path, ptxas resource report); raises AssertionError with nvcc's output on failure.
  Results are cached per source text for the session, so module-scoped fixtures can share them.
  Skips the calling test when nvcc is not on PATH.
  With `ptx=True` nvcc keeps its intermediates and the build carries the PTX (`CudaBuild.ptx`): which
  instructions the kernel really uses (fma.rn.f32 for CUDA-core FMA, mma...tf32 for tensor cores).

Fixtures: `cuda_compiler` (returns `cuda_compile`), `cuda_lowerer` (returns `lower_cuda`).
GPU tests: mark with `@pytest.mark.gpu`; tests/conftest.py skips them when CUDA is unavailable.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

from tkopt.kernels.arch import target_of

_NVCC_ARCH = {"sm90": ("90a", "sm_90a"), "sm80": ("80", "sm_80")}
_BUILD_DIR = tempfile.mkdtemp(prefix="tkopt_nvcc_")
_BUILDS: dict[tuple[str, str, tuple[str, ...]], CudaBuild] = {}


def lower_cuda(func, arch: str, pass_configs: dict | None = None) -> str:
    """CUDA C++ source of a `@T.prim_func` lowered for `arch` ("sm90" or "sm80") with the program's own
    `pass_configs` (gemm_epilogue.program_pass_configs)."""
    import tilelang
    from tvm.ir.transform import PassContext

    target = target_of(arch)
    with target, PassContext(config=pass_configs or {}):
        return tilelang.lower(func, target=target).kernel_source


def lowered_smem(func, arch: str, device: str | None = None, pass_configs: dict | None = None) -> int:
    """Dynamic shared memory bytes a `@T.prim_func`'s kernel, lowered for `arch` (run on `device`) with the
    program's own `pass_configs`, launches with."""
    import tilelang
    from tvm.ir.transform import PassContext
    from tvm.target import Target

    from tkopt.kernels.arch import run_pass_configs, run_target

    target = Target(run_target(arch, device)) if device else target_of(arch)
    with target, PassContext(config={**(run_pass_configs(arch, device) if device else {}), **(pass_configs or {})}):
        art = tilelang.lower(func, target=target)
    (kernel,) = art.device_mod.functions.values()
    return int(kernel.attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in kernel.attrs else 0


@dataclass(frozen=True)
class CudaBuild:
    arch: str
    cubin: str  # path of the compiled cubin
    log: str  # nvcc + ptxas -v output
    ptx: str | None = None  # the PTX, when compiled with ptx=True

    @property
    def registers(self) -> list[int]:
        """Registers per thread of each kernel, from the ptxas report."""
        return [int(x) for x in re.findall(r"Used (\d+) registers", self.log)]

    @property
    def static_smem(self) -> list[int]:
        """Static shared memory (bytes) of each kernel, from the ptxas report."""
        return [int(x) for x in re.findall(r"(\d+) bytes smem", self.log)]

    @property
    def spills(self) -> list[int]:
        """Spill stores (bytes) of each kernel, from the ptxas report."""
        return [int(x) for x in re.findall(r"(\d+) bytes spill stores", self.log)]


def _include_flags() -> list[str]:
    from tilelang.env import CUDA_HOME, CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    flags = [f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}"]
    if CUDA_HOME:
        flags.append(f"-I{os.path.join(CUDA_HOME, 'include')}")
    return flags


def cuda_compile(src: str, arch: str, extra: tuple[str, ...] = (), ptx: bool = False) -> CudaBuild:
    """nvcc-compile TileLang-lowered CUDA source for `arch` ("sm90" -> sm_90a, "sm80" -> sm_80)."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc not found on PATH")
    if arch not in _NVCC_ARCH:
        raise ValueError(f"cuda_compile: arch must be sm90 or sm80, got {arch!r}")
    if ptx:
        extra = (*extra, "--keep", f"--keep-dir={_BUILD_DIR}")
    key = (src, arch, tuple(extra))
    if key in _BUILDS:
        return _BUILDS[key]
    compute, sm = _NVCC_ARCH[arch]
    h = hashlib.sha1(f"{arch}|{extra}|{src}".encode()).hexdigest()[:16]
    cu = os.path.join(_BUILD_DIR, f"k_{h}.cu")
    cubin = os.path.join(_BUILD_DIR, f"k_{h}.{sm}.cubin")
    with open(cu, "w") as f:
        f.write(src)
    cmd = [
        nvcc, "-std=c++20", "-w", "-Xcudafe", "--diag_suppress=177", "-O3",
        "-gencode", f"arch=compute_{compute},code={sm}", "--cubin", "-Xptxas", "-v",
        *_include_flags(), *extra, "-o", cubin, cu,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not os.path.exists(cubin) or os.path.getsize(cubin) == 0:
        raise AssertionError(f"nvcc failed for {arch} (rc={proc.returncode}):\n{' '.join(cmd)}\n{log[-6000:]}")
    ptx_text = None
    if ptx:
        with open(os.path.join(_BUILD_DIR, f"k_{h}.ptx")) as f:
            ptx_text = f.read()
    build = CudaBuild(arch=arch, cubin=cubin, log=log, ptx=ptx_text)
    _BUILDS[key] = build
    return build


@pytest.fixture(scope="session")
def cuda_compiler():
    """The `cuda_compile(src, arch)` helper as a fixture."""
    return cuda_compile


@pytest.fixture(scope="session")
def cuda_lowerer():
    """The `lower_cuda(func, arch)` helper as a fixture."""
    return lower_cuda


def global_access_widths(src: str) -> dict[str, set[str]]:
    """{buffer: access kinds} of the global buffers X, R, W, B, Y, S in lowered CUDA source: the vector type of
    `*(uint4*)(Y + ...)`-style accesses, "scalar" for element accesses `Y[...]`."""
    out: dict[str, set[str]] = {}
    for ty, buf in re.findall(r"\*\((\w+)\*\)\(([XRWBYS]) \+", src):
        out.setdefault(buf, set()).add(ty)
    for buf in re.findall(r"(?<![\w.])([XRWBYS])\[", src):
        out.setdefault(buf, set()).add("scalar")
    return out
