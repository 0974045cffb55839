"""flash_attention: CPU variant vs the float64 reference, input checks, CUDA lowering + nvcc (sm90 both
schedules, sm80) in CI, and GPU numerics (marked gpu) for sm90 (pipelined and plain) / sm80 x fp16 / bf16 /
fp32."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import cuda_compile, lower_cuda

from tkopt.kernels import attention as A
from tkopt.kernels.arch import UnsupportedError, run_target
from tkopt.kernels.attention import flash_attention
from tkopt.kernels.reference import flash_attention_ref


def _rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _qkv(b, hq, hkv, sq, skv, d, layout="bhsd", dtype=torch.float32, device="cpu"):
    if layout == "bhsd":
        return (_rand(b, hq, sq, d, dtype=dtype, device=device), _rand(b, hkv, skv, d, dtype=dtype, device=device),
                _rand(b, hkv, skv, d, dtype=dtype, device=device))  # fmt: skip
    return (_rand(b, sq, hq, d, dtype=dtype, device=device), _rand(b, skv, hkv, d, dtype=dtype, device=device),
            _rand(b, skv, hkv, d, dtype=dtype, device=device))  # fmt: skip


def _ref(q, k, v, **kw):
    return flash_attention_ref(q.double(), k.double(), v.double(), **{
        k_: (v_.double() if isinstance(v_, torch.Tensor) and v_.is_floating_point() else v_) for k_, v_ in kw.items()
    })  # fmt: skip


# ------------------------------------------------------------------------------------------ CPU variant
# Shapes share one compiled kernel per (heads, dim, flags): sequence lengths and batch are dynamic.
CPU_SHAPES = [  # (B, Sq, Skv)
    (2, 37, 45),
    (1, 1, 1),
    (1, 1, 70),
    (3, 50, 17),  # Sq > Skv
    (1, 64, 64),
]


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_matches_reference_gqa(causal):
    torch.manual_seed(1)
    for b, sq, skv in CPU_SHAPES:
        q, k, v = _qkv(b, 4, 2, sq, skv, 32)
        out = torch.full_like(q, float("nan"))
        flash_attention(q, k, v, causal=causal, out=out)
        ref = _ref(q, k, v, causal=causal)
        assert _rel(out, ref) < 1e-5, (b, sq, skv, causal)


def test_cpu_dynamic_lengths_do_not_recompile():
    torch.manual_seed(2)
    q, k, v = _qkv(1, 2, 2, 9, 11, 16)
    flash_attention(q, k, v)
    misses = A.compile_cpu.cache_info().misses
    for b, sq, skv in [(2, 33, 7), (1, 5, 90)]:
        q, k, v = _qkv(b, 2, 2, sq, skv, 16)
        assert _rel(flash_attention(q, k, v), _ref(q, k, v)) < 1e-5
    assert A.compile_cpu.cache_info().misses == misses


def test_cpu_bshd_and_mixed_strides():
    torch.manual_seed(3)
    q, k, v = _qkv(2, 4, 2, 21, 30, 32, layout="bshd")
    out = flash_attention(q, k, v, causal=True, layout="bshd")
    assert out.shape == q.shape and out.is_contiguous()
    assert _rel(out, _ref(q, k, v, causal=True, layout="bshd")) < 1e-5
    # k/v given as transposed views of BHSD tensors (non-contiguous as BSHD): read in place, not copied.
    kb, vb = _rand(2, 2, 30, 32), _rand(2, 2, 30, 32)
    k2, v2 = kb.transpose(1, 2), vb.transpose(1, 2)
    assert not k2.is_contiguous()
    out = flash_attention(q, k2, v2, layout="bshd")
    assert _rel(out, _ref(q, k2, v2, layout="bshd")) < 1e-5
    layouts, tensors = A.kernel_layouts(q, k2, v2, "bshd")
    assert layouts == ("bshd", "bhsd", "bhsd", "bshd")
    assert tensors[1].data_ptr() == kb.data_ptr() and tensors[1].is_contiguous()  # a view, not a copy


def test_cpu_mha_projection_heads_read_in_place():
    """nn.MultiheadAttention's q / k / v: heads of (seq, batch, embed) projections, contiguous in neither given
    layout, are read in place as SBHD (they were copied, three copies per call), in either given layout."""
    torch.manual_seed(12)
    b, h, sq, skv, d = 2, 4, 19, 23, 16
    qp, kp, vp = _rand(sq, b, h * d), _rand(skv, b, 2 * d), _rand(skv, b, 2 * d)  # GQA: 2 kv heads
    q = qp.view(sq, b, h, d).permute(1, 2, 0, 3)  # BHSD views, as the MHA graph makes them
    k, v = (t.view(skv, b, 2, d).permute(1, 2, 0, 3) for t in (kp, vp))
    layouts, views = A.kernel_layouts(q, k, v, "bhsd")
    assert layouts == ("sbhd", "sbhd", "sbhd", "bhsd")
    assert [t.data_ptr() for t in views] == [qp.data_ptr(), kp.data_ptr(), vp.data_ptr()]
    for causal in (False, True):
        assert _rel(flash_attention(q, k, v, causal=causal), _ref(q, k, v, causal=causal)) < 1e-5
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # the same tensors given as BSHD
    assert A.kernel_layouts(qs, ks, vs, "bshd")[0] == ("sbhd", "sbhd", "sbhd", "bshd")
    out = flash_attention(qs, ks, vs, layout="bshd")
    assert out.is_contiguous() and _rel(out, _ref(qs, ks, vs, layout="bshd")) < 1e-5


def test_packed_qkv_heads_are_read_in_place_by_the_sm90_programs():
    """GPT-2's q / k / v: heads of one packed (B, S, 3 * H * D) projection, split and viewed, rows 3 * H * D
    apart. The sm90 programs (run-time strides, TMA) read them in place; the others, and any tensor TMA cannot
    take (an address or a row stride off 16 bytes), get contiguous copies."""
    b, s, h, d = 2, 37, 4, 64
    qkv = torch.randn(b, s, 3 * h * d, dtype=torch.float16)
    q, k, v = (t.view(b, s, h, d) for t in qkv.split(h * d, dim=2))
    layouts, views = A.kernel_layouts(q, k, v, "bshd", strided=True)
    assert layouts == ("bshd",) * 4
    assert [t.data_ptr() for t in views] == [t.data_ptr() for t in (q, k, v)]
    assert all(torch.equal(a, t) for a, t in zip(views, (q, k, v), strict=True))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # given as BHSD, as the traced graph does
    layouts, views = A.kernel_layouts(qt, kt, vt, "bhsd", strided=True)
    assert layouts == ("bshd", "bshd", "bshd", "bhsd") and views[1].data_ptr() == k.data_ptr()
    _, views = A.kernel_layouts(q, k, v, "bshd")  # not strided: copies
    assert all(t.is_contiguous() and t.data_ptr() != p.data_ptr() for t, p in zip(views, (q, k, v), strict=True))
    odd = torch.randn(b, s, h * d + 4, dtype=torch.float16)[..., : h * d].view(b, s, h, d)  # rows 8 bytes off
    shifted = torch.randn(b, s, h * d + 1, dtype=torch.float16)[..., 1:].view(b, s, h, d)  # address 2 bytes off
    for t in (odd, shifted):
        _, views = A.kernel_layouts(t, t, t, "bshd", strided=True)
        assert views[0].is_contiguous() and views[0].data_ptr() != t.data_ptr() and torch.equal(views[0], t)
    one = torch.randn(1, s, 1, 3 * d, dtype=torch.float16)[..., :d]  # size-1 dims: their strides never matter
    _, views = A.kernel_layouts(one, one, one, "bshd", strided=True)
    assert views[0].data_ptr() == one.data_ptr() and all(st * 2 % 16 == 0 for st in views[0].stride()[:3])


def test_kept_rows_summarize_whether_a_row_keeps_every_key():
    """The GPU programs skip a key-only mask's reads for a batch row whose summary says it keeps every key, so
    the summary must say so only then: a bool mask (either polarity) and an additive one, where -0.0 adds
    nothing but NaN and -inf do; a mask of rank < 4 or batch 1 has one row, and a half or double mask's summary
    is float32, the dtype the programs read."""
    keys = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]], dtype=torch.bool).view(3, 1, 1, 3)
    for mask_keeps, kept in ((True, [True, False, False]), (False, [False, False, True])):
        row = A.kept_rows(keys, mask_keeps)
        assert row.dtype == torch.uint8
        assert ((row != 0) if mask_keeps else (row == 0)).tolist() == kept  # as the program's _keeps reads it
    add = torch.tensor([[0.0, -0.0], [0.0, float("nan")], [float("-inf"), 0.0], [0.0, 1e-30]]).view(4, 1, 1, 2)
    assert (A.kept_rows(add) == 0).tolist() == [True, False, False, False]
    assert A.kept_rows(add.half()).dtype == A.kept_rows(add.double()).dtype == torch.float32
    assert A.kept_rows(keys[:1]).shape == A.kept_rows(keys[0, 0]).shape == A.kept_rows(keys[0, 0, 0]).shape == (1,)
    assert A.kept_rows(keys[..., ::2]).tolist() == [1, 1, 0]  # a strided view: keys 0 and 2
    assert [A.summarizes(s) for s in ((3, 1, 1, 3), (1, 3), (3,), (3, 1, 2, 3), (3, 2, 1, 3), (1, 1, 1, 1, 3))] == [
        True, True, True, False, False, False]


def test_cpu_noncontiguous_copied():
    torch.manual_seed(4)
    big = _rand(2, 3, 19, 64)
    q = big[..., ::2]  # contiguous in neither layout
    k, v = _rand(2, 3, 23, 32), _rand(2, 3, 23, 32)
    assert _rel(flash_attention(q, k, v), _ref(q, k, v)) < 1e-5


@pytest.mark.parametrize(
    "mshape",
    [(2, 4, 13, 29), (13, 29), (2, 1, 1, 29)],
    ids=["full", "2d", "keypad"],
)
def test_cpu_float_mask_broadcast(mshape):
    torch.manual_seed(5)
    q, k, v = _qkv(2, 4, 2, 13, 29, 32)
    mask = _rand(*mshape) * 2
    out = flash_attention(q, k, v, mask=mask)
    assert _rel(out, _ref(q, k, v, mask=mask)) < 1e-5


@pytest.mark.parametrize("mshape", [(1, 1, 13, 29), (1, 1, 1, 29), (1, 4, 13, 29)])
@pytest.mark.parametrize("arch", ["cpu", "sm90"])
def test_a_batch_of_one_shares_the_kernel_of_larger_batches(mshape, arch):
    """Over a batch of one, a mask's batch dim of 1 is read per batch row, not broadcast: the compile key is the one
    a larger batch with a mask row each has, so a model served at batch 1 builds no kernel of its own. One mask row
    over a larger batch broadcasts: another kernel. Each computes what the reference does."""
    torch.manual_seed(8)
    mask = torch.rand(*mshape) > 0.3
    args = (arch, "float32", True, None, "bhsd", 1.0, -math.inf, "masked", True)
    keys = {}
    for b, m in ((1, mask), (3, mask.expand(3, *mshape[1:]).contiguous()), (3, mask)):
        q, k, v = _qkv(b, 4, 2, 13, 29, 32)
        keys[b, m.shape[0]] = A._prepared(q, k, v, m, *args)[0]
        assert _rel(flash_attention(q, k, v, mask=m, causal=True), _ref(q, k, v, mask=m, causal=True)) < 1e-5
    assert keys[1, 1] == keys[3, 3] != keys[3, 1]


def test_cpu_bool_mask_fully_masked_rows_are_zero():
    torch.manual_seed(6)
    q, k, v = _qkv(2, 4, 2, 13, 40, 32)
    mask = torch.rand(2, 1, 13, 40) > 0.5
    mask[0, 0, 3] = False  # row 3 of batch 0: every key masked
    mask[1, 0, :, :] = False
    mask[1, 0, 5, 39] = True  # only the last key (in the last key block)
    out = torch.full_like(q, float("nan"))
    flash_attention(q, k, v, mask=mask, causal=False, out=out)
    ref = _ref(q, k, v, mask=mask)
    assert (out[0, :, 3] == 0).all() and (out[1, :, 0] == 0).all()
    assert _rel(out, ref) < 1e-5
    # -inf additive mask: same rule
    fmask = torch.zeros(2, 1, 13, 40).masked_fill(~mask, float("-inf"))
    out = flash_attention(q, k, v, mask=fmask, causal=True)
    assert _rel(out, _ref(q, k, v, mask=fmask, causal=True)) < 1e-5


def _assert_same(out, ref, tol=1e-5):
    """Equal up to rounding, NaN positions included."""
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol, equal_nan=True)


def test_cpu_mask_scale_and_finite_fills():
    """(S + M) * c (mask_scale), and a bool mask's finite fill: a row whose every key is masked weighs them
    all equally (eager's softmax of equal finite values), finfo.min included (no overflow to -inf), and only
    its real keys: not the padding of the partial last key block nor (causal) keys after the query, whatever
    the mask says there (the masking is the GPU programs', so this catches their defect of that class)."""
    torch.manual_seed(8)
    skv = A.CPU_BLOCK_N + 13  # two key blocks, the second partial
    q, k, v = _qkv(2, 4, 2, 13, skv, 16)
    m = torch.randn(2, 1, 13, skv) * 3
    _assert_same(flash_attention(q, k, v, mask=m, scale=0.3, mask_scale=0.3),
                 _ref(q, k, v, mask=m, scale=0.3, mask_scale=0.3))
    # The first key block all -inf, the rest finite but far below 0: the second block's softmax shifts by its
    # own max (not by 0, the stand-in for an all -inf max), or every weight underflows.
    m[..., : A.CPU_BLOCK_N] = float("-inf")
    m[..., A.CPU_BLOCK_N :] -= 1e3  # scores near -300: exp underflows to 0 in float32
    out = flash_attention(q, k, v, mask=m, scale=0.3, mask_scale=0.3)
    _assert_same(out, _ref(q, k, v, mask=m, scale=0.3, mask_scale=0.3), tol=1e-3)  # float32 ulp of 300: 3e-5
    assert out.abs().amax() > 0.1
    keep = torch.rand(2, 1, 13, skv) > 0.5
    keep[0, 0, 4] = False  # every key masked, the last one too (padding keys read the last key's mask)
    for fill in (-1e4, float(torch.finfo(torch.float32).min)):
        for causal, n_seen in ((True, 5), (False, skv)):  # row 4 sees keys 0..4 (causal) or all of them
            out = flash_attention(q, k, v, mask=keep, mask_fill=fill, causal=causal)
            _assert_same(out, _ref(q, k, v, mask=keep, mask_fill=fill, causal=causal))
            # masked_fill's mask: True masks (mask_keeps=False)
            _assert_same(flash_attention(q, k, v, mask=~keep, mask_fill=fill, causal=causal, mask_keeps=False), out)
            uniform = v[0].repeat_interleave(2, 0)[:, :n_seen].mean(1)
            torch.testing.assert_close(out[0, :, 4], uniform, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("guard", ["none", "masked", "nan"])
def test_cpu_guards_fully_masked_rows_and_nan(guard):
    """A row with every key masked: NaN (plain softmax), 0 (SDPA), 0 (NaN guard); a NaN score: NaN unless the
    NaN guard zeroes it. Elsewhere NaN propagates as in eager."""
    torch.manual_seed(9)
    q, k, v = _qkv(1, 2, 2, 6, 37, 8)
    q[0, 1, 2, 0] = float("nan")  # head 1, row 2: a NaN score in every key
    keep = torch.rand(1, 1, 6, 37) > 0.3
    keep[..., 3, :] = False  # row 3: every key masked
    out = flash_attention(q, k, v, mask=keep, guard=guard)
    ref = _ref(q, k, v, mask=keep, guard=guard)
    _assert_same(out, ref)
    assert out[0, :, 3].isnan().all() == (guard == "none") and (out[0, :, 3] == 0).all() == (guard != "none")
    assert out[0, 1, 2].isnan().all() == (guard != "nan")
    assert not out[0, 0, [0, 1, 2, 4, 5]].isnan().any() and not out[0, 1, [0, 1, 4, 5]].isnan().any()


# (layout, causal, kv heads, keys, where the NaN goes, whether q's last dim is contiguous, whether eager gives NaN).
# torch's CPU flash kernel takes a row's max vectorized (a NaN propagates) and its last keys one by one (a NaN is
# skipped), so a row of NaN gives 0 only where every key is in the scalar tail: 3 float64 keys are on every CPU
# (its vectors hold 4 or 8), 40 never are.
SDPA_NAN_CASES = {
    "q-row": ("bhsd", False, 4, 3, "q", True, False),
    "q-row-long": ("bhsd", False, 4, 40, "q", True, True),
    "q-row-causal-gqa-bshd": ("bshd", True, 2, 3, "q", True, False),
    "q-row-causal-long": ("bhsd", True, 4, 40, "q", True, True),
    "q-row-not-contiguous": ("bhsd", False, 4, 3, "q", False, True),  # eager's math fallback: NaN
    "k-row": ("bhsd", True, 2, 5, "k", True, True),  # a NaN score beside finite ones: NaN
}


@pytest.mark.parametrize("kernels", ["reference", "tilelang"])
@pytest.mark.parametrize("case", list(SDPA_NAN_CASES))
def test_sdpa_guard_gives_what_torchs_cpu_sdpa_gives(case, kernels):
    """A FusedAttention that replaced torch's SDPA without a mask (guard "sdpa") matches eager's SDPA on the CPU
    for NaN inputs: its flash kernel gives 0 or NaN for a query row whose every score is NaN, by the row's length
    and the CPU's vector width (SDPA_NAN_CASES; fuzz seed 3618 found the 0, an AVX2 CPU the NaN), its math
    fallback (a last dim that is not contiguous) NaN, and a NaN among finite scores is NaN either way."""
    from tkopt.fused_ops import schema

    layout, causal, hkv, keys, where, contiguous, nan = SDPA_NAN_CASES[case]
    torch.manual_seed(12)
    q, k, v = _qkv(2, 4, hkv, 5, keys, 8, dtype=torch.float64)
    (q if where == "q" else k)[0, 1, 2] = float("nan")
    if not contiguous:
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != 4)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    attrs = {"causal": int(causal), "layout": layout, "guard": "sdpa"}
    op = schema("FusedAttention")
    run = op.kernel if kernels == "tilelang" else op.reference
    (got,) = run(op.padded([q, k, v]), op.full_attrs(attrs))
    if layout == "bshd":
        got = got.transpose(1, 2)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got.isnan().any() == nan


def test_cpu_float64_mask_keeps_its_range():
    """A float64 additive mask of finfo(float64).min stays finite (read as float32 it would be -inf): a fully
    masked row weighs its keys equally, as eager does, instead of giving 0."""
    torch.manual_seed(10)
    q, k, v = _qkv(1, 2, 2, 5, 9, 8, dtype=torch.float64)
    m = torch.zeros(1, 1, 5, 9, dtype=torch.float64)
    m[..., 2, :] = torch.finfo(torch.float64).min
    out = flash_attention(q, k, v, mask=m)
    _assert_same(out, flash_attention_ref(q, k, v, mask=m), tol=1e-12)
    torch.testing.assert_close(out[0, :, 2], v.mean(2)[0])


def test_cpu_scale_float64_and_head_dims():
    torch.manual_seed(7)
    q, k, v = _qkv(1, 2, 2, 17, 19, 48, dtype=torch.float64)
    out = flash_attention(q, k, v, scale=0.3, causal=True)
    assert out.dtype == torch.float64
    assert _rel(out, _ref(q, k, v, scale=0.3, causal=True)) < 1e-12


def test_cpu_empty_and_no_keys():
    q, k, v = _qkv(2, 2, 2, 0, 5, 16)
    assert flash_attention(q, k, v).shape == (2, 2, 0, 16)
    q, k, v = _qkv(2, 2, 2, 3, 0, 16)
    out = flash_attention(q, k, v)
    assert out.shape == (2, 2, 3, 16) and (out == 0).all()
    assert torch.equal(out, _ref(q, k, v).to(out.dtype))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool rows", "float keys", "float 2-D", "bool row of one"])
@pytest.mark.parametrize("guard", ["masked", "nan", "none"])
def test_reference_in_row_blocks_is_the_reference_in_one(monkeypatch, layout, causal, mask, guard):
    """The reference takes query rows in blocks of SCORE_BLOCK scores (its memory bounded at any length): block by
    block, row by row included, it computes what it computes in one block, causal offsets, sliced masks, GQA,
    fully masked rows and NaN guards included."""
    from tkopt.kernels import reference

    torch.manual_seed(11)
    q, k, v = _qkv(2, 4, 2, 13, 9, 8, layout=layout)
    masks = {None: None, "bool rows": torch.rand(2, 1, 13, 9) > 0.3, "float keys": torch.randn(2, 1, 1, 9),
             "float 2-D": torch.randn(13, 9), "bool row of one": torch.rand(1, 9) > 0.5}
    m = masks[mask]
    if m is not None and m.dtype == torch.bool:
        m[..., 0, :] = False  # a fully masked row
    kw = dict(causal=causal, mask=m, layout=layout, guard=guard)
    whole = flash_attention_ref(q, k, v, **kw)
    for block in (2 * 4 * 9 * 5, 1):  # five rows a block (the last one short), one row a block
        monkeypatch.setattr(reference, "SCORE_BLOCK", block)
        torch.testing.assert_close(flash_attention_ref(q, k, v, **kw), whole, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_bad_inputs_raise_clear_errors():
    q, k, v = _qkv(1, 4, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="q must be 4-D"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attention(q, k.double(), v)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"):
        flash_attention(q, _rand(1, 3, 8, 16), _rand(1, 3, 8, 16))
    with pytest.raises(ValueError, match="k and v shapes differ"):
        flash_attention(q, k, _rand(1, 2, 9, 16))
    with pytest.raises(ValueError, match="head dim of q"):
        flash_attention(q, _rand(1, 2, 8, 32), _rand(1, 2, 8, 32))
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_attention(q, k, v, mask=torch.zeros(1, 4, 7, 8))
    with pytest.raises(ValueError, match="mask must be bool or floating"):
        flash_attention(q, k, v, mask=torch.zeros(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="layout must be"):
        flash_attention(q, k, v, layout="sbhd")
    with pytest.raises(UnsupportedError, match="cpu variant supports float32/float64"):
        flash_attention(q.half(), k.half(), v.half())
    with pytest.raises(UnsupportedError, match="head dim <= 256"):
        flash_attention(_rand(1, 1, 2, 300), _rand(1, 1, 2, 300), _rand(1, 1, 2, 300))
    with pytest.raises(UnsupportedError, match="needs CUDA tensors"):
        flash_attention(q, k, v, arch="sm90")
    with pytest.raises(ValueError, match="out must be"):
        flash_attention(q, k, v, out=torch.empty(1, 4, 8, 15))
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attention(q, None, v)


# ---------------------------------------------------------------------- CUDA lowering + nvcc (no GPU)
# (arch, dtype, dim, heads_q, heads_kv, causal, layouts, mask_kind, mask_bcast, config overrides[, semantics])
# sm90 defaults to the pipelined schedule; one case keeps the plain one (each case is ~10-25 s here).
# semantics: gpu_program's mask_scale / mask_fill / guard (a finite fill, a scaled mask, NaN rows), and
# kept_rows (compile_gpu's True by default; the ONNX Runtime op library's programs take no Kept).
LOWER_CASES = {
    "sm90-f16-d128-causal-gqa-sbhd": ("sm90", "float16", 128, 8, 2, True, ("sbhd", "sbhd", "sbhd", "bhsd"), None,
                                      (False,) * 4, {}),
    "sm90-bf16-d64-boolmask-mixed": ("sm90", "bfloat16", 64, 4, 2, False, ("bshd", "bhsd", "bhsd", "bshd"), "bool",
                                     (False, True, True, False), {}),
    "sm90-plain-bf16-d64-addmask-bshd": ("sm90", "bfloat16", 64, 4, 4, False, ("bshd",) * 4, "add",
                                         (False, True, False, False), {"pipelined": False}),
    "sm80-f16-d128-boolmask-gqa": ("sm80", "float16", 128, 8, 2, True, ("bshd", "bhsd", "bhsd", "bshd"), "bool",
                                   (False, True, True, False), {}, {"kept_rows": False}),
    "sm90-f16-d64-finitefill-nanguard": ("sm90", "float16", 64, 4, 4, False, ("bhsd",) * 4, "bool",
                                         (False, True, False, False), {},
                                         {"mask_fill": -1e4, "guard": "nan", "mask_keeps": False}),
    "sm90-plain-f16-d128-keymask-causal-gqa": ("sm90", "float16", 128, 8, 2, True, ("bshd",) * 4, "bool",
                                               (False, True, True, False), {"pipelined": False}),
    "sm80-bf16-d64-scaledmask-noneguard": ("sm80", "bfloat16", 64, 4, 2, True, ("bhsd",) * 4, "add",
                                           (False, True, False, False), {}, {"mask_scale": 0.125, "guard": "none"}),
    "sm90-f16-d64-two-ctas-keymask-causal": ("sm90", "float16", 64, 12, 12, True, ("bshd",) * 4, "bool",
                                             (False, True, True, False),
                                             {"block_M": 64, "threads": 128, "min_blocks": 2}),
    "sm90-f16-d32-keymask-two-ctas": ("sm90", "float16", 32, 12, 12, False, ("bshd",) * 4, "bool",
                                      (False, True, True, False), {"block_M": 64, "threads": 128, "min_blocks": 2}),
    "sm90-f16-d64-three-ctas-keymask": ("sm90", "float16", 64, 12, 12, False, ("bshd",) * 4, "bool",
                                        (False, True, True, False),
                                        {"block_M": 64, "block_N": 64, "threads": 128, "min_blocks": 3}),
    "sm90-f16-d80-causal-gqa-bshd": ("sm90", "float16", 80, 8, 2, True, ("bshd",) * 4, None, (False,) * 4, {}),
    "sm90-bf16-d256-keymask": ("sm90", "bfloat16", 256, 4, 4, False, ("bhsd",) * 4, "bool",
                               (False, True, True, False), {}),
    "sm80-f16-d96-addmask": ("sm80", "float16", 96, 4, 2, False, ("bhsd",) * 4, "add", (False, True, False, False),
                             {}),
    "sm80-f16-d256-causal-gqa": ("sm80", "float16", 256, 8, 2, True, ("bshd",) * 4, None, (False,) * 4, {}),
    "sm90-persistent-f16-d64-keymask": ("sm90", "float16", 64, 12, 12, False, ("bshd",) * 4, "bool",
                                        (False, True, True, False), {"pipelined": False, "persistent": 132}),
    "sm90-persistent-bf16-d128-causal-gqa-addmask": ("sm90", "bfloat16", 128, 8, 2, True, ("bhsd",) * 4, "add",
                                                     (False, True, False, False),
                                                     {"pipelined": False, "persistent": 132}),
    "sm90-pingpong-f16-d64-causal": ("sm90", "float16", 64, 12, 12, True, ("bshd",) * 4, None, (False,) * 4,
                                     {"pipelined": False, "persistent": 132, "pingpong": True}),
}  # fmt: skip


def _config(arch, dim, overrides):
    return {**A.default_config(arch, dim), **overrides}


def _lower(case):
    arch, dtype, dim, hq, hkv, causal, layouts, mk, bc, overrides, *semantics = case
    options = {"kept_rows": True, **(semantics[0] if semantics else {})}
    func = A.gpu_program(dtype, dim, hq, hkv, causal, layouts, mk, bc, None, **options,
                         strided_qkv=A.reads_strided(arch), **_config(arch, dim, overrides))
    return lower_cuda(func, arch, A._pass_configs(arch, config=_config(arch, dim, overrides)))


@pytest.fixture(scope="module")
def lowered():
    return {name: _lower(case) for name, case in LOWER_CASES.items()}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_cuda_lowers_and_nvcc_compiles(lowered, name):
    arch, dim, overrides = LOWER_CASES[name][0], LOWER_CASES[name][2], LOWER_CASES[name][9]
    src = lowered[name]
    key_only = LOWER_CASES[name][8][1:3] == (True, True)
    kept = key_only and {"kept_rows": True, **(LOWER_CASES[name][10:] or [{}])[0]}["kept_rows"]
    assert ("Kept" in src) == kept, "a key-only mask's programs take Kept where kept_rows says so"
    if arch == "sm90":
        assert "wgmma" in src and "tma_load" in src, "sm90 variant should use wgmma and TMA"
        assert "warpgroup_reg_alloc" in src, "sm90 variant should be warp specialized"
        pipelined = _config(arch, dim, overrides).get("pipelined", False)
        assert ("wait_wgmma<1>" in src) == pipelined, "only the pipelined schedule leaves a wgmma in flight"
    else:
        assert "cp_async" in src and "mma" in src and "wgmma" not in src
    build = cuda_compile(src, arch)
    assert build.registers and all(s == 0 for s in build.spills), build.log[-2000:]
    config = _config(arch, dim, overrides)
    blocks, threads = config.get("min_blocks", 1), config["threads"] + 128  # TileLang adds a producer warpgroup
    if blocks > 1:
        assert f"__launch_bounds__({threads}, {blocks})" in src
        assert build.registers[0] * threads * blocks <= 65536, "the CTAs asked for do not fit an SM's registers"
        dealloc, alloc = (int(n) for n in re.findall(r"warpgroup_reg_(?:dealloc|alloc)<(\d+)>", src))
        assert dealloc * 128 + alloc * config["threads"] <= build.registers[0] * threads, (
            "setmaxnreg asks for more registers than the CTA launched with: the consumers would wait forever")


def _sass(cubin: str) -> str | None:
    """SASS of a cubin via cuobjdump (None where it is not installed: not every CUDA install ships it)."""
    import shutil
    import subprocess

    from tilelang.env import CUDA_HOME

    tool = shutil.which("cuobjdump") or (os.path.join(CUDA_HOME, "bin", "cuobjdump") if CUDA_HOME else None)
    if not tool or not os.path.exists(tool):
        return None
    proc = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


@pytest.mark.parametrize("name", [n for n, c in LOWER_CASES.items() if _config(c[0], c[2], c[9]).get("pipelined")])
def test_pipelined_schedule_overlaps_and_is_not_serialized(lowered, name):
    """The pipelined schedule's invariants, on the lowered source, ptxas' report and (where cuobjdump is
    installed) the SASS:

    - the consumer releases its K/V stage (back-pressure mbarrier arrive) only after its last wgmma wait:
      an async wgmma still reads K_shared / V_shared after it is issued, and TileLang's warp
      specialization places the release after the last statement touching the buffer;
    - ptxas keeps the wgmma asynchronous: C7514 ("wgmma.mma_async instructions are serialized") or C7517
      ("warpgroup.wait is injected") mean a path reads a wgmma's registers before its wait;
    - the softmax (exp2) sits between the wait for QK^T (wait_wgmma<1>) and the wait for PV, and that
      wait is behind the warp-vote branch that keeps ptxas from hoisting it; in the SASS, MUFU.EX2 runs
      between WARPGROUP.DEPBAR.LE gsb0, 0x1 and the next WARPGROUP.DEPBAR.LE gsb0, 0x0. Any of these
      failing silently turns the overlap off (the kernel stays correct, just as slow as the plain one).
    """
    src = lowered[name]
    consumer = src[src.index("warpgroup_reg_alloc") :]
    releases = [m.start() for m in re.finditer(r"mbarrier\[[^\]]*\]\.arrive\(\)", consumer)]
    waits = [m.start() for m in re.finditer(r"wait_wgmma<\d>", consumer)]
    assert releases and waits and min(releases) > max(waits), "a K/V stage is released before its wgmma wait"
    assert "wgmma_rs" in consumer and consumer.count("wait_wgmma<1>") == 1
    w1 = consumer.index("wait_wgmma<1>")
    vote = consumer.index("__activemask()", w1)
    assert "exp2f" in consumer[w1:vote] and consumer.index("wait_wgmma<0>", w1) > vote
    build = cuda_compile(src, "sm90")
    assert not re.search(r"C751[47]", build.log), build.log[-3000:]
    sass = _sass(build.cubin)
    if sass is not None:
        d1 = sass.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")
        d0 = sass.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", d1)
        assert sass.count("MUFU.EX2", d1, d0) >= 16, "ptxas hoisted the PV wait above the softmax"


@pytest.mark.parametrize("name", [n for n, c in LOWER_CASES.items() if c[9].get("persistent")])
def test_persistent_schedule_hands_its_buffers_over_in_order(lowered, name):
    """The persistent schedule's protocol, on the lowered source (TileLang's thread syncs are off there, so nothing
    else orders the two sides):

    - each barrier expects what arrives: the producer warpgroup's 128 threads on the loads' barriers, every
      consumer thread on the ones that give Q and the K/V stages back;
    - the producer waits for a buffer to be given back before its TMA load into it;
    - a consumer gives a K/V stage back only after waiting for the wgmma that read it last (PV), and Q after a
      tile's last block;
    - with pingpong, QK^T is issued between the warpgroup's turn (bar.sync) and handing the turn over (bar.arrive),
      and waited for after; warpgroup 1 hands warpgroup 0 its first turn and warpgroup 0 takes the last hand-over,
      so every bar.arrive meets a bar.sync;
    - ptxas keeps the wgmma asynchronous (C7514 / C7517: a path reads its registers before the wait).
    """
    src = lowered[name]
    config = _config("sm90", LOWER_CASES[name][2], LOWER_CASES[name][9])
    threads, stages = config["threads"], config["num_stages"]
    inits = dict(re.findall(r"(\w+\[\d+\])\.init\((\d+)\)", src))
    want = {"q_full[0]": 128, "q_empty[0]": threads}
    for i in range(stages):
        want.update({f"k_full[{i}]": 128, f"v_full[{i}]": 128, f"kv_empty[{i}]": threads})
    assert {k: int(v) for k, v in inits.items()} == want
    consumer_at = src.index("warpgroup_reg_alloc")
    producer, consumer = src[src.index("warpgroup_reg_dealloc"):consumer_at], src[consumer_at:]
    assert producer.index("q_empty[0].wait(") < producer.index("tma_load(Q_desc")
    assert producer.index("kv_empty[") < producer.index("tma_load(K_desc") < producer.index("tma_load(V_desc")
    pv = consumer.index("wgmma_rs")
    assert consumer.index("warpgroup_wait<0>", pv) < consumer.index("kv_empty[", pv) < consumer.index(
        "q_empty[0].arrive()", pv)
    if config.get("pingpong"):
        turn = consumer.index("__sync_thread_partial((wg + 4), ")
        issue = consumer.index("wgmma_ss", turn)
        handed = consumer.index("__named_barrier_arrive((5 - wg), ", issue)
        assert issue < handed < consumer.index("wait_wgmma<0>", issue)
        assert re.search(r"if \(wg == 1\) \{\s*tl::__named_barrier_arrive\(4, 256\);", consumer)
        assert re.search(r"if \(wg == 0\) \{\s*tl::__sync_thread_partial\(4, 256\);\s*\}\s*\}\s*\}\s*$", consumer)
    build = cuda_compile(src, "sm90")
    assert not re.search(r"C751[47]", build.log), build.log[-3000:]


@pytest.mark.parametrize("section", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("pairs", [1, 5, 12, 24])
@pytest.mark.parametrize("n_q", [1, 4, 7])
def test_causal_order_runs_every_tile_once_longest_first_by_sections(n_q, pairs, section):
    order = [A.causal_order(i, n_q, pairs, section) for i in range(n_q * pairs)]
    assert sorted(order) == [(b, p) for b in range(n_q) for p in range(pairs)]
    for first in range(0, pairs, section):
        tiles = order[first * n_q:min(first + section, pairs) * n_q]
        assert {p for _, p in tiles} == set(range(first, min(first + section, pairs))), "a section's own pairs"
        assert [b for b, _ in tiles] == sorted((b for b, _ in tiles), reverse=True), "its longest tiles first"


def test_gpu_head_dims_are_the_multiples_of_16_up_to_256():
    assert [d for d in range(300) if A.gpu_head_dim(d)] == list(range(16, 257, 16))
    for d in (40, 272):
        with pytest.raises(UnsupportedError, match=f"multiples of 16 up to 256, not {d}"):
            A._kernel_dtype(torch.empty(1, 1, 1, d, dtype=torch.float16), "sm90", "masked")


def test_schedule_configs():
    """Both schedules are tuning candidates on sm90 (which wins is measured on the device); pipelined and
    persistent are sm90-only, pingpong needs the persistent schedule's two consumer warpgroups."""
    for dim in (16, 32, 64, 80, 96, 128, 192, 256):
        cands = A.tune_candidates("sm90", dim)
        assert {bool(c.get("pipelined")) for c in cands} == {True, False}
        assert A.default_config("sm90", dim) in cands
        assert A.default_config("sm80", dim) in A.tune_candidates("sm80", dim)
        assert not any(c.get("pipelined") for c in A.tune_candidates("sm80", dim))
        masked = A.tune_candidates("sm90", dim, masked=True)
        assert A.default_config("sm90", dim) in masked and all(c["block_M"] * c["block_N"] <= 128 * 128
                                                                  for c in masked)  # fmt: skip
    key = ("float16", 64, 4, 4, False, ("bhsd",) * 4, None, (False,) * 4, None)
    for schedule in ({"pipelined": True}, {"persistent": 108}):
        with pytest.raises(UnsupportedError, match="persistent schedules need wgmma"):
            A.compile_gpu("sm80", key, tuple(sorted({**A.default_config("sm80", 64), **schedule}.items())))
    with pytest.raises(UnsupportedError, match="pingpong takes turns"):
        A.gpu_program("float16", 64, 4, 4, False, pingpong=True, persistent=0)
    with pytest.raises(UnsupportedError, match="persistent schedule takes fp16/bf16"):
        A.gpu_program("float32", 64, 4, 4, False, persistent=132)


def test_gpu_programs_refuse_a_scale_that_is_not_positive():
    """The GPU programs take the softmax's running max over unscaled q.k (the scale is in the exponent), which
    a negative scale would turn into the running min."""
    with pytest.raises(UnsupportedError, match="positive scale"):
        A.gpu_program("float16", 64, 4, 4, False, scale=-0.125)


def test_sm80_variant_for_hopper_lowers_without_wgmma_and_compiles():
    """Forced sm80 on an H200: built for sm_90 with wgmma/TMA/warp specialization off (an sm_80 cubin
    does not load there: CUDA_ERROR_NO_BINARY_FOR_GPU)."""
    import tilelang
    from tilelang import tvm

    func = A.gpu_program("float16", 64, 4, 4, True, ("bhsd",) * 4, None, (False,) * 4, None,
                         **A.default_config("sm80", 64))  # fmt: skip
    target = run_target("sm80", "sm_90")
    assert target == {"kind": "cuda", "arch": "sm_90"}
    with tvm.transform.PassContext(config=A._pass_configs("sm80", "sm_90")), tvm.target.Target(target):
        src = tilelang.lower(func, target=target).kernel_source
    assert "wgmma" not in src and "tma_load" not in src and "cp_async" in src and "mma" in src
    build = cuda_compile(src, "sm90")
    assert all(s == 0 for s in build.spills)


# ---------------------------------------------------------------------------------- GPU numerics
# variant -> (arch, config overrides): sm90 runs its default (pipelined) schedule, the plain one, its tuning
# candidates that ask for two and for three CTAs per SM (one consumer warpgroup each, setmaxnreg split to fit: an
# int override is that many CTAs, `_ctas`), and the persistent schedule with 132 resident CTAs (an H100's or H200's
# SMs: the small cases have fewer tiles than CTAs, the long ones many tiles a CTA), without and with pingpong.
GPU_VARIANTS = {"sm90": ("sm90", None), "sm90-plain": ("sm90", {"pipelined": False}), "sm90-2ctas": ("sm90", 2),
                "sm90-3ctas": ("sm90", 3), "sm90-persistent": ("sm90", {"pipelined": False, "persistent": 132}),
                "sm90-pingpong": ("sm90", {"pipelined": False, "persistent": 132, "pingpong": True}),
                "sm80": ("sm80", None)}
PERSISTENT_VARIANTS = ("sm90-persistent", "sm90-pingpong")
CTAS_VARIANTS = ("sm90-2ctas", "sm90-3ctas")
GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (B, Hq, Hkv, Sq, Skv, D, causal, layout, mask)
GPU_CASES = {
    "d128": (2, 4, 4, 300, 300, 128, False, "bhsd", None),
    "d64-causal-gqa-odd": (2, 8, 2, 200, 333, 64, True, "bhsd", None),
    "d128-causal-sq>skv": (1, 4, 2, 257, 130, 128, True, "bshd", None),
    "d64-addmask": (2, 4, 4, 150, 211, 64, False, "bhsd", "add"),
    "d64-addmask-b1": (1, 4, 4, 150, 211, 64, False, "bhsd", "add"),  # one mask row read per batch row, not broadcast
    "d128-boolmask-bshd": (2, 4, 2, 129, 260, 128, True, "bshd", "bool"),
    "d32-boolmask": (2, 12, 12, 130, 130, 32, False, "bshd", "bool"),
    "d48-causal": (2, 4, 4, 100, 100, 48, True, "bhsd", None),
    "d80-causal-gqa": (2, 8, 2, 190, 277, 80, True, "bshd", None),
    "d96-addmask": (2, 4, 4, 150, 211, 96, False, "bhsd", "add"),
    "d256": (2, 4, 4, 300, 300, 256, False, "bhsd", None),
    "d256-boolmask-causal-gqa": (1, 4, 2, 129, 260, 256, True, "bshd", "bool"),
    # Long enough that the causal CTAs run in several sections of heads (`causal_order`): 16 + 4 q heads at D=128
    # (fp16, 8 K/V heads' worth per section), 32 + 8 at D=64 with GQA; the kernels of the two cases above.
    "d128-causal-sections": (5, 4, 2, 8000, 8192, 128, True, "bshd", None),
    "d64-causal-gqa-sections": (5, 8, 2, 1000, 16384, 64, True, "bhsd", None),
}


def gpu_case_enabled(dtype, case, variant="sm90"):
    """fp16 on every case; bf16 on two (one masked); fp32 (tf32 math) on one, and not for sm90-plain or the CTAs
    variants (fp32 always runs its own config); those only at head dims with such a candidate. Each is a compiled
    kernel."""
    if dtype == torch.float32 and variant in ("sm90-plain", *PERSISTENT_VARIANTS, *CTAS_VARIANTS):
        return False
    if variant in CTAS_VARIANTS and gpu_variant_config(variant, dtype, GPU_CASES[case][5])[1] is None:
        return False
    if dtype == torch.float16:
        return True
    if dtype == torch.bfloat16:
        return case in ("d64-causal-gqa-odd", "d128-boolmask-bshd")
    return case == "d128"


def gpu_variant_config(variant, dtype, dim):
    """(arch, config for flash_attention: None = the default / heuristic one) of a GPU test variant."""
    arch, overrides = GPU_VARIANTS[variant]
    if overrides is None or dtype == torch.float32:
        return arch, None
    if isinstance(overrides, int):
        return arch, _ctas(arch, dim, overrides)
    return arch, {**A.default_config(arch, dim), **overrides}


def _ctas(arch, dim, n):
    """The tuning candidate of `arch` at head dim `dim` that asks for `n` CTAs per SM (None: it has none)."""
    return next((c for c in A.tune_candidates(arch, dim) if c.get("min_blocks", 1) == n), None)


def _gpu_mask(kind, b, hq, sq, skv):
    if kind is None:
        return None
    if kind == "add":
        return torch.randn(b, 1, sq, skv, device="cuda") * 3
    m = torch.rand(b, 1, 1, skv, device="cuda") > 0.3  # key padding style, broadcast over heads and rows
    m[0, ..., :] = False  # batch 0: every row fully masked -> zeros
    return m


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
def test_gpu_matches_reference(variant, dtype, case):
    arch = GPU_VARIANTS[variant][0]
    major, _ = torch.cuda.get_device_capability()
    if arch == "sm90" and major != 9:
        pytest.skip("sm90 variant needs a Hopper GPU")
    if not gpu_case_enabled(dtype, case, variant):
        pytest.skip("dtype checked on a subset of cases (keeps device compile time down)")
    b, hq, hkv, sq, skv, d, causal, layout, mk = GPU_CASES[case]
    _, config = gpu_variant_config(variant, dtype, d)
    torch.manual_seed(hash(case) % 1000)
    q, k, v = _qkv(b, hq, hkv, sq, skv, d, layout=layout, dtype=dtype, device="cuda")
    mask = _gpu_mask(mk, b, hq, sq, skv)
    out = torch.full_like(q, float("nan"))
    flash_attention(q, k, v, causal=causal, mask=mask, layout=layout, out=out, arch=arch, config=config)
    torch.cuda.synchronize()
    ref = flash_attention_ref(q.float(), k.float(), v.float(), causal=causal, mask=mask, layout=layout)
    tol = 1e-2
    assert _rel(out, ref) < tol
    if mk == "bool":
        assert (out[0] == 0).all()


@pytest.mark.gpu
def test_gpu_dynamic_lengths_share_one_kernel():
    q, k, v = _qkv(1, 4, 4, 100, 100, 64, dtype=torch.float16, device="cuda")
    flash_attention(q, k, v)
    misses = A.compile_gpu.cache_info().misses
    for sq, skv in [(1, 513), (777, 64)]:
        q, k, v = _qkv(3, 4, 4, sq, skv, 64, dtype=torch.float16, device="cuda")
        out = flash_attention(q, k, v)
        ref = flash_attention_ref(q.float(), k.float(), v.float())
        assert _rel(out, ref) < 1e-2
    assert A.compile_gpu.cache_info().misses == misses


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sm90", "sm80"])
def test_gpu_mha_projection_heads_read_in_place(variant):
    """q / k / v as nn.MultiheadAttention makes them (heads of (seq, batch, embed) projections): read through
    SBHD indexing (TMA descriptors with the batch-dependent seq stride on sm90), GQA, lengths off the tile."""
    major, _ = torch.cuda.get_device_capability()
    if variant == "sm90" and major != 9:
        pytest.skip("sm90 variant needs a Hopper GPU")
    torch.manual_seed(13)
    b, h, hkv, sq, skv, d = 3, 8, 2, 200, 333, 64
    dev = dict(dtype=torch.float16, device="cuda")
    q = torch.randn(sq, b, h * d, **dev).view(sq, b, h, d).permute(1, 2, 0, 3)
    k, v = (torch.randn(skv, b, hkv * d, **dev).view(skv, b, hkv, d).permute(1, 2, 0, 3) for _ in range(2))
    assert A.kernel_layouts(q, k, v, "bhsd")[0] == ("sbhd", "sbhd", "sbhd", "bhsd")
    for causal in (False, True):
        out = flash_attention(q, k, v, causal=causal, arch=variant)
        torch.cuda.synchronize()
        assert _rel(out, flash_attention_ref(q.float(), k.float(), v.float(), causal=causal)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("s", [333, 16])
def test_gpu_packed_qkv_heads_read_in_place(s):
    """GPT-2's q / k / v, heads of one packed projection (rows 3 * H * D apart), read in place by the sm90
    program through run-time strides, causal with a key padding mask and without, lengths off the tile; at 16
    keys every CTA has one partial key block (the backend's tiny decoder on the H200, 2026-12-02), the last batch
    row keeping every key (the Kept path) and the first right-padded."""
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip("sm90 variant needs a Hopper GPU")
    torch.manual_seed(14)
    b, h, d = 3, 12, 64
    qkv = torch.randn(b, s, 3 * h * d, dtype=torch.float16, device="cuda")
    q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=2))
    assert A.kernel_layouts(q, k, v, "bhsd", strided=True)[0] == ("bshd", "bshd", "bshd", "bhsd")
    keys = torch.rand(b, 1, 1, s, device="cuda") > 0.2
    keys[0, ..., -4:], keys[-1] = False, True
    for variant in ("sm90", *CTAS_VARIANTS):
        config = gpu_variant_config(variant, torch.float16, d)[1]
        for causal, mask in ((True, keys), (True, None), (False, keys)):
            out = flash_attention(q, k, v, causal=causal, mask=mask, arch="sm90", config=config)
            torch.cuda.synchronize()
            ref = flash_attention_ref(q.float(), k.float(), v.float(), causal=causal, mask=mask)
            assert _rel(out, ref) < 1e-2, (variant, causal, mask is not None)


# (mask kind, mask_scale, mask_fill, guard, causal, mask_keeps): what FusedAttention reproduces from graphs
GPU_SEMANTICS = {
    "finite-fill-rows": ("bool", 1.0, -1e4, "masked", True, True),
    "finfo-fill": ("bool", 1.0, float(torch.finfo(torch.float32).min), "none", False, True),
    "scaled-mask": ("add", 0.125, float("-inf"), "masked", False, True),
    "nan-rows": ("bool", 1.0, float("-inf"), "none", False, True),
    "nan-guard-masked-fill": ("bool", 1.0, float("-inf"), "nan", True, False),
    "late-keys": ("add-late", 1.0, float("-inf"), "masked", False, True),
    # key-only masks (B, 1, 1, Skv), read once per key block: key padding as the decoders' causal split leaves it
    "keys-finite-fill-causal": ("bool-keys", 1.0, -1e4, "masked", True, True),
    "keys-masked-fill-nan-guard": ("bool-keys", 1.0, float("-inf"), "nan", False, False),
    "keys-scaled-add-causal": ("add-keys", 0.125, float("-inf"), "masked", True, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_SEMANTICS))
@pytest.mark.parametrize("variant", ["sm90", *CTAS_VARIANTS, "sm80"])
def test_gpu_semantics_match_reference(variant, case):
    """Finite fills (a fully masked row weighs its own keys equally: not the padding of the partial last key
    block, not keys after the query), a scaled additive mask, NaN rows under plain softmax and the NaN guard,
    masked_fill's mask (True masks), finite keys after all -inf blocks (shifted by their own max), on both
    archs (fp16, D=64, lengths not multiples of a tile); and those of key-only masks, which the kernels read per
    key block, not per score."""
    arch, config = gpu_variant_config(variant, torch.float16, 64)
    major, _ = torch.cuda.get_device_capability()
    if arch == "sm90" and major != 9:
        pytest.skip("sm90 variant needs a Hopper GPU")
    kind, mask_scale, fill, guard, causal, keeps = GPU_SEMANTICS[case]
    torch.manual_seed(11)
    rows = 1 if kind.endswith("-keys") else 150
    b = 3 if rows == 1 else 2  # key-only: batch 2 keeps every key (a row the kernels read no mask for)
    q, k, v = _qkv(b, 4, 2, 150, 211, 64, dtype=torch.float16, device="cuda")
    if kind.startswith("add"):
        mask = torch.randn(b, 1, rows, 211, device="cuda") * 4
        if kind == "add-late":  # the first key blocks all -inf, later keys finite but far below 0
            mask[..., :160] = float("-inf")
            mask[..., 160:] -= 1e4
        if kind == "add-keys":
            mask[1, ..., 100:180] = float("-inf")
            mask[2] = 0
    else:
        mask = torch.rand(b, 1, rows, 211, device="cuda") > 0.4
        if rows == 1:
            mask[0] = not keeps  # batch 0: every key masked
            mask[2] = keeps
        else:
            mask[0, 0, 7] = False  # every key of row 7 masked
            mask[1, 0, 140:] = False  # rows in the last query block
    if guard == "nan":
        q[1, 2, 33, 5] = float("nan")
    kw = dict(causal=causal, mask=mask, mask_scale=mask_scale, mask_fill=fill, guard=guard, mask_keeps=keeps)
    out = flash_attention(q, k, v, arch=arch, config=config, **kw)
    torch.cuda.synchronize()
    ref = flash_attention_ref(q.float(), k.float(), v.float(), **kw)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2, equal_nan=True)
