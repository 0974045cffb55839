"""GEMM with fused epilogue, gated MLP, TileConfig: CPU numerics vs reference, errors, nvcc builds, GPU numerics."""

import os

import pytest
import torch
from conftest import cuda_compile, lower_cuda

from tkopt.kernels.arch import UnsupportedError
from tkopt.kernels.config import TileConfig, default_config
from tkopt.kernels.gated_gemm import gated_mlp, gated_mlp_program
from tkopt.kernels.gemm_epilogue import gemm, gemm_custom, gemm_program
from tkopt.kernels.reference import gated_mlp_ref, gemm_ref


def _rand(*shape, dtype=torch.float64, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _close(y, ref, tol):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


# ------------------------------------------------------------------------------------------------
# CPU numerics (each distinct (N, K, flags) compiles one C kernel: ~8 s; M is dynamic and reused)

# (a_shape, N, b_transposed, bias, act, residual); fp64 unless noted.
CPU_CASES = [
    ((37, 53), 45, False, False, None, False),  # odd sizes, plain
    ((1, 40), 64, True, True, "gelu_tanh", True),  # decode M=1, linear weight, full epilogue
    ((70, 40), 64, True, True, "gelu_tanh", True),  # same kernel, another M (dynamic M)
    ((2, 3, 17), 24, False, True, "relu", False),  # batched leading dims
    ((5, 65), 31, True, False, "gelu", True),
]


@pytest.mark.parametrize("a_shape,N,bt,has_bias,act,has_res", CPU_CASES)
def test_gemm_cpu_matches_reference(a_shape, N, bt, has_bias, act, has_res):
    torch.manual_seed(hash((a_shape, N)) % 1000)
    K = a_shape[-1]
    a = _rand(*a_shape)
    b = _rand(N, K) if bt else _rand(K, N)
    bias = _rand(N) if has_bias else None
    res = _rand(*a_shape[:-1], N) if has_res else None
    y = gemm(a, b, bias, act, res, b_transposed=bt)
    # fp64: TileLang's C codegen prints float constants with 7 digits (sqrt(2/pi) in gelu_tanh), so
    # activations with constants agree to ~1e-8 only; exact otherwise.
    _close(y, gemm_ref(a, b, bias, act, res, b_transposed=bt), 1e-7 if act in ("gelu", "gelu_tanh") else 1e-12)


def test_gemm_cpu_fp32_noncontiguous_and_out_poisoned():
    torch.manual_seed(1)
    a = _rand(40, 37, dtype=torch.float32).t()  # (37, 40) non-contiguous
    b = _rand(45, 40 * 2, dtype=torch.float32)[:, ::2]  # (45, 40) strided linear weight
    bias = _rand(45, dtype=torch.float32)
    res = _rand(45, 37, dtype=torch.float32).t()
    assert not a.is_contiguous() and not b.is_contiguous() and not res.is_contiguous()
    out = torch.full((37, 45), float("nan"))
    y = gemm(a, b, bias, "silu", res, b_transposed=True, out=out)
    assert y is out
    _close(out, gemm_ref(a, b, bias, "silu", res, b_transposed=True), 1e-5)
    # a non-contiguous out also gets every element
    out2 = torch.full((45, 37), float("nan")).t()
    gemm(a, b, bias, "silu", res, b_transposed=True, out=out2)
    _close(out2, gemm_ref(a, b, bias, "silu", res, b_transposed=True), 1e-5)


def test_gemm_custom_cpu_tiles():
    torch.manual_seed(2)
    a, b = _rand(21, 19), _rand(19, 13)
    # a GPU-style config (dict form) is accepted on cpu: its tile sizes are kept, GPU knobs dropped
    _close(gemm_custom(a, b, dict(block_tile=(8, 16, 8), stages=3), act="sigmoid"), gemm_ref(a, b, act="sigmoid"),
           1e-12)


def test_gemm_empty_and_k0():
    a, b = _rand(0, 8), _rand(8, 5)
    y = gemm(a, b)
    assert y.shape == (0, 5)
    a3 = _rand(2, 0, 8)
    assert gemm(a3, b, _rand(5), "relu").shape == (2, 0, 5)
    # K = 0: a @ b is zeros, epilogue still applies
    a0, b0, bias = _rand(3, 0), _rand(0, 4), _rand(4)
    _close(gemm(a0, b0, bias, "sigmoid"), gemm_ref(a0, b0, bias, "sigmoid"), 1e-12)


def test_gated_mlp_cpu():
    torch.manual_seed(3)
    x = _rand(2, 7, 24)
    wg, wu, bg, bu = _rand(20, 24), _rand(20, 24), _rand(20), _rand(20)
    y = gated_mlp(x, wg, wu, "silu", bg, bu, weights_transposed=True)
    _close(y, gated_mlp_ref(x, wg, wu, "silu", bg, bu, weights_transposed=True), 1e-12)
    x1 = _rand(1, 24)  # decode, same kernel
    _close(gated_mlp(x1, wg, wu, "silu", bg, bu, weights_transposed=True),
           gated_mlp_ref(x1, wg, wu, "silu", bg, bu, weights_transposed=True), 1e-12)
    x32 = _rand(9, 33, dtype=torch.float32)
    wg, wu = _rand(33, 17, dtype=torch.float32), _rand(33, 17, dtype=torch.float32)
    _close(gated_mlp(x32, wg, wu, "gelu"), gated_mlp_ref(x32, wg, wu, "gelu"), 1e-5)


# ------------------------------------------------------------------------------------------------
# Errors name the argument


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: gemm(_rand(4, 8), _rand(7, 5)), ValueError, "inner dims differ"),
        (lambda: gemm(_rand(4, 8), _rand(5, 7), b_transposed=True), ValueError, "inner dims differ"),
        (lambda: gemm(_rand(4, 8), _rand(8)), ValueError, "b must be 2-D"),
        (lambda: gemm(_rand(4, 8), _rand(8, 5, dtype=torch.float32)), TypeError, "b has dtype"),
        (lambda: gemm(_rand(4, 8), _rand(8, 5), bias=_rand(4)), ValueError, "bias must have shape (5,)"),
        (lambda: gemm(_rand(4, 8), _rand(8, 5), residual=_rand(5, 4)), ValueError, "residual must have"),
        (lambda: gemm(_rand(4, 8), _rand(8, 5), act="tanh"), UnsupportedError, "act: unknown activation"),
        (lambda: gemm(_rand(4, 8, dtype=torch.float16), _rand(8, 5, dtype=torch.float16)), UnsupportedError,
         "a: dtype torch.float16 is not supported on cpu"),
        (lambda: gemm(_rand(4, 8), _rand(8, 5).numpy()), TypeError, "b must be a torch.Tensor"),
        (lambda: gemm(_rand(4, 8), _rand(8, 5), out=_rand(4, 6)), ValueError, "out must have shape"),
        (lambda: gated_mlp(_rand(4, 8), _rand(8, 5), _rand(8, 6)), ValueError, "w_up must have w_gate's shape"),
        (lambda: gated_mlp(_rand(4, 8), _rand(8, 5), _rand(8, 5), b_gate=_rand(5)), ValueError, "given together"),
        (lambda: gated_mlp(_rand(4, 8), _rand(8, 5), _rand(8, 5), act=None), UnsupportedError, "gate activation"),
        (lambda: gemm(_rand(4, 8), _rand(8, 5), arch="sm90"), Exception, "needs CUDA tensors"),
    ],
)
def test_errors(call, exc, msg):
    with pytest.raises(exc) as info:
        call()
    assert msg in str(info.value)


# ------------------------------------------------------------------------------------------------
# TileConfig.validate


@pytest.mark.parametrize(
    "cfg,arch,dtype,msg",
    [
        (TileConfig((256, 256, 64), stages=4, threads=256), "sm90", "float16", "the sm90 limit is 227 KB"),
        (TileConfig((128, 256, 64), stages=3, threads=256), "sm80", "float16", "the sm80 limit is 163 KB"),
        (TileConfig((128, 128, 64), threads=192), "sm90", "float16", "not a multiple of 128"),
        (TileConfig((96, 128, 64), threads=128), "sm90", "float16", "wgmma M (64)"),
        (TileConfig((128, 128, 40), threads=128), "sm90", "float16", "not a multiple of the MMA K (16"),
        (TileConfig((128, 128, 12), threads=128), "sm80", "float32", "MMA K (8"),
        (TileConfig((128, 100, 32), threads=128), "sm80", "float16", "bn=100"),
        (TileConfig((256, 256, 32), stages=1, threads=128, stage_c=False), "sm90", "float16", "registers"),
        (TileConfig((128, 128, 32), warp_tile=(64, 64), threads=256), "sm80", "float16", "gives 4 warps"),
        (TileConfig((128, 128, 32), use_tensorcore=False), "sm80", "float16", "use_tensorcore=False"),
        (TileConfig((128, 128, 32)), "sm80", "float64", "GPU variants support"),
        (TileConfig((128, 128, 32)), "sm70", "float16", "unknown arch"),
    ],
)
def test_config_validate_rejects(cfg, arch, dtype, msg):
    with pytest.raises(UnsupportedError) as info:
        cfg.validate(arch, dtype)
    assert msg in str(info.value)


def test_config_valid_defaults_and_roundtrip():
    for arch in ("sm90", "sm80"):
        for dt in ("float16", "bfloat16", "float32"):
            for acc in (1, 2):
                for m in (None, 1):
                    default_config(arch, dt, acc, m).validate(arch, dt, acc)
                for m, n in ((2048, 512), (4096, 768), (8192, 8192), (100, 100)):
                    default_config(arch, dt, acc, m, n, sms=132).validate(arch, dt, acc)
    # The default tile shrinks until the grid covers the GPU's SMs (a small projection on an H200).
    assert default_config("sm90", "float16", 1, 8192, 8192, sms=132).block_tile == (128, 256, 64)
    assert default_config("sm90", "float16", 1, 4096, 768, sms=132).block_tile == (128, 128, 64)
    assert default_config("sm90", "float16", 1, 2048, 512, sms=132).block_tile == (64, 128, 64)
    c = TileConfig((128, 256, 64), warp_tile=(64, 64), stages=3, threads=256)
    assert TileConfig.from_dict(c.as_dict()) == c and hash(c) == hash(TileConfig.from_dict(c.as_dict()))
    with pytest.raises(ValueError, match="unknown fields"):
        TileConfig.from_dict({"tile": 1})
    # gated doubles B smem and accumulators
    big = TileConfig((128, 256, 64), stages=3, threads=256)
    big.validate("sm90", "float16")
    with pytest.raises(UnsupportedError):
        big.validate("sm90", "float16", accumulators=2)


def test_gemm_custom_rejects_before_compiling():
    with pytest.raises(UnsupportedError, match="limit"):
        gemm_program("sm90", 1024, 1024, "float16", TileConfig((256, 256, 128), stages=4, threads=256))


# ------------------------------------------------------------------------------------------------
# CUDA source for sm90 / sm80 compiles with nvcc (no GPU needed); one module-scoped build per program

NVCC_CASES = {
    "sm90-linear-bias-gelu_tanh": ("sm90", dict(N=8192, K=8192, dtype="float16",
                                                config=TileConfig((128, 256, 64), stages=3, threads=256),
                                                b_transposed=True, has_bias=True, act="gelu_tanh")),
    "sm80-bf16-residual-silu": ("sm80", dict(N=1000, K=1024, dtype="bfloat16",
                                             config=default_config("sm80", "bfloat16"),
                                             b_transposed=False, has_bias=True, act="silu", has_residual=True)),
    "sm90-decode-fp16": ("sm90", dict(N=4096, K=4096, dtype="float16", config=default_config("sm90", "float16", m=1),
                                      b_transposed=True, has_bias=False, act=None)),
    "sm90-gated-silu": ("sm90", dict(N=4096, K=2048, dtype="float16",
                                     config=default_config("sm90", "float16", accumulators=2),
                                     b_transposed=True, has_bias=True, act="silu", gated=True)),
    "sm80-gated-gelu-fp32": ("sm80", dict(N=512, K=256, dtype="float32",
                                          config=default_config("sm80", "float32", accumulators=2),
                                          b_transposed=True, has_bias=False, act="gelu", gated=True)),
}


@pytest.fixture(scope="module")
def nvcc_builds():
    return {}


@pytest.mark.parametrize("name", list(NVCC_CASES))
def test_nvcc_compiles(name, nvcc_builds):
    arch, kw = NVCC_CASES[name]
    kw = dict(kw)
    N, K, dtype, cfg = kw.pop("N"), kw.pop("K"), kw.pop("dtype"), kw.pop("config")
    src = lower_cuda(gemm_program(arch, N, K, dtype, cfg, **kw), arch)
    if arch == "sm90":
        assert "wgmma" in src, "sm90 program did not lower to wgmma"
        assert "tma_load" in src, "sm90 program did not lower to TMA loads"
    else:
        assert "mma" in src and "cp_async" in src, "sm80 program did not lower to mma + cp.async"
    build = cuda_compile(src, arch)
    assert os.path.getsize(build.cubin) > 0
    assert build.registers and max(build.registers) <= 255
    assert not any(build.spills), f"register spills: {build.spills}"
    nvcc_builds[name] = build


def test_gated_program_name():
    f = gated_mlp_program("cpu", 8, 8, "float32", default_config("cpu", "float32"), act="silu")
    assert len(f.params) == 4  # X, Wg, Wu, Out


# ------------------------------------------------------------------------------------------------
# GPU numerics: every arch x dtype vs a float32 reference, poisoned outputs

GPU_ARCHS = ["sm90", "sm80"]
GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _gpu_arch_ok(arch):
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability()
    return major == 9 if arch == "sm90" else major >= 8


def _tol(dtype):
    return 1e-2 if dtype != torch.float32 else 5e-3  # fp32 runs on tf32 tensor cores


GEMM_GPU_CASES = [
    (333, 520, 264, True, "gelu_tanh", True, True),
    (1, 1000, 1024, True, "silu", True, False),  # decode
    (257, 130, 100, False, "relu", False, True),  # K, N not 16-byte multiples in fp16: padded path
]
GATED_GPU_CASES = [("silu", True, True), ("gelu_tanh", False, False)]
GATED_MNK = (300, 384, 256)


@pytest.fixture(scope="module")
def gpu_precompiled():
    """Compile every GPU test kernel in parallel processes first (TileLang disk cache); tests then load."""
    from tkopt.kernels.gemm_epilogue import padded_nk, precompile

    keys = []
    for arch in GPU_ARCHS:
        if not _gpu_arch_ok(arch):
            continue
        for dt in GPU_DTYPES:
            e = torch.empty((), dtype=dt).element_size()
            for M, N, K, bt, act, hb, hr in GEMM_GPU_CASES:
                Np, Kp = padded_nk(arch, N, K, e)
                keys.append((arch, Np, Kp, dt, default_config(arch, dt, 1, M), bt, hb, act, hr, False, None))
            M, N, K = GATED_MNK
            for act, hb, wt in GATED_GPU_CASES:
                Np, Kp = padded_nk(arch, N, K, e)
                keys.append((arch, Np, Kp, dt, default_config(arch, dt, 2, M), wt, hb, act, False, True, None))
    res = precompile(keys)
    errors = {k: e for k, (t, e) in res.items() if e}
    print(f"precompiled {len(res)} kernels; {len(errors)} failed: {errors}")
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("M,N,K,bt,act,has_bias,has_res", GEMM_GPU_CASES)
def test_gemm_gpu(arch, dtype, M, N, K, bt, act, has_bias, has_res, monkeypatch, gpu_precompiled):
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    torch.manual_seed(M + N + K)
    dev = "cuda"
    a = torch.randn(M, K, device=dev, dtype=dtype)
    b = (torch.randn(N, K, device=dev, dtype=dtype) if bt else torch.randn(K, N, device=dev, dtype=dtype)) / K**0.5
    bias = torch.randn(N, device=dev, dtype=dtype) if has_bias else None
    res = torch.randn(M, N, device=dev, dtype=dtype) if has_res else None
    out = torch.full((M, N), float("nan"), device=dev, dtype=dtype)
    gemm(a, b, bias, act, res, b_transposed=bt, out=out, arch=arch)
    torch.cuda.synchronize()
    ref = gemm_ref(a.float(), b.float(), None if bias is None else bias.float(), act,
                   None if res is None else res.float(), b_transposed=bt)
    _close(out.float(), ref, _tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("act,has_bias,wt", GATED_GPU_CASES)
def test_gated_mlp_gpu(arch, dtype, act, has_bias, wt, monkeypatch, gpu_precompiled):
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    torch.manual_seed(7)
    M, N, K = GATED_MNK
    x = torch.randn(2, M // 2, K, device="cuda", dtype=dtype)
    shp = (N, K) if wt else (K, N)
    wg, wu = (torch.randn(*shp, device="cuda", dtype=dtype) / K**0.5 for _ in range(2))
    bg, bu = ((torch.randn(N, device="cuda", dtype=dtype), torch.randn(N, device="cuda", dtype=dtype))
              if has_bias else (None, None))
    out = torch.full((2, M // 2, N), float("nan"), device="cuda", dtype=dtype)
    gated_mlp(x, wg, wu, act, bg, bu, weights_transposed=wt, out=out, arch=arch)
    torch.cuda.synchronize()
    f = lambda t: None if t is None else t.float()  # noqa: E731
    _close(out.float(), gated_mlp_ref(x.float(), wg.float(), wu.float(), act, f(bg), f(bu), wt), _tol(dtype))
