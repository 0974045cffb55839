"""softmax: CPU numerics vs reference (any dim), errors, nvcc builds, GPU numerics."""

import pytest
import torch
from conftest import cuda_compile, lower_cuda

from tkopt.kernels.arch import UnsupportedError
from tkopt.kernels.norm import default_norm_config
from tkopt.kernels.reference import softmax_ref
from tkopt.kernels.row_softmax import softmax, softmax_program_gpu


def _close(y, ref, tol):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


@pytest.mark.parametrize("shape,dim", [((5, 1000), -1), ((1, 1000), 1), ((3, 1000, 2), 1), ((2, 7), 0)])
def test_cpu_matches_reference(shape, dim):
    torch.manual_seed(hash(shape) % 1000)
    x = torch.randn(*shape, dtype=torch.float64) * 4
    _close(softmax(x, dim), softmax_ref(x, dim), 1e-13)


def test_cpu_fp32_noncontiguous_poisoned_and_empty():
    torch.manual_seed(2)
    x = torch.randn(1000, 6).t() * 10  # (6, 1000) non-contiguous
    out = torch.full((6, 1000), float("nan"))
    y = softmax(x, -1, out=out)
    assert y is out
    _close(y, softmax_ref(x.double()).float(), 1e-6)
    assert softmax(torch.randn(0, 1000)).shape == (0, 1000)


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: softmax(torch.randn(3, 4).half()), UnsupportedError, "dtype torch.float16"),
        (lambda: softmax(torch.randn(3, 4), 2), IndexError, "out of range"),
        (lambda: softmax(torch.randn(3, 4), 0, out=torch.empty(3, 4)), ValueError, "last dim"),
        (lambda: softmax(torch.randn(3, 4), out=torch.empty(3, 5)), ValueError, "out must be"),
        (lambda: softmax(torch.tensor(1.0)), ValueError, "at least one dim"),
    ],
)
def test_errors(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_nvcc_compiles(arch):
    # one unguarded (4096 fp16) and one guarded (1000 bf16, 2 rows per CTA) program per arch
    for n, dt in ((4096, "float16"), (1000, "bfloat16")):
        src = lower_cuda(softmax_program_gpu(n, dt, **default_norm_config(n, 2, arch)), arch)
        build = cuda_compile(src, arch)
        assert build.spills and max(build.spills) == 0


GPU_ARCHS = ["sm90", "sm80"]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("m,n,dtype", [
    (1000, 4096, torch.float16), (1000, 4096, torch.bfloat16), (1000, 4096, torch.float32),
    (1, 1000, torch.float16), (77, 4095, torch.bfloat16), (77, 4095, torch.float32),
    (300, 128, torch.float16), (3, 32768, torch.float32), (77, 768, torch.float16),
])
def test_gpu(arch, dtype, m, n, monkeypatch):
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    x = torch.randn(m, n, device="cuda", dtype=dtype) * 4
    out = torch.full_like(x, float("nan"))
    y = softmax(x, -1, out=out, arch=arch)
    _close(y, softmax_ref(x), 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
def test_gpu_other_dim():
    x = torch.randn(8, 512, 64, device="cuda", dtype=torch.float16)
    _close(softmax(x, 1), softmax_ref(x, 1), 1e-2)
