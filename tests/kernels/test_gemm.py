"""GEMM with fused epilogue, gated MLP, TileConfig: CPU numerics vs reference, errors, nvcc builds, GPU numerics."""

import fcntl
import hashlib
import json
import math
import os
import tempfile
from dataclasses import fields, replace

import pytest
import torch
from conftest import cuda_compile, lower_cuda, lowered_smem

from tkopt.kernels import config as config_module
from tkopt.kernels.activations import _GELU_TAIL, _LOG2_PHI_NEG, _LOG2_PHI_NEG_16, activation
from tkopt.kernels.arch import UnsupportedError
from tkopt.kernels.config import FP32_FULL, TileConfig, default_config
from tkopt.kernels.gated_gemm import gated_mlp, gated_mlp_program
from tkopt.kernels.gemm_epilogue import (
    _SELECTED,
    FP32_TUNE_CANDIDATES,
    _candidate,
    _tf32_split,
    _tf32x3_sum,
    fp32_precision,
    gemm,
    gemm_custom,
    gemm_program,
    kernel_key,
    program_pass_configs,
    select_config,
)
from tkopt.kernels.precision import matmul_precision
from tkopt.kernels.reference import apply_activation, gated_mlp_ref, gemm_ref


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
    # fp64 to 1e-12 with every activation: its constants enter at float64 precision (tkopt/kernels/constants.py)
    _close(y, gemm_ref(a, b, bias, act, res, b_transposed=bt), 1e-12)


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


@pytest.mark.parametrize("coeffs, bound", [(_LOG2_PHI_NEG, 4.5e-7), (_LOG2_PHI_NEG_16, 1.05e-4)])
def test_gelu_fit_is_log2_phi_to_float32_accuracy(coeffs, bound):
    """The exp2 fits behind float32's exact GELU: log2 Phi(-y) within `bound` on [0, _GELU_TAIL], exactly -1 at 0
    (float32 results: degree 10; results rounded to 16 bits: degree 6)."""
    y = torch.linspace(0, _GELU_TAIL, 20001, dtype=torch.float64)
    fit = sum(c * y**i for i, c in enumerate(coeffs))
    true = torch.log2(0.5 * torch.special.erfc(y / math.sqrt(2)))
    assert (fit - true).abs().max() <= bound
    assert coeffs[0] == -1.0
    assert float(0.5 * math.erfc(_GELU_TAIL / math.sqrt(2))) < 2.0**-25  # 1 - Phi(-y) rounds to 1 past the tail


def pre_activations(x, device="cpu"):
    """(a, b): a @ b.T is x in its first column, one value a row (b a linear weight)."""
    a = torch.zeros(x.numel(), 8)
    a[:, 0] = x
    b = torch.zeros(16, 8)
    b[:, 0] = 1.0
    return a.to(device), b.to(device)


def gelu_pre_activations(device):
    """(a, b, x): pre_activations of a sweep over GELU's range and the values at its edges."""
    inf, nan = float("inf"), float("nan")
    x = torch.cat([torch.linspace(-12, 12, 2401), torch.linspace(-1e-3, 1e-3, 201),
                   torch.tensor([inf, -inf, nan, -1e30, 1e30, -0.0, _GELU_TAIL, -_GELU_TAIL, 5.49, -5.49, -5.51])])
    return *pre_activations(x, device), x.double()


def check_gelu(y, x, rel, abs_):
    """y = GELU(x) (one column a row of x) against float64 erf GELU within rel * |GELU| + abs_; at the edges as
    float32 erf GELU: inf stays inf, -inf (-inf * 0) and NaN give NaN, a huge negative x gives 0."""
    y = y.double()
    finite = x.isfinite()
    true = x[finite] * 0.5 * torch.special.erfc(-x[finite] / math.sqrt(2))
    err = (y[finite] - true[:, None]).abs()
    assert (err <= rel * true.abs()[:, None] + abs_).all(), err.max()
    assert y[x == float("inf")].eq(float("inf")).all()
    assert y[(x == -float("inf")) | x.isnan()].isnan().all()
    assert y[finite & (x < -1e29)].eq(0).all() and (y[finite & (x > 1e29)] == x[finite & (x > 1e29)][:, None]).all()


def test_gelu_epilogue_matches_erf_gelu_over_its_whole_range():
    """float32's GELU epilogue (exp2 of a fit, not erff) is exact GELU to float32 accuracy on every range, tails
    and specials included (the CPU kernel; test_gelu_epilogue_gpu runs the GPU ones)."""
    a, b, x = gelu_pre_activations("cpu")
    y = gemm(a, b, act="gelu", b_transposed=True)
    check_gelu(y, x, rel=4e-6, abs_=1.2e-7)


def _activation_on_cpu(x, act, out_dtype):
    """activation(x, act, "float32", out_dtype) element by element, compiled with TileLang's C backend."""
    import tilelang
    import tilelang.language as T
    from tilelang.cpu.language import Kernel

    n = x.numel()

    @T.prim_func
    def prog(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32")):
        with Kernel(1) as _:
            for i in T.serial(n):
                Y[i] = activation(X[i], act, "float32", out_dtype)

    y = torch.empty_like(x)
    tilelang.compile(prog, target="c", target_host="c", execution_backend="cython")(x.contiguous(), y)
    return y


def test_gelu_for_16_bit_outputs_is_exact_gelu_well_under_their_rounding():
    """The GELU that GEMMs with 16-bit outputs run (degree-6 fit): within 3e-5 of exact GELU, relative, over its
    whole range in float32, a thirtieth of fp16's unit; tails and specials as the float32 one."""
    _, _, x = gelu_pre_activations("cpu")
    y = _activation_on_cpu(x.float(), "gelu", "float16")
    check_gelu(y[:, None], x, rel=3e-5, abs_=1.2e-7)
    assert ((y - _activation_on_cpu(x.float(), "gelu", "float32")).abs() > 1e-6).any()  # it is the other fit


@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "silu", "sigmoid"])
def test_activation_epilogues_keep_eager_nan_inf_and_signed_zero(act):
    """Every epilogue activation gives torch's value at the edges (one element at a time: torch's vectorized CPU GELU
    differs from its own scalar path at +inf): NaN stays NaN (ReLU's max(x, 0) turned it into 0: fuzz seed 6722,
    a fully masked attention row's NaN into a Linear + ReLU), and signs of zero and tiny values are eager's."""
    a, b = pre_activations(torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1.5, -1.5, 1e30, -1e30,
                                         3e-39]))
    y = gemm(a, b, act=act, b_transposed=True)[:, 0]
    pre = (a @ b.T)[:, 0]  # eager's pre-activation (its sum turns -0.0 into +0.0)
    want = torch.stack([apply_activation(v.reshape(1), act)[0] for v in pre])
    assert torch.equal(y.isnan(), want.isnan()), (y, want)
    same = ~want.isnan()
    assert torch.allclose(y[same], want[same], rtol=1e-6, atol=0), (y, want)
    assert torch.equal(y[same].signbit(), want[same].signbit()), (y, want)


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
# TileConfig.validate: the failed constraint, and a real valid neighbour


@pytest.mark.parametrize(
    "cfg,arch,dtype,msg",
    [
        (TileConfig((256, 256, 64), stages=4, threads=256), "sm90", "float16", "the sm90 limit is 227 KB"),
        (TileConfig((128, 256, 64), stages=4, threads=256), "sm80", "float16", "the sm80 limit is 163 KB"),
        (TileConfig((128, 128, 64), threads=192), "sm90", "float16", "not a multiple of 128"),
        (TileConfig((96, 128, 64), threads=128), "sm90", "float16", "wgmma M (64)"),
        (TileConfig((128, 128, 40), threads=128), "sm90", "float16", "not a multiple of the MMA K (16"),
        (TileConfig((128, 128, 12), threads=128), "sm80", "float32", "MMA K (8"),
        (TileConfig((128, 100, 32), threads=128), "sm80", "float16", "bn=100"),
        (TileConfig((256, 256, 32), stages=1, threads=128, stage_c=False), "sm90", "float16", "registers"),
        (TileConfig((128, 128, 32), warp_tile=(64, 64), threads=256), "sm80", "float16", "gives 4 warps"),
        (TileConfig((128, 128, 32), warp_tile=(64, 64, 16)), "sm90", "float16", "possible: [(32, 128)]"),
        (TileConfig((128, 128, 32), warp_tile=(64, 64, 12)), "sm80", "float16", "whole MMA K steps (16"),
        (TileConfig((128, 128, 32), threads=128, stages=4), "sm80", "float32", "tf32 split tiles"),
        (TileConfig((128, 128, 16), threads=64, use_tensorcore=False), "sm90", "float32", "registers per thread"),
        (TileConfig((128, 100, 16), threads=256, use_tensorcore=False), "sm80", "float32", "4x8 lanes"),
        (TileConfig((128, 128, 6), threads=256, use_tensorcore=False), "sm80", "float16", "16-byte chunks"),
        (TileConfig((128, 128, 32)), "sm80", "float64", "GPU variants support"),
        (TileConfig((128, 128, 32)), "sm70", "float16", "unknown arch"),
    ],
)
def test_config_validate_rejects_with_a_valid_neighbour(cfg, arch, dtype, msg):
    with pytest.raises(UnsupportedError) as info:
        cfg.validate(arch, dtype)
    text = str(info.value)
    assert msg in text
    if "support" in msg or "arch" in msg:  # no tile change helps
        assert "Nearest valid" not in text
        return
    assert text.startswith(cfg.describe()), text
    # The suggestion is a constructor call of a config that validates, one or two fields away.
    near = eval(text.split("Nearest valid: ")[1], {"TileConfig": TileConfig})
    assert near.validate(arch, dtype) == near.with_stages(arch, dtype)
    fields = ("block_tile", "warp_tile", "stages", "threads", "stage_c")
    changed = [f for f in fields if getattr(near, f) != getattr(cfg, f)]
    assert 1 <= len(changed) <= 2, (cfg, near)
    assert near.use_tensorcore == cfg.use_tensorcore  # the kind of kernel asked for is kept


def test_config_warp_tile_three_dims_and_layouts():
    # The quick start config: (wm, wn, wk) accepted; 2x2 warps of 64x64 on the mma path
    qs = TileConfig(block_tile=(128, 128, 32), warp_tile=(64, 64, 16), use_tensorcore=True)
    assert qs.validate("sm90", "float32", precision="ieee").math("sm90", "float32") == "tf32x3"
    assert qs.validate("sm90", "float32", precision="tf32").math("sm90", "float32", "tf32") == "tf32"
    assert qs.warp_policy("sm90", "float32") == 0  # square: 2x2
    assert TileConfig((128, 128, 32), warp_tile=(32, 128)).warp_policy("sm80", "float16") == 1  # full row: 4x1
    assert TileConfig((128, 128, 32), warp_tile=(128, 32)).warp_policy("sm80", "float16") == 2  # full col: 1x4
    assert TileConfig.from_dict(qs.as_dict()) == qs and qs.as_dict()["warp_tile"] == [64, 64, 16]
    # SIMT: the warp tile and wk shape the per-lane tile and the fragment depth
    simt = TileConfig((128, 128, 16), warp_tile=(32, 64, 8), threads=256, use_tensorcore=False)
    assert simt.validate("sm80", "float32").simt_tiles("float32") == (32, 64, 8, 8, 8)
    assert TileConfig((128, 128, 16), threads=256, use_tensorcore=False).simt_tiles("float32") == (32, 64, 4, 8, 8)
    assert simt.math("sm90", "float32") == "simt" and simt.math("cpu", "float32") == "cpu"


@pytest.mark.parametrize("cfg,dtype", [
    (TileConfig((128, 128, 16), threads=256, use_tensorcore=False), "float32"),
    (TileConfig((64, 128, 32), threads=256, use_tensorcore=False), "float16"),
    (TileConfig((128, 64, 16), warp_tile=(64, 32), threads=128, use_tensorcore=False), "float32"),
    (TileConfig((32, 256, 16), threads=64, use_tensorcore=False), "bfloat16"),
])
def test_simt_owner_covers_the_block_tile_once(cfg, dtype):
    """The SIMT kernel's thread -> accumulator map (the same function the program indexes with) is a bijection
    onto the block tile, and a warp's lanes read 4 consecutive A rows and 8 consecutive B rows per fragment."""
    _, _, _, tm, tn = cfg.simt_tiles(dtype)
    owners = [cfg.simt_owner(dtype, t, i, j) for t in range(cfg.threads) for i in range(tm) for j in range(tn)]
    assert sorted(owners) == [(r, c) for r in range(cfg.bm) for c in range(cfg.bn)]
    for warp in range(cfg.threads // 32):
        rows = {cfg.simt_owner(dtype, warp * 32 + lane, 0, 0)[0] for lane in range(32)}
        cols = {cfg.simt_owner(dtype, warp * 32 + lane, 0, 0)[1] for lane in range(32)}
        assert len(rows) == 4 and max(rows) - min(rows) == 3 and len(cols) == 8 and max(cols) - min(cols) == 7


@pytest.mark.parametrize("fp32_full", ["tf32x3", "simt"])
def test_config_valid_defaults_and_roundtrip(fp32_full, monkeypatch):
    monkeypatch.setattr(config_module, "FP32_FULL", fp32_full)  # either choice of full-accuracy default is valid
    for arch in ("sm90", "sm80"):
        for dt in ("float16", "bfloat16", "float32"):
            for acc in (1, 2):
                for prec in ("ieee", "tf32"):
                    for m in (None, 1):
                        default_config(arch, dt, acc, m, precision=prec).validate(arch, dt, acc, prec)
                    for m, n in ((2048, 512), (4096, 768), (8192, 8192), (100, 100)):
                        default_config(arch, dt, acc, m, n, sms=132, precision=prec).validate(arch, dt, acc, prec)
    assert default_config("sm90", "float32").math("sm90", "float32") == fp32_full
    # The default tile shrinks until the grid covers the GPU's SMs (a small projection on an H200).
    assert default_config("sm90", "float16", 1, 8192, 8192, sms=132).block_tile == (128, 256, 64)
    assert default_config("sm90", "float16", 1, 4096, 768, sms=132).block_tile == (128, 128, 64)
    assert default_config("sm90", "float16", 1, 2048, 512, sms=132).block_tile == (64, 128, 64)
    # fp32: one tf32 product only when torch allows it
    assert default_config("sm90", "float32", precision="tf32").math("sm90", "float32", "tf32") == "tf32"
    c = TileConfig((128, 256, 64), warp_tile=(64, 64), stages=3, threads=256)
    assert TileConfig.from_dict(c.as_dict()) == c and hash(c) == hash(TileConfig.from_dict(c.as_dict()))
    with pytest.raises(ValueError, match="unknown fields"):
        TileConfig.from_dict({"tile": 1})
    # gated doubles B smem and accumulators
    big = TileConfig((128, 256, 64), stages=3, threads=256)
    big.validate("sm90", "float16")
    with pytest.raises(UnsupportedError):
        big.validate("sm90", "float16", accumulators=2)
    for arch in ("sm90", "sm80"):
        for prec in ("ieee", "tf32"):
            for c in FP32_TUNE_CANDIDATES[(arch, prec)]:
                TileConfig(**c).validate(arch, "float32", 1, prec)


def test_gemm_custom_rejects_before_compiling():
    with pytest.raises(UnsupportedError, match="limit"):
        gemm_program("sm90", 1024, 1024, "float16", TileConfig((256, 256, 128), stages=4, threads=256))


# (arch, dtype, precision, config, gated, b_transposed, device): one per math kind, arch and layout that
# changes what TileLang allocates; device "sm_90": the sm80 program as it is built to run on the H200.
SMEM_CASES = [
    pytest.param("sm90", "float16", "ieee", TileConfig((128, 128, 64), stages=3, threads=256), False, True, None,
                 id="sm90-mma-fp16"),
    pytest.param("sm90", "bfloat16", "ieee", TileConfig((64, 64, 16), stages=1), False, False, None,
                 id="sm90-mma-bf16-c-staging-largest"),
    pytest.param("sm90", "float32", "tf32", TileConfig((64, 128, 32), stages=4, stage_c=False), False, True, None,
                 id="sm90-tf32"),
    pytest.param("sm90", "float32", "ieee",
                 TileConfig(block_tile=(128, 128, 32), warp_tile=(64, 64, 16), use_tensorcore=True), False, False,
                 None, id="sm90-tf32x3-quick-start"),
    pytest.param("sm90", "bfloat16", "ieee", TileConfig((64, 128, 32), threads=256, use_tensorcore=False), True, True,
                 None, id="sm90-simt-bf16-gated"),
    pytest.param("sm80", "float16", "ieee", TileConfig((128, 64, 32), stages=3), True, False, None,
                 id="sm80-mma-fp16-gated"),
    pytest.param("sm90", "float16", "ieee", TileConfig((128, 128, 64), stages=4, threads=256, persistent=132), False,
                 True, None, id="sm90-persistent-c-staging-beside-the-loop"),
    pytest.param("sm80", "bfloat16", "ieee", TileConfig((128, 128, 32), threads=256, persistent=108), False, True,
                 None, id="sm80-persistent"),
    pytest.param("sm90", "float16", "ieee", TileConfig((128, 256, 64), threads=256, persistent=132), False, True,
                 None, id="sm90-persistent-stages-that-fit"),
    pytest.param("sm80", "float32", "tf32", TileConfig((128, 64, 32), threads=128), False, True, None,
                 id="sm80-tf32"),
    pytest.param("sm90", "float16", "ieee", TileConfig((128, 128, 64), stages=4, threads=256, overlap=True), False,
                 True, None, id="sm90-overlap-c-staging-beside-the-loop"),
    pytest.param("sm90", "bfloat16", "ieee", TileConfig((128, 128, 64), threads=256, overlap=True, persistent=132),
                 True, False, None, id="sm90-overlap-persistent-gated-stages-that-fit"),
    pytest.param("sm90", "float16", "ieee", TileConfig((128, 192, 64), warp_tile=(32, 192), threads=256, overlap=True,
                                                      persistent=132, pingpong=True), False, True, None,
                 id="sm90-pingpong-a-staged-tile-per-warpgroup-stages-that-fit"),
    pytest.param("sm80", "float32", "ieee", TileConfig((128, 128, 16), threads=256, use_tensorcore=False), False,
                 True, None, id="sm80-simt-fp32"),
    # sm80's tf32x3 keeps one copy of the split tiles (lowering it takes TileLang about a minute)
    pytest.param("sm80", "float32", "ieee", TileConfig((64, 64, 16), stages=2), False, False, "sm_90",
                 id="sm80-on-h200-tf32x3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch,dtype,precision,cfg,gated,bt,device", SMEM_CASES)
def test_smem_estimate_is_what_the_lowered_kernel_allocates(arch, dtype, precision, cfg, gated, bt, device):
    """TileConfig.smem_bytes, which validate checks against the arch's limit, equals the dynamic shared memory
    of the lowered kernel (the launch asks for exactly that: 294912 bytes failed on the H200 when the estimate
    said 224 KB); an unset `stages` is the most that fit. (test_nvcc_compiles checks the static part.)"""
    acc = 2 if gated else 1
    staged = cfg.validate(arch, dtype, acc, precision)
    dynamic = lowered_smem(gemm_program(arch, 256, 256, dtype, cfg, b_transposed=bt, gated=gated,
                                        precision=precision), arch, device, program_pass_configs(cfg))
    assert staged.smem_bytes(arch, dtype, acc, precision) == dynamic
    if cfg.stages is None:
        deeper = replace(staged, stages=staged.stages + 1)
        assert staged.stages == config_module.MAX_STAGES or deeper.problem(arch, dtype, acc, precision), deeper


def test_a_config_as_a_tuning_candidate_keeps_every_field():
    """The default config enters tuning as a candidate dict (_candidate): a field it dropped would make the
    default a different kernel from the one planned and cached (a new TileConfig field must not need a list)."""
    cfg = TileConfig((128, 192, 64), warp_tile=(16, 192), stages=3, threads=256, use_tensorcore=True, swizzle=4,
                     stage_c=False, persistent=132, overlap=True, pingpong=True)
    assert all(getattr(cfg, f.name) != getattr(TileConfig(), f.name) for f in fields(TileConfig)
               if f.name not in ("block_tile", "use_tensorcore"))
    assert TileConfig(**_candidate(cfg)) == cfg


def test_unset_stages_get_the_most_that_fit_and_pinned_ones_are_checked():
    qs = TileConfig(block_tile=(128, 128, 32), warp_tile=(64, 64, 16), use_tensorcore=True)  # README quick start
    assert qs.validate("sm90", "float32").stages == 2  # 3 stages of A, B and their tf32 splits: 288 KB
    assert qs.validate("sm90", "float32", precision="tf32").stages == 4
    with pytest.raises(UnsupportedError, match=r"needs 289 KB .*227 KB. Nearest valid: .*stages=2"):
        replace(qs, stages=3).validate("sm90", "float32")
    assert qs.describe() == "TileConfig(block_tile=(128, 128, 32), warp_tile=(64, 64, 16))"
    assert kernel_key("sm90", 64, 64, "float32", qs) == kernel_key("sm90", 64, 64, "float32", replace(qs, stages=2))
    huge = TileConfig((256, 128, 256), threads=256)  # no stage count fits: said at one stage
    with pytest.raises(UnsupportedError, match=r"needs 193 KB of shared memory \(1 stage\(s\)\); the sm80 limit"):
        huge.validate("sm80", "float16")


# ------------------------------------------------------------------------------------------------
# fp32 precision: torch's switch, the keys it enters, and the tf32 split


@pytest.fixture
def restore_precision():
    """Put torch's fp32 matmul precision back through both its APIs (restoring only the new one would leave
    torch.get_float32_matmul_precision() raising about mixed legacy and new settings)."""
    legacy, generic = torch.get_float32_matmul_precision(), torch.backends.fp32_precision
    yield
    torch.backends.fp32_precision = generic
    torch.set_float32_matmul_precision(legacy)
    assert torch.get_float32_matmul_precision() == legacy


@pytest.mark.parametrize("setting,expected", [
    (lambda: None, "ieee"),  # torch's default, "highest"
    (lambda: torch.set_float32_matmul_precision("high"), "tf32"),
    (lambda: torch.set_float32_matmul_precision("medium"), "tf32"),
    (lambda: torch.set_float32_matmul_precision("highest"), "ieee"),
    (lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True), "tf32"),
    (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), "tf32"),
    (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"), "ieee"),
])
def test_matmul_precision_follows_torch(setting, expected, restore_precision):
    torch.backends.cuda.matmul.fp32_precision = "none"
    setting()
    assert matmul_precision() == expected
    # what cuBLAS reads for A @ B (Context::float32Precision(CUDA, MATMUL) == TF32)
    assert (torch.backends.cuda.matmul.fp32_precision == "tf32") == (expected == "tf32")


def test_precision_in_compile_and_tuning_keys(restore_precision):
    cfg = TileConfig((128, 128, 32), stages=2, threads=256)
    simt = TileConfig((128, 128, 16), threads=256, use_tensorcore=False)
    # fp32 on tensor cores: one kernel per precision; SIMT, 16-bit and cpu ignore it (one kernel)
    assert kernel_key("sm90", 64, 64, torch.float32, cfg, precision="tf32")[11] == "tf32"
    assert kernel_key("sm90", 64, 64, torch.float32, cfg, precision="ieee")[11] == "ieee"
    assert kernel_key("sm90", 64, 64, torch.float32, simt, precision="tf32")[11] == "ieee"
    assert kernel_key("sm90", 64, 64, torch.float16, default_config("sm90", "float16"), precision="tf32")[11] == "ieee"
    assert fp32_precision("cpu", torch.float32) == "ieee"
    torch.set_float32_matmul_precision("high")
    assert fp32_precision("sm90", torch.float32) == "tf32" and fp32_precision("sm90", torch.float16) == "ieee"


def test_tuned_winners_are_kept_per_precision(tmp_path, monkeypatch):
    """The on-disk tuning key carries the precision (a tf32 winner never serves "highest"), and a SIMT winner
    comes back from the cache as a SIMT config."""
    from tkopt.kernels import tuning

    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")  # cached winners only: nothing is timed here
    tuning.clear_memory_cache()
    _SELECTED.clear()
    args = ("gemm", "sm90", 512, 768, 1024, torch.float32, "gelu", True, False, True, None)
    simt = FP32_TUNE_CANDIDATES[("sm90", "ieee")][0]
    assert simt.get("use_tensorcore") is False
    key = (tuning.shape_bucket(512), 768, 1024, "torch.float32", "gelu", True, False, True, "ieee")
    tuning.store_json(tuning._file("gemm", "sm90"), tuning._key_str(key), {"config": tuning._norm(simt), "ms": 1.0})
    try:
        assert select_config(*args, precision="ieee") == TileConfig(**simt)
        assert select_config(*args, precision="tf32") == default_config("sm90", "float32", 1, 512, 768,
                                                                        precision="tf32")
    finally:
        tuning.clear_memory_cache()
        _SELECTED.clear()


def _tf32x3_on_cpu(x, y):
    """The kernel's own tf32 helpers compiled with TileLang's C backend: x's (hi, lo) split, and the tf32x3
    product of x and y element by element (_tf32x3_sum of hi*hi and the two low-part products)."""
    import tilelang
    import tilelang.language as T
    from tilelang.cpu.language import Kernel

    n = x.numel()
    f32 = "float32"

    @T.prim_func
    def prog(X: T.Tensor((n,), f32), Y: T.Tensor((n,), f32), H: T.Tensor((n,), f32), L: T.Tensor((n,), f32),
             P: T.Tensor((n,), f32)):
        with Kernel(1) as _:
            for i in T.serial(n):
                xh, xl = _tf32_split(X[i])
                yh, yl = _tf32_split(Y[i])
                H[i] = xh
                L[i] = xl
                P[i] = _tf32x3_sum(xh * yh, xl * yh + xh * yl)

    kern = tilelang.compile(prog, target="c", target_host="c", execution_backend="cython")
    hi, lo, prod = (torch.empty_like(x) for _ in range(3))
    kern(x.contiguous(), y.contiguous(), hi, lo, prod)
    return hi, lo, prod


def test_tf32_split_keeps_fp32_accuracy_and_inf_nan():
    torch.manual_seed(5)
    big = torch.finfo(torch.float32).max
    normal = torch.randn(4000) * torch.logspace(-30, 30, 4000)
    inf, nan = float("inf"), float("nan")
    # pairs: finite, +-max (rounding must not overflow), inf * finite / 0 / inf, NaN, overflowing products
    # (the low parts' products overflow with the opposite sign at 3e25 * -3e25)
    xs = torch.cat([normal, torch.tensor([big, -big, inf, inf, inf, -inf, 2.5, nan, 1e20, 3e25, 7.0, 0.0])])
    ys = torch.cat([torch.randn(4000), torch.tensor([0.5, 0.5, 1.0, 0.0, -inf, 2.5, -inf, 1.0, 1e20, -3e25, inf,
                                                     inf])])
    x, y = xs.float(), ys.float()
    hi, lo, prod = _tf32x3_on_cpu(x, y)
    n = normal.numel()
    assert not (hi.view(torch.int32) & 0x1FFF).any()  # the tensor cores see whole tf32 numbers
    assert not (lo[:n].view(torch.int32) & 0x1FFF).any()
    err = (x[:n].double() - hi[:n].double() - lo[:n].double()).abs() / x[:n].double().abs()
    assert err.max() <= 2.0**-22, err.max()
    assert torch.isfinite(hi[n:n + 2]).all()
    eager = x * y
    assert torch.equal(prod.isnan(), eager.isnan()), (prod[n:], eager[n:])
    assert torch.equal(prod[eager.isinf()], eager[eager.isinf()])
    rel = ((prod[:n].double() - x[:n].double() * y[:n].double()).abs() / (x[:n].double() * y[:n].double()).abs())
    assert rel.max() <= 2.0**-20, rel.max()

    # K=1024: the split adds far less error than fp32 accumulation (so tf32x3 is as accurate as A @ B), one
    # tf32 product alone is ~1000x worse
    A, B = torch.randn(64, 1024), torch.randn(1024, 64)
    (Ah, Al, _), (Bh, Bl, _) = (tuple(p.view(t.shape) for p in _tf32x3_on_cpu(t.flatten(), t.flatten()))
                                for t in (A, B))
    ref = A.double() @ B.double()
    rel = lambda c: ((c - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    split3 = rel(Al.double() @ Bh.double() + Ah.double() @ Bl.double() + Ah.double() @ Bh.double())
    assert split3 < 0.5 * rel((A @ B).double()) and rel(Ah.double() @ Bh.double()) > 100 * split3


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
    "sm90-persistent-gelu-residual": ("sm90", dict(N=3072, K=768, dtype="float16",
                                                   config=TileConfig((128, 256, 64), threads=256, persistent=132),
                                                   b_transposed=True, has_bias=True, act="gelu", has_residual=True)),
    "sm80-persistent-gated-bf16": ("sm80", dict(N=4096, K=2048, dtype="bfloat16",
                                                config=TileConfig((128, 128, 32), threads=256, persistent=108),
                                                b_transposed=True, has_bias=False, act="silu", gated=True)),
    "sm90-overlap-gelu-residual": ("sm90", dict(N=768, K=3072, dtype="float16",
                                                config=TileConfig((128, 128, 64), stages=4, threads=256,
                                                                  warp_tile=(16, 128), overlap=True),
                                                b_transposed=True, has_bias=True, act="gelu", has_residual=True)),
    "sm90-overlap-persistent-gated-bf16": ("sm90", dict(N=4096, K=2048, dtype="bfloat16",
                                                        config=TileConfig((128, 128, 64), threads=256, overlap=True,
                                                                          persistent=132),
                                                        b_transposed=False, has_bias=True, act="silu", gated=True)),
    "sm90-overlap-persistent-wide": ("sm90", dict(N=2304, K=768, dtype="float16",
                                                  config=TileConfig((128, 256, 64), stages=3, threads=256,
                                                                    warp_tile=(16, 256), overlap=True, persistent=132),
                                                  b_transposed=True, has_bias=True)),
    "sm90-overlap-persistent-192-gelu": ("sm90", dict(N=3072, K=768, dtype="float16",
                                                      config=TileConfig((128, 192, 64), stages=4, threads=256,
                                                                        warp_tile=(16, 192), overlap=True,
                                                                        persistent=132),
                                                      b_transposed=True, has_bias=True, act="gelu")),
    "sm90-overlap-small-tile": ("sm90", dict(N=3072, K=768, dtype="float16",
                                             config=TileConfig((64, 64, 64), stages=4, threads=128,
                                                               warp_tile=(16, 64), overlap=True),
                                             b_transposed=True, has_bias=True, act="gelu")),
    "sm90-pingpong-gelu-residual": ("sm90", dict(N=3072, K=768, dtype="float16",
                                                 config=TileConfig((128, 128, 64), warp_tile=(32, 128), stages=4,
                                                                   threads=256, overlap=True, persistent=132,
                                                                   pingpong=True),
                                                 b_transposed=True, has_bias=True, act="gelu", has_residual=True)),
    "sm90-pingpong-192-gelu": ("sm90", dict(N=3072, K=768, dtype="float16",
                                            config=TileConfig((128, 192, 64), warp_tile=(32, 192), stages=3,
                                                              threads=256, overlap=True, persistent=132,
                                                              pingpong=True),
                                            b_transposed=True, has_bias=True, act="gelu")),
    "sm90-pingpong-64x256-bf16": ("sm90", dict(N=2048, K=2048, dtype="bfloat16",
                                               config=TileConfig((64, 256, 64), warp_tile=(16, 256), stages=3,
                                                                 threads=256, overlap=True, persistent=132,
                                                                 pingpong=True),
                                               b_transposed=False, has_bias=False, act=None)),
    "sm80-bf16-bias-gelu": ("sm80", dict(N=3072, K=768, dtype="bfloat16", config=default_config("sm80", "bfloat16"),
                                         b_transposed=True, has_bias=True, act="gelu")),
    "sm80-gated-gelu-fp32": ("sm80", dict(N=512, K=256, dtype="float32", precision="tf32",
                                          config=default_config("sm80", "float32", accumulators=2, precision="tf32"),
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
    src = lower_cuda(gemm_program(arch, N, K, dtype, cfg, **kw), arch, program_pass_configs(cfg))
    if arch == "sm90":
        assert "wgmma" in src, "sm90 program did not lower to wgmma"
        assert "tma_load" in src, "sm90 program did not lower to TMA loads"
    else:
        assert "mma" in src and "cp_async" in src, "sm80 program did not lower to mma + cp.async"
    build = cuda_compile(src, arch)
    assert os.path.getsize(build.cubin) > 0
    assert build.registers and max(build.registers) <= 255
    assert not any(build.spills), f"register spills: {build.spills}"
    assert max(build.static_smem, default=0) <= config_module.STATIC_SMEM  # what validate keeps free
    nvcc_builds[name] = build


FP32_LOWER_CASES = {
    # name: (arch, dtype, config, program flags, expected math)
    "sm90-tf32x3-linear-gelu": ("sm90", "float32", TileConfig((128, 128, 32), stages=2, threads=256),
                                dict(b_transposed=True, has_bias=True, act="gelu"), "tf32x3"),
    "sm90-simt-fp32-residual": ("sm90", "float32", TileConfig((128, 128, 16), threads=256, use_tensorcore=False),
                                dict(b_transposed=False, has_bias=True, act="silu", has_residual=True), "simt"),
    "sm80-simt-bf16-gated": ("sm80", "bfloat16", TileConfig((64, 128, 32), threads=256, use_tensorcore=False),
                             dict(b_transposed=True, has_bias=True, act="gelu_tanh", gated=True), "simt"),
}
_TF32_MMA = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"


@pytest.mark.parametrize("name", list(FP32_LOWER_CASES))
def test_full_precision_programs_use_their_instructions(name):
    """tf32x3: three tf32 mma per K step where the tf32 program has one, on operands masked to tf32 (PTX
    and.b32 with 0xFFFFE000); SIMT: fp32 FMA (fma.rn.f32) from 16-byte shared-memory fragment loads, no mma."""
    arch, dtype, cfg, flags, math_kind = FP32_LOWER_CASES[name]
    assert cfg.math(arch, dtype, "ieee") == math_kind
    src = lower_cuda(gemm_program(arch, 520, 264, dtype, cfg, **flags), arch)
    build = cuda_compile(src, arch, ptx=True)
    assert build.registers and max(build.registers) <= 255 and not any(build.spills), build.spills
    ptx = build.ptx
    if math_kind == "tf32x3":
        one = lower_cuda(gemm_program(arch, 520, 264, dtype, cfg, precision="tf32", **flags), arch)
        assert src.count("mma_sync<tl::DataType::kTensorFloat32") == 3 * one.count(
            "mma_sync<tl::DataType::kTensorFloat32") > 0
        assert _TF32_MMA in ptx and "-8192;" in ptx  # the split's tf32 mask
    else:
        assert ptx.count("fma.rn.f32") >= 64 and "mma" not in ptx
        assert "ld.shared.v4" in ptx or "ld.shared.v2" in ptx  # vector fragment loads along K


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
    return 1e-2 if dtype != torch.float32 else 1e-5  # fp32: full accuracy at torch's default precision


GEMM_GPU_CASES = [
    (333, 520, 264, True, "gelu_tanh", True, True),
    (1, 1000, 1024, True, "silu", True, False),  # decode
    (257, 130, 100, False, "relu", False, True),  # K, N not 16-byte multiples in fp16: padded path
]
GATED_GPU_CASES = [("silu", True, True), ("gelu_tanh", False, False)]
GATED_MNK = (300, 384, 256)
# CUDA-core kernels (use_tensorcore=False): (dtype, M, N, K, b_transposed, act, bias, residual, gated, config)
SIMT_GPU_CASES = [
    (torch.float32, 333, 520, 264, True, "gelu_tanh", True, True, False,
     TileConfig((128, 128, 16), threads=256, use_tensorcore=False)),
    (torch.float16, 257, 130, 100, False, "relu", False, True, False,
     TileConfig((64, 128, 32), threads=128, use_tensorcore=False)),
    (torch.bfloat16, 300, 384, 256, True, "silu", True, False, True,
     TileConfig((64, 128, 32), threads=256, use_tensorcore=False)),
]
# Persistent kernels (TileConfig.persistent resident blocks walking the tiles), same fields as SIMT_GPU_CASES: fewer
# blocks than tiles (several tiles a block, column tiles not a multiple of the panel), more blocks than tiles (some
# blocks get none), ragged M, N and K, gated, and fp32's three-product split.
PERSISTENT_GPU_CASES = [
    (torch.float16, 1000, 520, 264, True, "gelu", True, True, False,
     TileConfig((128, 256, 64), threads=256, persistent=7)),
    (torch.bfloat16, 4100, 768, 512, False, None, False, True, False,
     TileConfig((128, 128, 64), threads=256, persistent=132)),
    (torch.float16, 1, 1000, 1024, True, "silu", True, False, False,
     TileConfig((64, 128, 64), threads=128, persistent=132)),
    (torch.float16, 300, 384, 256, True, "silu", True, False, True,
     TileConfig((128, 128, 64), threads=256, persistent=5)),
    (torch.float32, 333, 520, 264, True, "gelu_tanh", True, True, False,
     TileConfig((128, 128, 32), threads=256, persistent=3)),
]
OVERLAP_GPU_CASES = [  # ragged M, N and K; one consumer warpgroup and two; more blocks than tiles and fewer
    (torch.float16, 1000, 520, 264, True, "gelu", True, True, False,
     TileConfig((128, 128, 64), stages=4, threads=256, warp_tile=(16, 128), overlap=True)),
    (torch.bfloat16, 4100, 768, 512, False, None, False, True, False,
     TileConfig((128, 256, 64), stages=3, threads=256, warp_tile=(16, 256), overlap=True, persistent=132)),
    (torch.float16, 300, 384, 256, False, "silu", True, False, True,
     TileConfig((128, 128, 64), threads=256, overlap=True, persistent=5)),
    (torch.float16, 1, 1000, 1024, True, None, True, False, False,
     TileConfig((64, 128, 64), threads=128, overlap=True)),
    (torch.float16, 2048, 2304, 768, True, "gelu_tanh", True, False, False,
     TileConfig((128, 192, 64), stages=4, threads=256, warp_tile=(16, 192), overlap=True, persistent=132,
                stage_c=False)),
    (torch.float16, 200, 3000, 768, True, "gelu", True, False, False,
     TileConfig((64, 64, 64), stages=4, threads=128, warp_tile=(16, 64), overlap=True)),
    # pingpong: 13 or 14 tiles a block (each warpgroup's count odd and even); 132 blocks on 324 tiles; more blocks
    # than tiles (a block of one tile: warpgroup 1 takes none); the output stored from registers
    (torch.float16, 1000, 520, 264, True, "gelu", True, True, False,
     TileConfig((128, 128, 64), stages=4, threads=256, warp_tile=(32, 128), overlap=True, persistent=3,
                pingpong=True)),
    (torch.bfloat16, 4100, 2304, 768, False, None, True, False, False,
     TileConfig((128, 192, 64), stages=3, threads=256, warp_tile=(32, 192), overlap=True, persistent=132,
                pingpong=True)),
    (torch.float16, 300, 1000, 512, True, "silu", False, True, False,
     TileConfig((64, 256, 64), stages=3, threads=256, warp_tile=(16, 256), overlap=True, persistent=200,
                pingpong=True)),
    (torch.float16, 700, 384, 200, True, None, True, False, False,
     TileConfig((128, 128, 64), stages=4, threads=256, warp_tile=(32, 128), overlap=True, persistent=4,
                pingpong=True, stage_c=False)),
]
FP32_ACCURACY_CONFIGS = {  # fp32 kernels at "highest", measured against cuBLAS at M=N=K=1024
    "tf32x3": lambda arch: TileConfig((128, 128, 32), threads=256),  # stages: the most that fit on the arch
    "simt": lambda arch: TileConfig((128, 128, 16), threads=256, use_tensorcore=False),
}


def _gemm_key(arch, dtype, M, N, K, bt, act, hb, hr, gated, config=None, precision="ieee"):
    from tkopt.kernels.gemm_epilogue import _sm_count, padded_nk

    Np, Kp = padded_nk(arch, N, K, torch.empty((), dtype=dtype).element_size())
    if config is None:
        config = default_config(arch, dtype, 2 if gated else 1, M, N, sms=_sm_count(arch),
                                precision=precision if dtype == torch.float32 else "ieee")
    return (arch, Np, Kp, dtype, config, bt, hb, act, hr, gated, None, precision)


@pytest.fixture(scope="module")
def gpu_precompiled():
    """Compile every GPU test kernel in parallel worker interpreters first (TileLang disk cache); tests load."""
    from tkopt.kernels.gemm_epilogue import precompile

    keys = []
    for arch in GPU_ARCHS:
        if not _gpu_arch_ok(arch):
            continue
        for dt in GPU_DTYPES:
            for M, N, K, bt, act, hb, hr in GEMM_GPU_CASES:
                keys.append(_gemm_key(arch, dt, M, N, K, bt, act, hb, hr, False))
            M, N, K = GATED_MNK
            for act, hb, wt in GATED_GPU_CASES:
                keys.append(_gemm_key(arch, dt, M, N, K, wt, act, hb, False, True))
        for dt, M, N, K, bt, act, hb, hr, gated, cfg in SIMT_GPU_CASES + PERSISTENT_GPU_CASES + OVERLAP_GPU_CASES:
            if cfg.problem(arch, str(dt)[6:], 2 if gated else 1) is not None:
                continue
            keys.append(_gemm_key(arch, dt, M, N, K, bt, act, hb, hr, gated, cfg))
        keys.append(_gemm_key(arch, torch.float32, *GEMM_GPU_CASES[0], False, precision="tf32"))
        for make in FP32_ACCURACY_CONFIGS.values():
            keys.append(_gemm_key(arch, torch.float32, 1024, 1024, 1024, False, None, False, False, False, make(arch)))
    # pytest-xdist runs this fixture once per worker: the first compiles everything (in parallel worker
    # interpreters), the others wait on the lock and then load from TileLang's disk cache.
    tag = hashlib.sha1(repr((keys, os.environ.get("TILELANG_CACHE_DIR"))).encode()).hexdigest()[:12]
    with open(os.path.join(tempfile.gettempdir(), f"tkopt-gemm-gpu-precompile-{tag}"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        if lock.read() == "done":
            return {}
        res = precompile(keys)
        lock.write("done")
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
    ref = gemm_ref(a.double(), b.double(), None if bias is None else bias.double(), act,
                   None if res is None else res.double(), b_transposed=bt)
    _close(out.double(), ref, _tol(dtype))


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
    f = lambda t: None if t is None else t.double()  # noqa: E731
    _close(out.double(), gated_mlp_ref(x.double(), wg.double(), wu.double(), act, f(bg), f(bu), wt), _tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("case", SIMT_GPU_CASES, ids=lambda c: f"{str(c[0])[6:]}-{c[1]}x{c[2]}x{c[3]}")
def test_simt_gpu(arch, case, gpu_precompiled):
    """use_tensorcore=False: the CUDA-core kernel on odd shapes (M, N, K not multiples of the tile), every
    output element written (NaN-poisoned out), for each dtype, plain and gated."""
    _check_custom_config(arch, case)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("case", PERSISTENT_GPU_CASES,
                         ids=lambda c: f"{str(c[0])[6:]}-{c[1]}x{c[2]}x{c[3]}-{c[9].persistent}blocks")
def test_persistent_gpu(arch, case, gpu_precompiled):
    """Persistent kernels: every output tile written exactly by its own block's walk (NaN-poisoned out), whether
    a block gets several tiles, one or none."""
    _check_custom_config(arch, case)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("case", OVERLAP_GPU_CASES,
                         ids=lambda c: f"{str(c[0])[6:]}-{c[1]}x{c[2]}x{c[3]}-{c[9].persistent}blocks")
def test_overlap_gpu(arch, case, gpu_precompiled):
    """The hand-written sm90 pipeline (TileConfig.overlap), its stages given back a K step late, against float64:
    every output element written (NaN-poisoned out), through a persistent walk whose stages and phases carry on
    across tiles. Not an sm80 kernel: validate refuses it there, with the reason."""
    if arch == "sm80":
        with pytest.raises(UnsupportedError, match="overlap is the sm90 wgmma pipeline"):
            case[9].validate(arch, case[0], 2 if case[8] else 1)
        return
    _check_custom_config(arch, case)


def test_overlap_is_refused_where_it_does_not_apply():
    """Each refusal names its reason: not sm90, not 16-bit, or more consumer warpgroups than its register split
    (producer 24, consumers 240 per thread) fits."""
    cfg = TileConfig((128, 128, 64), threads=256, overlap=True)
    for arch, dtype, threads, reason in (("sm80", "float16", 256, "sm90 wgmma pipeline"),
                                         ("sm90", "float32", 256, "16-bit inputs only"),
                                         ("sm90", "float16", 384, "threads must be 128 or 256")):
        with pytest.raises(UnsupportedError, match=reason):
            replace(cfg, threads=threads).validate(arch, dtype)
    assert cfg.validate("sm90", "bfloat16").overlap


def test_pingpong_is_refused_where_it_does_not_apply():
    """A pingpong kernel alternates a persistent block's tiles between two consumer warpgroups, each holding a
    whole tile: each missing prerequisite and a tile too big for one warpgroup's registers is refused by name."""
    cfg = TileConfig((128, 128, 64), warp_tile=(32, 128), threads=256, overlap=True, persistent=132, pingpong=True)
    for change, acc, reason in ((dict(overlap=False), 1, "it needs overlap, persistent and threads=256"),
                                (dict(persistent=0), 1, "it needs overlap, persistent and threads=256"),
                                (dict(threads=128), 1, "it needs overlap, persistent and threads=256"),
                                (dict(block_tile=(128, 256, 64), warp_tile=(32, 256)), 1, "256 registers per thread"),
                                ({}, 2, "2 x 128x128 fp32 accumulators")):
        with pytest.raises(UnsupportedError, match=reason):
            replace(cfg, **change).validate("sm90", "float16", accumulators=acc)
    assert cfg.validate("sm90", "float16").pingpong
    with pytest.raises(UnsupportedError, match="a tile's 128 threads are 4 warps"):  # one warpgroup's layout
        replace(cfg, warp_tile=(16, 128)).validate("sm90", "float16")


def test_pingpong_kernel_orders_the_warpgroups_loops_and_stages_each_tile_apart():
    """The pingpong kernel in its lowered source: each consumer warpgroup waits for the other's K loop of the tile
    before (`done`) and releases its own after its loop; each stages its output tile in its own half of the
    shared buffer (TileLang laid two separate buffers over each other) and syncs only its own 128 threads."""
    cfg = TileConfig((128, 128, 64), stages=4, threads=256, warp_tile=(32, 128), overlap=True, persistent=132,
                     pingpong=True)
    src = lower_cuda(gemm_program("sm90", 3072, 768, "float16", cfg, b_transposed=True, has_bias=True), "sm90",
                     program_pass_configs(cfg))
    assert "done[1].wait((((tiles[0] >> 1) + 1) & 1))" in src and "done[0].wait(((tiles[0] & 3) >> 1))" in src
    assert src.index("done[0].arrive()") < src.index("done[1].arrive()")
    assert "__sync_thread_partial(3, 128)" in src and "__sync_thread_partial(4, 128)" in src
    stores = [line for line in src.splitlines() if "tma_store(C_desc" in line]
    assert len(stores) == 2 and "(i_4 * 8192)])" in stores[0] and "+ 16384)])" in stores[1], stores
    assert src.count("__syncthreads()") == 1


def test_overlap_kernel_leaves_one_wgmma_group_in_flight_and_no_block_wide_sync():
    """What makes the overlap kernel what it is, in its lowered source: each K step waits for all but its own
    wgmma group (two when gated) and gives back the stage before, and nothing syncs the whole block after the
    barriers' set-up (a __syncthreads between producer and consumers would deadlock once K has more steps
    than stages). Lowered without its pass configs, TileLang puts that sync in."""
    cfg = TileConfig((128, 128, 64), stages=4, threads=256, warp_tile=(16, 128), overlap=True)
    for gated, waits in ((False, "warpgroup_wait<1>"), (True, "warpgroup_wait<2>")):
        src = lower_cuda(gemm_program("sm90", 768, 3072, "float16", cfg, b_transposed=True, gated=gated), "sm90",
                         program_pass_configs(cfg))
        assert waits in src and "warpgroup_wait<0>" in src
        assert src.count("__syncthreads()") == 1 and "empty[((step[0] + 3) & 3)].arrive()" in src
    plain = lower_cuda(gemm_program("sm90", 768, 3072, "float16", cfg, b_transposed=True), "sm90")
    assert plain.count("__syncthreads()") > 1


def _check_custom_config(arch, case):
    """One (dtype, M, N, K, b_transposed, act, bias, residual, gated, config) case against float64."""
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    dtype, M, N, K, bt, act, hb, hr, gated, cfg = case
    torch.manual_seed(11)
    dev = "cuda"
    w = lambda: torch.randn(*((N, K) if bt else (K, N)), device=dev, dtype=dtype) / K**0.5  # noqa: E731
    a = torch.randn(M, K, device=dev, dtype=dtype)
    b, b2 = w(), w()
    bias, bias2 = (torch.randn(N, device=dev, dtype=dtype) for _ in range(2))
    out = torch.full((M, N), float("nan"), device=dev, dtype=dtype)
    d = lambda t: t.double()  # noqa: E731
    if gated:
        gated_mlp(a, b, b2, act, bias if hb else None, bias2 if hb else None, weights_transposed=bt, out=out,
                  arch=arch, config=cfg)
        ref = gated_mlp_ref(d(a), d(b), d(b2), act, d(bias) if hb else None, d(bias2) if hb else None, bt)
    else:
        res = torch.randn(M, N, device=dev, dtype=dtype) if hr else None
        gemm_custom(a, b, cfg, bias if hb else None, act, res, bt, out=out, arch=arch)
        ref = gemm_ref(d(a), d(b), d(bias) if hb else None, act, None if res is None else d(res), b_transposed=bt)
    torch.cuda.synchronize()
    _close(out.double(), ref, _tol(dtype) if dtype != torch.float32 else 2e-6)


@pytest.fixture
def tf32_allowed(restore_precision):
    torch.set_float32_matmul_precision("high")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("kind", list(FP32_ACCURACY_CONFIGS))
def test_fp32_at_highest_precision_against_cublas(arch, kind, gpu_precompiled):
    """At torch's default precision ("highest") against float64: the SIMT kernel (the default, FP32_FULL) is
    as accurate as A @ B (within 2x of cuBLAS's error, and close to A @ B); tf32x3, which a tensor-core config
    gets, is near fp32 (within 3x of cuBLAS: 2.2x measured on the H200) and far from one TF32 product."""
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    assert matmul_precision() == "ieee"
    torch.manual_seed(3)
    A, B = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    ref = A.double() @ B.double()
    err = lambda c: (c.double() - ref).abs().max().item()  # noqa: E731
    C = gemm_custom(A, B, FP32_ACCURACY_CONFIGS[kind](arch), arch=arch)
    ours, cublas = err(C), err(A @ B)
    if kind == "simt":
        assert FP32_FULL == "simt"
        assert ours <= 2 * cublas + 1e-6, (ours, cublas)
        assert torch.allclose(C, A @ B, atol=1e-4)
    else:
        assert ours <= 3 * cublas, (ours, cublas)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_fp32_tf32_when_torch_allows(arch, tf32_allowed, monkeypatch, gpu_precompiled):
    """After torch.set_float32_matmul_precision("high") gemm may use one tf32 product, like A @ B: its error is
    TF32's, not fp32's."""
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    M, N, K, bt, act, hb, hr = GEMM_GPU_CASES[0]
    torch.manual_seed(1)
    a, b = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda") / K**0.5
    bias, res = torch.randn(N, device="cuda"), torch.randn(M, N, device="cuda")
    y = gemm(a, b, bias, act, res, b_transposed=bt, arch=arch)
    ref = gemm_ref(a.double(), b.double(), bias.double(), act, res.double(), b_transposed=bt)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert 1e-5 < rel < 5e-3, rel  # tf32-sized: the tf32 kernel ran, and correctly


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_epilogue_gpu(arch, dtype, monkeypatch):
    """The GPU kernels' GELU epilogue over its whole range: within half a unit of the output dtype of exact GELU."""
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    a, b, x = gelu_pre_activations("cuda")
    y = gemm(a.to(dtype), b.to(dtype), act="gelu", b_transposed=True, arch=arch)
    x16 = x.to(dtype).double()  # the pre-activation as the kernel sees it
    check_gelu(y.cpu(), x16, rel=torch.finfo(dtype).eps, abs_=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [*GPU_ARCHS, "cublaslt"])
def test_relu_epilogue_keeps_nan_gpu(arch, monkeypatch):
    """A NaN pre-activation stays NaN through the ReLU epilogue, as torch.relu keeps it: TileLang's kernels (CUDA's
    fmaxf(NaN, 0) is 0) and cuBLASLt's bias + ReLU epilogue, which `gemm` runs for bias + relu."""
    if not _gpu_arch_ok("sm90" if arch == "cublaslt" else arch):
        pytest.skip(f"no {arch} GPU")
    from tkopt.kernels.gemm_epilogue import _library_gemm

    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    a = torch.randn(64, 32, device="cuda", dtype=torch.float16)
    a[3, 5], a[7, 0] = float("nan"), float("inf")
    b = torch.randn(48, 32, device="cuda", dtype=torch.float16)
    bias = torch.randn(48, device="cuda", dtype=torch.float16)
    want = torch.relu(torch.nn.functional.linear(a.float(), b.float(), bias.float()))
    if arch == "cublaslt":
        y = _library_gemm(a, b, bias, "relu", True, None)
    else:
        y = gemm(a, b, bias, act="relu", b_transposed=True, arch=arch)
    assert torch.equal(y.isnan(), want.isnan()) and want.isnan().any(), (y.isnan().sum(), want.isnan().sum())


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_fp32_inf_nan_propagate_like_eager(arch, monkeypatch, gpu_precompiled):
    """inf and NaN inputs give eager's inf/NaN pattern in both full-accuracy kernels (tf32x3: _tf32_low)."""
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    A, B = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    A[3, 5], A[7, 0], A[9, 9] = float("inf"), float("nan"), -float("inf")
    B[5, 11] = 0.0  # inf * 0 = NaN at (3, 11)
    B[0, 4] = float("inf")
    eager = A @ B
    for make in FP32_ACCURACY_CONFIGS.values():
        y = gemm_custom(A, B, make(arch), arch=arch)
        assert torch.equal(y.isnan(), eager.isnan())
        assert torch.equal(y[eager.isinf()], eager[eager.isinf()])


# cuBLASLt's fused epilogue (torch._addmm_activation): (a_shape, N, b_transposed, act). M=1 is where torch
# skips cuBLASLt (addmm, then the activation), so both of its paths are checked.
LIBRARY_GPU_CASES = [((333, 264), 520, True, "gelu_tanh"), ((1, 1024), 1000, True, "relu"),
                     ((2, 129, 100), 130, False, "gelu_tanh"), ((1, 96), 40, False, "gelu_tanh")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("a_shape,N,bt,act", LIBRARY_GPU_CASES)
def test_library_epilogue_gpu(dtype, a_shape, N, bt, act):
    """The library epilogue computes gemm's semantics: batched A, either weight layout, odd sizes, `out=`; in
    fp32 (exact products at torch's default precision) its GELU is told apart from erf GELU: the tanh form."""
    from tkopt.kernels.gemm_epilogue import _library_gemm, library_serves

    torch.manual_seed(sum(a_shape) + N)
    K = a_shape[-1]
    a = torch.randn(*a_shape, device="cuda", dtype=dtype)
    b = (torch.randn(N, K, device="cuda", dtype=dtype) if bt else torch.randn(K, N, device="cuda", dtype=dtype))
    b = b * (2 / K**0.5)  # pre-activations ~N(0, 4): where the two GELUs differ most
    bias = torch.randn(N, device="cuda", dtype=dtype)
    assert library_serves(a, bias, act, None) and not library_serves(a, bias, act, bias)
    assert not library_serves(a.cpu(), bias.cpu(), act, None) and not library_serves(a, bias, "gelu", None)
    out = torch.full((*a_shape[:-1], N), float("nan"), device="cuda", dtype=dtype)
    assert _library_gemm(a, b, bias, act, bt, out) is out
    ref = gemm_ref(a.double(), b.double(), bias.double(), act, b_transposed=bt)
    _close(out.double(), ref, _tol(dtype))
    if dtype == torch.float32 and act == "gelu_tanh":
        erf = gemm_ref(a.double(), b.double(), bias.double(), "gelu", b_transposed=bt)
        rel = lambda r: ((out.double() - r).norm() / r.norm()).item()  # noqa: E731
        assert rel(ref) < 1e-5 < 5e-5 < rel(erf), (rel(ref), rel(erf))  # the two GELUs: 1.4e-4 apart


@pytest.mark.parametrize("tilelang_ms,library", [(0.0575, True), (0.0500, False), (None, True)])
def test_a_stored_library_timing_decides_with_the_margin_and_plans_no_build(tmp_path, monkeypatch, tilelang_ms,
                                                                           library):
    """cuBLASLt's epilogue runs unless TileLang's kernel timed LIBRARY_MARGIN faster (the encoder layer's relu GEMM
    on an H100: 0.0575 ms against 0.0581, so the library); decided for it, the build plan holds no TileLang
    kernel. A record with no TileLang time (its candidates failed) goes to the library."""
    from tkopt.kernels import gemm_epilogue, tuning
    from tkopt.kernels.arch import Build

    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TKOPT_SHIPPED_TUNING", "0")
    monkeypatch.setattr(gemm_epilogue, "_LIBRARY_CHOSEN", {})
    tuning.clear_memory_cache()
    M, N, K, dtype = 4096, 4096, 1024, torch.float16
    key = gemm_epilogue._library_key(M, N, K, dtype, "relu", True, "ieee")
    timings = [[{"kernel": "cublaslt"}, 0.0581]] + ([[{"kernel": "tilelang"}, tilelang_ms]] if tilelang_ms else [])
    best = min(timings, key=lambda t: t[1])
    (tmp_path / tuning.file_name("gemm_library", "sm90")).write_text(json.dumps(
        {tuning._key_str(key): {"config": best[0], "ms": best[1], "timings": timings}}))
    build = Build("sm90", "sm_90", 132)
    assert gemm_epilogue._library_decided("sm90", key) is library
    plan = gemm_epilogue.planned_kernels("gemm", build, M, N, K, dtype, "relu", True, False, True)
    assert (plan == []) is library
    # what the library does not serve plans TileLang's kernels whatever the record says
    assert gemm_epilogue.planned_kernels("gemm", build, M, N, K, dtype, "relu", True, True, True)
    assert gemm_epilogue.planned_kernels("gemm", Build("sm90"), M, N, K, dtype, "relu", True, False, True)


@pytest.mark.gpu
def test_gemm_chooses_the_library_epilogue_by_timing(tmp_path, monkeypatch):
    """gemm times cuBLASLt's epilogue against the tuned TileLang kernel once per shape bucket, caches both times on
    disk with the tuning, and runs the library unless TileLang was LIBRARY_MARGIN faster; arch= keeps the TileLang
    kernel, untimed against it."""
    from tkopt.kernels import gemm_epilogue, tuning

    if not _gpu_arch_ok("sm90"):
        pytest.skip("no sm90 GPU")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TKOPT_AUTOTUNE", "1")  # the GPU session's tests run with tuning off
    monkeypatch.setattr(gemm_epilogue, "_LIBRARY_CHOSEN", {})
    monkeypatch.setattr(gemm_epilogue, "_SELECTED", {})
    tuning.clear_memory_cache()
    torch.manual_seed(5)
    a = torch.randn(4, 96, 768, device="cuda", dtype=torch.float16)
    w = torch.randn(3072, 768, device="cuda", dtype=torch.float16) / 768**0.5
    bias = torch.randn(3072, device="cuda", dtype=torch.float16)
    ref = gemm_ref(a.double(), w.double(), bias.double(), "gelu_tanh", b_transposed=True)
    gemm(a, w, bias, "gelu_tanh", b_transposed=True, arch="sm90")
    assert not (tmp_path / tuning.file_name("gemm_library", "sm90")).exists()
    _close(gemm(a, w, bias, "gelu_tanh", b_transposed=True).double(), ref, 1e-2)
    entry = next(iter(tuning.read_json(str(tmp_path / tuning.file_name("gemm_library", "sm90"))).values()))
    timings = {c["kernel"]: t for c, t in entry["timings"]}
    assert set(timings) == {"tilelang", "cublaslt"} and all(t > 0 for t in timings.values()), timings
    assert entry["config"]["kernel"] == min(timings, key=timings.get)
    library = timings["tilelang"] * gemm_epilogue.LIBRARY_MARGIN > timings["cublaslt"]
    assert list(gemm_epilogue._LIBRARY_CHOSEN.values()) == [library]
    _close(gemm(a, w, bias, "gelu_tanh", b_transposed=True).double(), ref, 1e-2)
