"""Float constants reach every kernel at the program's precision (tkopt/kernels/constants.py).

TileLang's C printer writes float constants with 7 significant digits, float64 ones too: before
`const`, float64 GELU was 5e-9 off (1/sqrt(2) printed as 7.071068e-01). Checked on the C backend's
output: a round trip of hard constants through one compiled kernel, and the lowered source of every
kernel's float64 cpu program, which must hold no 7-digit literal (an exact constant that needs all 7
digits would be a false alarm; none of the kernels has one). On CUDA, that they cost nothing.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import tilelang
import tilelang.language as T
import torch

from tkopt.kernels import attention, conv, norm, row_softmax
from tkopt.kernels.arch import target_of
from tkopt.kernels.config import default_config
from tkopt.kernels.constants import const
from tkopt.kernels.gemm_epilogue import gemm_program

VALUES = [1 / math.sqrt(2), math.sqrt(2 / math.pi), 0.044715, 1 / 3, 1e-5, math.pi, 1 / math.sqrt(8), 0.5, 0.0,
          -0.0, float(np.finfo(np.float32).max) * 2, -np.finfo(np.float64).max, 5e-324, 1e-40, math.inf, -math.inf]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_const_round_trips_exactly_through_the_c_backend(dtype):
    """Each value, rounded to dtype, comes back bit for bit from a compiled C kernel (subnormals, +-0,
    values past float32's range, infinities included); NaN stays NaN."""
    values = [*VALUES, math.nan]

    @T.prim_func
    def write(C: T.Tensor((len(values),), dtype)):
        from tilelang.cpu.language import Kernel

        with Kernel(1) as _:
            for i, x in enumerate(values):
                C[i] = const(x, dtype)

    out = torch.empty(len(values), dtype=getattr(torch, dtype))
    tilelang.compile(write, target="c", target_host="c", execution_backend="cython")(out)
    with np.errstate(over="ignore"):
        want = np.array(values, dtype)
    np.testing.assert_array_equal(out.numpy().view(f"int{out.element_size() * 8}")[:-1],
                                  want.view(f"int{want.itemsize * 8}")[:-1])
    assert math.isnan(out[-1])


def _float64_cpu_programs():
    """One float64 cpu program per kernel, with every float constant it can hold (activations, an eps and
    a scale that 7 digits do not spell)."""
    cfg = default_config("cpu", "float64")
    eps = 1 / 3 * 1e-5
    yield "gemm gelu", gemm_program("cpu", 24, 16, "float64", cfg, has_bias=True, act="gelu")
    yield "gemm gelu_tanh", gemm_program("cpu", 24, 16, "float64", cfg, act="gelu_tanh", gated=True)
    for kind in ("layer", "rms"):
        yield f"{kind} norm", norm.norm_program_cpu(kind, 24, "float64", "float64", has_residual=True,
                                                    has_weight=True, has_bias=kind == "layer", write_sum=True,
                                                    eps=eps)
    yield "softmax", row_softmax.softmax_program_cpu(24, "float64")
    yield "attention", attention.cpu_program("float64", 12, 2, 2, False, mask_kind="add", mask_scale=1 / 3,
                                             scale=1 / math.sqrt(12))
    yield "attention bool mask", attention.cpu_program("float64", 8, 2, 1, True, mask_kind="bool",
                                                       mask_fill=-1 / 3 * 1e4)
    for act in ("gelu", "gelu_tanh", "silu"):
        yield f"conv {act}", conv.conv2d_program_cpu(3, 6, 6, 4, 3, 3, (1, 1), (1, 1), (1, 1), "float64", act, True)


def test_float64_cpu_programs_hold_no_rounded_literal():
    """A literal with all 7 printed digits (d.dddddde±x, last digit not 0) is a constant the printer
    rounded; every kernel's float64 program must spell such constants through `const`."""
    lossy = re.compile(r"(?<![\w.])\d\.\d{5}[1-9]e[+-]\d+")
    found = {}
    for name, func in _float64_cpu_programs():
        with target_of("cpu") as target:
            src = tilelang.lower(func, target=target).kernel_source
        hits = lossy.findall(src)
        if hits:
            found[name] = sorted(set(hits))
    assert not found, f"float constants printed with 7 digits: {found}"


def test_bit_pattern_constants_fold_into_immediates_on_cuda():
    """On a GPU the rebuilt constants cost nothing: nvcc folds them into the FMA's immediates (the float32
    bits of 1/sqrt(2) and 1/3), with no float64 conversion left in the PTX."""
    from conftest import cuda_compile, lower_cuda

    @T.prim_func
    def scale(A: T.Tensor((256,), "float32"), C: T.Tensor((256,), "float32")):
        with T.Kernel(1, threads=128) as _:
            f = T.alloc_fragment((256,), "float32")
            T.copy(A, f)
            for i in T.Parallel(256):
                f[i] = f[i] * const(1 / math.sqrt(2), "float32") + const(1 / 3, "float32")
            T.copy(f, C)

    ptx = cuda_compile(lower_cuda(scale, "sm90"), "sm90", ptx=True).ptx
    assert re.search(r"fma\.rn\.f32\s+%f\d+, %f\d+, 0f3F3504F3, 0f3EAAAAAB;", ptx), ptx
    assert ".f64" not in ptx
