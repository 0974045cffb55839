"""Grouped GEMM (several weights of one input in one launch): CPU numerics against the reference, refusals, the
lowered programs per arch (nvcc), and GPU numerics against float64 with every output element written."""

import pytest
import torch
from conftest import cuda_compile, lower_cuda

from tkopt.kernels import gemm_group
from tkopt.kernels.arch import Build, UnsupportedError
from tkopt.kernels.config import TileConfig
from tkopt.kernels.gemm_epilogue import (
    SMALL_M_CANDIDATES,
    TUNE_CANDIDATES,
    gemm_program,
    group_problem,
    planned_kernels,
    program_pass_configs,
    tuning_space,
)
from tkopt.kernels.reference import gemm_group_ref

# (a shape, widths, b_transposed, bias); fp64 on the CPU. Widths that are not multiples of the 32-wide CPU tile,
# one of a single column, and groups of unequal widths (GQA's K and V narrower than Q).
CPU_CASES = [
    ((37, 45), (40, 24, 17), True, True),
    ((2, 5, 33), (33, 50), False, False),
    ((1, 16), (1, 8, 32), True, False),
    ((70, 16), (1, 8, 32), True, False),  # the same kernel at another M (rows are dynamic)
]


@pytest.mark.parametrize("a_shape,widths,bt,has_bias", CPU_CASES)
def test_gemm_group_cpu_matches_reference(a_shape, widths, bt, has_bias):
    torch.manual_seed(len(widths) + a_shape[0])
    K = a_shape[-1]
    a = torch.randn(*a_shape, dtype=torch.float64)
    ws = [torch.randn(*((n, K) if bt else (K, n)), dtype=torch.float64) for n in widths]
    bs = [torch.randn(n, dtype=torch.float64) for n in widths] if has_bias else None
    ys = gemm_group(a, ws, bs, b_transposed=bt)
    refs = gemm_group_ref(a, ws, bs, b_transposed=bt)
    assert len(ys) == len(widths)
    for y, r in zip(ys, refs, strict=True):
        assert y.shape == r.shape and y.is_contiguous()
        torch.testing.assert_close(y, r, atol=1e-12, rtol=1e-12)


def test_gemm_group_edges_match_reference():
    """No rows, and K=0 (each output is its bias alone), as the separate GEMMs give them."""
    w = [torch.randn(4, 6), torch.randn(3, 6)]
    ys = gemm_group(torch.randn(0, 6), w, b_transposed=True)
    assert [tuple(y.shape) for y in ys] == [(0, 4), (0, 3)]
    bs = [torch.randn(4), torch.randn(3)]
    ys = gemm_group(torch.randn(5, 0), [torch.randn(4, 0), torch.randn(3, 0)], bs, b_transposed=True)
    for y, b in zip(ys, bs, strict=True):
        torch.testing.assert_close(y, b.expand(5, -1))


def test_gemm_group_rejects_bad_input_by_name():
    a, w = torch.randn(5, 6), torch.randn(4, 6)
    with pytest.raises(ValueError, match="two or three weights"):
        gemm_group(a, [w], b_transposed=True)
    with pytest.raises(ValueError, match="every weight a bias or none"):
        gemm_group(a, [w, w], [torch.randn(4), None], b_transposed=True)
    with pytest.raises(ValueError, match=r"weights\[1\]: inner dims differ"):
        gemm_group(a, [w, torch.randn(4, 7)], b_transposed=True)
    with pytest.raises(ValueError, match="one per weight"):
        gemm_group(a, [w, w], [torch.randn(4)], b_transposed=True)


def test_grouped_programs_are_refused_by_name():
    """What has no grouped program says why: an epilogue beyond a bias, the SIMT and tf32x3 programs, TileLang's
    own sm90 pipeline, a pingpong kernel, and widths that do not add up."""
    ov = TileConfig((128, 128, 64), warp_tile=(16, 128), threads=256, overlap=True)
    assert group_problem("sm90", 96, (32, 64), ov, "mma") is None
    for args, reason in ((("sm90", 96, (32, 64), ov, "mma", "relu"), "a bias at most"),
                         (("sm90", 96, (32, 64), ov, "simt"), "simt program has no grouped form"),
                         (("sm90", 96, (32, 64), ov, "tf32x3"), "tf32x3 program has no grouped form"),
                         (("sm90", 96, (32, 64), TileConfig((128, 256, 64), threads=256), "mma"), "overlap pipeline"),
                         (("sm90", 96, (32, 64), TileConfig((128, 128, 64), warp_tile=(32, 128), threads=256,
                                                            overlap=True, persistent=132, pingpong=True), "mma"),
                          "pingpong"),
                         (("sm90", 97, (32, 64), ov, "mma"), "summing to N=97"),
                         (("sm80", 32, (32,), ov, "mma"), "two or three")):
        assert reason in group_problem(*args)
    with pytest.raises(UnsupportedError, match="overlap pipeline"):
        gemm_program("sm90", 96, 64, "float16", TileConfig((128, 256, 64), threads=256), groups=(32, 64))


def test_grouped_tuning_takes_only_candidates_with_a_grouped_program():
    """sm90: the overlap tiles of the GEMM's candidates (never the pingpong one or TileLang's pipeline), the
    small-M tiles under one wave; the default is an overlap tile too. The build plan keys the kernel by the
    padded widths."""
    for M, n in ((8192, 2304), (128, 2304)):
        default, cands = tuning_space("sm90", M, n, torch.float16, sms=132, groups=(768, 768, 768))
        assert default.overlap and cands
        assert all(c.get("overlap") and not c.get("pingpong") for c in cands)
        source = SMALL_M_CANDIDATES if M == 128 else TUNE_CANDIDATES["sm90"]
        assert {c["block_tile"] for c in cands} == {c["block_tile"] for c in source if c.get("overlap")
                                                    and not c.get("pingpong")}
    h200 = Build("sm90", "sm_90", 132)
    jobs = planned_kernels("gemm_group", h200, 128, 2300, 64, torch.float16, None, True, False, True,
                           groups=(2044, 252, 4))
    assert jobs and {job.args[0][-1] for job in jobs} == {(2048, 256, 8)}
    assert planned_kernels("gemm_group", h200, 128, 96, 64, torch.float32, None, True, False, True,
                           groups=(32, 64)) == []  # fp32: no grouped program, each weight's own GEMM runs


# (arch, config, widths, bias): the overlap tile at 128 rows, the 128x192 persistent walk across groups with tails,
# and sm80's cp.async pipeline
LOWERED = [
    ("sm90", dict(block_tile=(64, 64, 64), warp_tile=(16, 64), stages=4, threads=128, overlap=True), (768, 768, 768),
     True),
    ("sm90", dict(block_tile=(128, 192, 64), warp_tile=(16, 192), stages=4, threads=256, overlap=True,
                  persistent=132), (2048, 512, 512), False),
    ("sm80", dict(block_tile=(128, 128, 32), stages=3, threads=128), (768, 264), True),
]


@pytest.mark.parametrize("arch,cfg,widths,has_bias", LOWERED, ids=lambda v: str(v)[:40])
def test_grouped_program_lowers_and_builds(arch, cfg, widths, has_bias):
    """The grouped program lowers with one store per group (each output its own buffer) and builds without
    spilling."""
    config = TileConfig(**cfg)
    src = lower_cuda(gemm_program(arch, sum(widths), 768, "float16", config, b_transposed=True, has_bias=has_bias,
                                  groups=widths), arch, program_pass_configs(config))
    for g in range(len(widths)):
        assert f"C{g}" in src and (f"Bias{g}" in src) == has_bias
    build = cuda_compile(src, arch)
    assert "spill" not in build.log or " 0 bytes spill stores" in build.log


# ---- GPU ------------------------------------------------------------------------------------------

def _gpu_arch_ok(arch):
    return torch.cuda.is_available() and (arch == "sm80" or torch.cuda.get_device_capability() >= (9, 0))


# (arch, dtype, M, widths, K, b_transposed, bias, config or None for the default)
GPU_CASES = [
    ("sm90", torch.float16, 128, (768, 768, 768), 256, True, True, SMALL_M_CANDIDATES[2]),
    ("sm90", torch.bfloat16, 200, (100, 36, 20), 72, True, True, SMALL_M_CANDIDATES[0]),
    ("sm90", torch.float16, 300, (200, 72, 40), 128, False, False,
     dict(TUNE_CANDIDATES["sm90"][3], persistent=3)),
    ("sm90", torch.bfloat16, 1000, (512, 128), 256, True, False, dict(TUNE_CANDIDATES["sm90"][2], persistent=5)),
    ("sm90", torch.float16, 1000, (512, 128, 128), 256, True, True, None),
    ("sm80", torch.float16, 200, (100, 36, 20), 72, True, True, dict(block_tile=(64, 64, 64), stages=3, threads=128)),
    ("sm80", torch.bfloat16, 1000, (512, 128), 256, False, True, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}x{c[3]}x{c[4]}")
def test_gemm_group_gpu(case, monkeypatch):
    """Each output against float64, its buffer NaN-filled before the kernel runs, so an element no block wrote
    fails: blocks of every group, padded widths sliced off, a persistent walk crossing from one group to the
    next."""
    arch, dtype, M, widths, K, bt, hb, cfg = case
    if not _gpu_arch_ok(arch):
        pytest.skip(f"no {arch} GPU")
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    torch.manual_seed(5)
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    ws = [torch.randn(*((n, K) if bt else (K, n)), device="cuda", dtype=dtype) / K**0.5 for n in widths]
    bs = [torch.randn(n, device="cuda", dtype=dtype) for n in widths] if hb else None
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *s, **kw: empty(*s, **kw).fill_(float("nan")))
    ys = gemm_group(a, ws, bs, b_transposed=bt, arch=arch, config=cfg)
    monkeypatch.setattr(torch, "empty", empty)
    torch.cuda.synchronize()
    refs = gemm_group_ref(a.double(), [w.double() for w in ws], None if bs is None else [b.double() for b in bs], bt)
    for y, r in zip(ys, refs, strict=True):
        assert torch.isfinite(y).all(), "an output element was not written"
        err = ((y.double() - r).norm() / r.norm()).item()
        assert err <= 1e-2, f"relative error {err:.3e}"
