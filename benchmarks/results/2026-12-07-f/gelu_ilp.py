"""One-off: the exact GELU epilogue of BERT-base 16x512's intermediate GEMM (8192x3072x768 fp16 + bias) with its
polynomial evaluated three ways, on the cooperative and the pingpong schedule, timed as CUDA-graph replays
(medians of events) beside the same schedules with no activation and cuBLAS's matmul + bias, in one process.
`horner`: activations._gelu_fp32 as of 2026-12-07 (one chain of 10 dependent FFMAs an element); `split`: the
same coefficients as even and odd halves in y^2 (two chains of 5 and 4, one more FMUL); `estrin`: Estrin's scheme
(depth 4, three more instructions). Run from the repository root on the device: `python <this file> [pingpong|coop]`
(those schedules only)."""

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


def schedules(sms: int) -> dict[str, TileConfig]:
    """The tuned cooperative schedule and the pingpong one, persistent over `sms` SMs."""
    return {
        "coop 128x192 s4": TileConfig((128, 192, 64), warp_tile=(16, 192), stages=4, threads=256, overlap=True,
                                      persistent=sms),
        "pingpong 128x128 s4": TileConfig((128, 128, 64), warp_tile=(32, 128), stages=4, threads=256, overlap=True,
                                          persistent=sms, pingpong=True),
    }


C = activations._LOG2_PHI_NEG


def _gelu(x, poly):
    import tilelang.language as T

    f32 = functools.partial(const, dtype="float32")
    y = T.min(T.max(x, -x), f32(activations._GELU_TAIL))
    p = poly(y, f32)
    pos = x >= f32(0.0)
    s = T.Select(pos, f32(1.0), f32(0.0))
    k = T.Select(pos, f32(-1.0), T.Select(x < f32(-activations._GELU_TAIL), f32(0.0), f32(1.0)))
    return x * (s + k * T.exp2(p))


def horner(y, f32):
    p = f32(C[-1])
    for c in reversed(C[:-1]):
        p = p * y + f32(c)
    return p


def split(y, f32):
    y2 = y * y
    even = f32(C[10])
    for c in (C[8], C[6], C[4], C[2], C[0]):
        even = even * y2 + f32(c)
    odd = f32(C[9])
    for c in (C[7], C[5], C[3], C[1]):
        odd = odd * y2 + f32(c)
    return odd * y + even


def estrin(y, f32):
    y2 = y * y
    y4 = y2 * y2
    q = [f32(C[i + 1]) * y + f32(C[i]) for i in range(0, 10, 2)]
    r0, r1, r2 = q[1] * y2 + q[0], q[3] * y2 + q[2], f32(C[10]) * y2 + q[4]
    return r2 * (y4 * y4) + (r1 * y4 + r0)


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
    print("| schedule | none | horner | split | estrin |")
    print("|---|---|---|---|---|")
    for name, c in schedules(torch.cuda.get_device_properties(0).multi_processor_count).items():
        if sys.argv[1:] and not name.startswith(sys.argv[1]):
            continue
        row = [f"{bench(lambda c=c: G.gemm_custom(x, w, c, b, None, None, True)):.1f}"]
        for poly in (horner, split, estrin):
            activations._gelu_fp32 = functools.partial(_gelu, poly=poly)
            G._CACHE.clear()
            y = G.gemm_custom(x, w, c, b, "gelu", None, True)
            err = ((y[:512].double() - ref).abs().max() / ref.abs().max()).item()
            t = bench(lambda c=c: G.gemm_custom(x, w, c, b, "gelu", None, True))
            row.append(f"{t:.1f} (err {err:.1e})")
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
