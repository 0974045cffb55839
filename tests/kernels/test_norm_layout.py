"""Register layout of the row-resident GPU kernels (add+norm, softmax): lowering only, no GPU.

Each CTA holds `block_rows` rows of np_ (n padded) fp32 values in the fragment `s` (and `d` for the norms); row i
lives on its own `threads_per_row` threads, so a thread holds block_rows * np_ / threads = np_ / threads_per_row
registers and the row statistics are all-reduces over threads_per_row threads. Left to itself, TileLang's layout
inference dealt the flattened (row, chunk) index round-robin over all the CTA's threads; where a row's chunk count and
the thread count do not divide one another (n=768 fp16: 96 chunks a row, 4 rows on 128 threads) it fell back to a
replicated layout: every thread held a whole row (`float s[768];`), the reductions were serial 768-long loops, 32x the
work plus local-memory spills (0.77 ms for add+LN 4096x768 fp16 on the H200). Where they divide, multi-row CTAs got
rows interleaved over all the CTA's threads (n=1024 fp16, 2 rows: 128-thread all-reduces instead of 64). The kernels
now annotate the layout (norm.row_fragment); these tests read the per-thread array sizes and the all-reduce widths
back from the lowered CUDA source.
"""

import re

import pytest
from conftest import cuda_compile, global_access_widths, lower_cuda

from tkopt.kernels.norm import _ceil_to, default_norm_config, norm_candidates, norm_program_gpu
from tkopt.kernels.row_softmax import softmax_program_gpu

SIZES = [256, 768, 1000, 1024, 2048, 3072, 4096, 5120]  # 1000: padded to 1024 and column-guarded
ARCHS = ["sm90", "sm80"]
_ELEM = {"float16": 2, "bfloat16": 2, "float32": 4}


def _per_thread(n: int, dtype: str, cfg: dict) -> int:
    """block_rows * np_ / threads: the registers per thread of a (block_rows, np_) fragment without replication."""
    vec = 16 // _ELEM[dtype]
    tpr = cfg["threads_per_row"]
    np_ = _ceil_to(n, vec * tpr)
    return cfg["block_rows"] * np_ // (cfg["block_rows"] * tpr)


def _check_layout(src: str, names: tuple[str, ...], n: int, dtype: str, cfg: dict) -> None:
    want = _per_thread(n, dtype, cfg)
    for name in names:
        decls = [int(x) for x in re.findall(rf"\bfloat {name}\[(\d+)\];", src)]
        assert decls == [want], (
            f"n={n} {dtype} {cfg}: fragment {name!r} declared {decls} per thread, want [{want}] "
            f"(a whole padded row, {_ceil_to(n, 16 // _ELEM[dtype] * cfg['threads_per_row'])}, is a replicated layout)")
    # every row statistic is an all-reduce over the row's own threads_per_row threads: not a serial loop over a
    # whole row (replicated), nor an all-reduce over a wider group (rows interleaved over all the CTA's threads)
    widths = re.findall(r"tl::AllReduce<tl::\w+Op, (\d+),", src)
    assert widths and set(widths) == {str(cfg["threads_per_row"])}, (
        f"n={n} {dtype} {cfg}: all-reduce widths {widths}, want {cfg['threads_per_row']} (threads_per_row)")


def _norm(kind: str, n: int, dtype: str, w_dtype: str, cfg: dict):
    return norm_program_gpu(kind, n, dtype, w_dtype, has_residual=True, has_weight=True, has_bias=kind == "layer",
                            write_sum=kind == "layer", eps=1e-5, **cfg)


# (kind, n, dtype, w_dtype): add+LN with the sum (BERT's op) at every size, plus RMSNorm in fp32 / bf16+fp32 weight
NORM_CASES = [("layer", n, "float16", "float16") for n in SIZES] + [
    ("rms", 768, "float32", "float32"),
    ("rms", 1000, "bfloat16", "float32"),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind,n,dtype,w_dtype", NORM_CASES)
def test_norm_fragment_not_replicated(kind, n, dtype, w_dtype, arch):
    cfg = default_norm_config(n, _ELEM[dtype], arch)
    _check_layout(lower_cuda(_norm(kind, n, dtype, w_dtype, cfg), arch), ("s", "d"), n, dtype, cfg)


def test_norm_tuning_candidates_not_replicated():
    """The autotuner's configs too: n=3072 fp32 is one row of 256 threads by default (fine
    before the fix), but its candidate with 2 rows of 256 threads was replicated."""
    for cfg in norm_candidates(3072, 4, "sm90"):
        src = lower_cuda(_norm("layer", 3072, "float32", "float32", cfg), "sm90")
        _check_layout(src, ("s", "d"), 3072, "float32", cfg)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n,dtype", [(n, "float16") for n in SIZES] + [(768, "float32")])
def test_softmax_fragment_not_replicated(n, dtype, arch):
    cfg = default_norm_config(n, _ELEM[dtype], arch)
    _check_layout(lower_cuda(softmax_program_gpu(n, dtype, **cfg), arch), ("s",), n, dtype, cfg)


def test_bert_base_add_layer_norm_builds_without_spills():
    """add+LN fp16 n=768 (BERT-base), sm90: every global access 128-bit, and ptxas reports no spills (the replicated
    layout spilled two 768-float arrays per thread to local memory)."""
    cfg = default_norm_config(768, 2, "sm90")
    src = lower_cuda(_norm("layer", 768, "float16", "float16", cfg), "sm90")
    assert global_access_widths(src) == {b: {"uint4"} for b in "XRWBYS"}
    build = cuda_compile(src, "sm90")
    assert build.spills and max(build.spills) == 0, build.log[-2000:]
    assert max(build.registers) <= 128, build.registers


def _load_conditions(src: str) -> list[str]:
    """The `if` conditions ahead of a row kernel's first all-reduce and first store (the sum's): where its loads
    sit."""
    end = min(src.index(mark) for mark in ("tl::AllReduce", "S_local_cast") if mark in src)
    return re.findall(r"if \((.*)\) \{", src[:end])


@pytest.mark.parametrize("n", [768, 1024, 4096])
def test_row_loads_do_not_depend_on_the_row_guard(n):
    """Multi-row CTAs read a padding row (past m) as row m - 1 (norm.read_row) instead of predicating each load on
    its row: under the predicate, ptxas issued a chunk's loads only after the previous chunk's had arrived (n=768
    fp16, sm90: two round trips to memory). So no condition ahead of the statistics depends on the thread, where
    the row is not padded in its columns (n a multiple of the CTA's 16-byte chunks); the stores keep their guard."""
    for cfg in norm_candidates(n, 2, "sm90"):
        if cfg["block_rows"] == 1:
            continue
        for src in (lower_cuda(_norm("layer", n, "float16", "float16", cfg), "sm90"),
                    lower_cuda(softmax_program_gpu(n, "float16", **cfg), "sm90")):
            assert _load_conditions(src) and not any("threadIdx" in c for c in _load_conditions(src)), cfg
            assert "min(" in src[: src.index("tl::AllReduce")]
            assert re.search(r"if \(.*threadIdx.*< m\)", src), "the stores of padding rows stay guarded"
