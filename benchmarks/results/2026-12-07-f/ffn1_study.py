"""One-off: where BERT-base 16x512's intermediate GEMM (8192x3072x768 fp16, bias, exact GELU) loses its time. Each
sm90 schedule of the tuning space, with no activation, ReLU, the tanh GELU and the exact GELU, timed as CUDA-graph
replays (medians of events) beside cuBLAS's matmul + bias in the same process; the difference between an
activation's time and the same schedule's time without one is what its epilogue costs there.
Run from the repository root on the device: `python <this file> [--ncu]` (`--ncu`: each kernel once, for
`ncu --clock-control none -k regex:gemm_kernel`, after a timed run has filled the kernel cache)."""

import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.getcwd())
from tkopt.cuda_graphs import capture  # noqa: E402
from tkopt.kernels.config import TileConfig  # noqa: E402
from tkopt.kernels.gemm_epilogue import gemm_custom, precompile  # noqa: E402

M, N, K = 8192, 3072, 768
SMS = 132
SCHEDULES = {
    "coop 128x192 s4": TileConfig((128, 192, 64), warp_tile=(16, 192), stages=4, threads=256, overlap=True,
                                  persistent=SMS),
    "coop 128x128 s4": TileConfig((128, 128, 64), warp_tile=(16, 128), stages=4, threads=256, overlap=True,
                                  persistent=SMS),
    "pingpong 128x128 s4": TileConfig((128, 128, 64), warp_tile=(32, 128), stages=4, threads=256, overlap=True,
                                      persistent=SMS, pingpong=True),
    "pingpong 64x256 s3": TileConfig((64, 256, 64), warp_tile=(16, 256), stages=3, threads=256, overlap=True,
                                     persistent=SMS, pingpong=True),
    "tilelang 128x256 s3": TileConfig((128, 256, 64), stages=3, threads=256),
}
ACTS = (None, "relu", "gelu_tanh", "gelu")


def bench(fn) -> float:
    graph, _ = capture(fn, torch.device("cuda"))
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1000


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) / K**0.5
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    keys = [("sm90", N, K, torch.float16, c, True, True, a, False, False, None)
            for c in SCHEDULES.values() for a in ACTS]
    failed = {k[4]: e for k, (_, e) in precompile(keys).items() if e}
    if "--ncu" in sys.argv:
        for c in SCHEDULES.values():
            for a in ("gelu", None):
                if c not in failed:
                    gemm_custom(x, w, c, b, a, None, True)
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}  {M}x{N}x{K} fp16 + bias, us (CUDA-graph replays, medians)")
    ref = {a: gemm_custom(x, w, SCHEDULES["coop 128x192 s4"], b, a, None, True).float() for a in ACTS}
    anchors = {"cuBLAS addmm": bench(lambda: torch.addmm(b, x, w.t())),
               "cuBLAS addmm + eager gelu": bench(lambda: torch.nn.functional.gelu(torch.addmm(b, x, w.t())))}
    for k, v in anchors.items():
        print(f"{k}: {v:.1f}")
    print("| schedule | " + " | ".join(str(a) for a in ACTS) + " | gelu - none |")
    print("|---" * (len(ACTS) + 2) + "|")
    for name, c in SCHEDULES.items():
        if c in failed:
            print(f"| {name} | failed: {str(failed[c])[:150]} |")
            continue
        t = {}
        for a in ACTS:
            y = gemm_custom(x, w, c, b, a, None, True).float()
            err = ((y - ref[a]).abs().max() / ref[a].abs().max()).item()
            assert err < 1e-2, (name, a, err)
            t[a] = bench(lambda c=c, a=a: gemm_custom(x, w, c, b, a, None, True))
        print(f"| {name} | " + " | ".join(f"{t[a]:.1f}" for a in ACTS) + f" | {t['gelu'] - t[None]:.1f} |")


if __name__ == "__main__":
    main()
