"""One-off: the exact GELU epilogue of BERT-base 16x512's intermediate GEMM (8192x3072x768 fp16 + bias), its
polynomial log2 Phi(-|x|) (activations._LOG2_PHI_NEG, degree 10, and _LOG2_PHI_NEG_16, degree 6) evaluated by
Horner's rule (one chain of dependent FFMAs, what activations._gelu_fp32 does) or as even and odd halves in y^2 (two
chains, one more FMUL), on the tuned cooperative and the pingpong schedule. Timed as CUDA-graph replays (medians of
events) beside the same schedules with no activation and cuBLAS's matmul + bias, in one process. The question: does
a shorter chain let the pingpong schedule hide its epilogue behind the other warpgroup's K loop? Run from the
repository root on the device: `python <this file> [pingpong|coop]` (those schedules only)."""

import functools
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.getcwd())
from tkopt.cuda_graphs import capture  # noqa: E402
from tkopt.kernels import activations  # noqa: E402
from tkopt.kernels import gemm_epilogue as G  # noqa: E402
from tkopt.kernels.config import TileConfig  # noqa: E402
from tkopt.kernels.constants import const  # noqa: E402
from tkopt.kernels.reference import gemm_ref  # noqa: E402

M, N, K = 8192, 3072, 768
SHIPPED = activations._gelu_fp32
COMPILE = G.gpu_compile


def schedules(sms: int) -> dict[str, TileConfig]:
    """The tuned cooperative schedule and the pingpong one, persistent over `sms` SMs."""
    return {
        "coop 128x192 s4": TileConfig((128, 192, 64), warp_tile=(16, 192), stages=4, threads=256, overlap=True,
                                      persistent=sms),
        "pingpong 128x128 s4": TileConfig((128, 128, 64), warp_tile=(32, 128), stages=4, threads=256, overlap=True,
                                          persistent=sms, pingpong=True),
    }


def split(y, coeffs, f32):
    """coeffs' polynomial in y as odd(y^2) y + even(y^2)."""
    y2 = y * y
    halves = []
    for part in (coeffs[0::2], coeffs[1::2]):
        p = f32(part[-1])
        for c in reversed(part[:-1]):
            p = p * y2 + f32(c)
        halves.append(p)
    return halves[1] * y + halves[0]


def split_gelu(x, coeffs, cuda):
    """activations._gelu_fp32 with its polynomial split in halves."""
    import tilelang.language as T

    f32 = functools.partial(const, dtype="float32")
    y = T.min(T.abs(x), f32(activations._GELU_TAIL))
    p = split(y, coeffs, f32)
    pos = x >= f32(0.0)
    s = T.Select(pos, f32(1.0), f32(0.0))
    k = T.Select(pos, f32(-1.0), T.Select(x < f32(-activations._GELU_TAIL), f32(0.0), f32(1.0)))
    return x * (s + k * T.exp2(p))


FORMS = {  # name: (_gelu_fp32 replacement, its coefficients)
    "horner 10": (SHIPPED, activations._LOG2_PHI_NEG),
    "split 10": (split_gelu, activations._LOG2_PHI_NEG),
    "horner 6 (shipped)": (SHIPPED, activations._LOG2_PHI_NEG_16),
    "split 6": (split_gelu, activations._LOG2_PHI_NEG_16),
}


def bench(fn) -> float:
    graph, _ = capture(fn, torch.device("cuda"))
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1000


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16) * 2
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) / K**0.5
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    ref = gemm_ref(x[:512].double(), w.double(), b.double(), "gelu", b_transposed=True)
    print(f"{torch.cuda.get_device_name()}  {M}x{N}x{K} fp16 + bias, us (CUDA-graph replays, medians); "
          f"inputs x2 so that the GELU sees its tails")
    print(f"cuBLAS addmm: {bench(lambda: torch.addmm(b, x, w.t())):.1f}")
    print(f"cuBLAS addmm + eager GELU: {bench(lambda: torch.nn.functional.gelu(torch.addmm(b, x, w.t()))):.1f}")
    print("| schedule | none | " + " | ".join(FORMS) + " |")
    print("|---|---|" + "---|" * len(FORMS))
    for name, c in schedules(torch.cuda.get_device_properties(0).multi_processor_count).items():
        if sys.argv[1:] and not name.startswith(sys.argv[1]):
            continue
        row = [f"{bench(lambda c=c: G.gemm_custom(x, w, c, b, None, None, True)):.1f}"]
        for form, (fn, coeffs) in FORMS.items():
            activations._gelu_fp32 = lambda v, _c, cuda, fn=fn, coeffs=coeffs: fn(v, coeffs, cuda)
            # a kernel's library is found by its arguments and tkopt's sources: name the form in them too
            G.gpu_compile = lambda ident, *a, form=form: COMPILE((*ident, form), *a)
            G._CACHE.clear()
            y = G.gemm_custom(x, w, c, b, "gelu", None, True)
            err = ((y[:512].double() - ref).abs().max() / ref.abs().max()).item()
            t = bench(lambda c=c: G.gemm_custom(x, w, c, b, "gelu", None, True))
            row.append(f"{t:.1f} (err {err:.1e})")
            print(f"  {name}, {form}: {row[-1]} (none: {row[0]})", flush=True)
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
