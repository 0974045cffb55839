"""One-off: the attention nodes of the benchmark models (fp16) and the issue's kernel-bar shapes, timed as CUDA-graph
replays for the sm90 program's tiles and for the sm80 program's (mma.sync, cp.async: FlashAttention-2's shape) on
the same Hopper card, against SDPA in the same process. Error: relative to float32 attention of the same inputs.
Run from the repository root on the device: `python <this file> [--compile-only] [--sm90] [case ...]` (`--compile-only`:
build each kernel once, so that processes started per case fill the kernel cache in parallel before one times;
`--sm90`: the sm90 program's tiles only; `--d128-tiles`: every sm90 candidate at D=128)."""

import os
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.getcwd())
from tkopt.cuda_graphs import capture  # noqa: E402
from tkopt.kernels import attention as A  # noqa: E402

SM90 = {
    "sm90 64x128 mb2": dict(block_M=64, block_N=128, num_stages=2, threads=128, pipelined=True, min_blocks=2),
    "sm90 64x64 mb3": dict(block_M=64, block_N=64, num_stages=2, threads=128, pipelined=True, min_blocks=3),
    "sm90 128x128": dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=True),
}
# D=128 (call 3): the other two sm90 tuning candidates at that head dim.
SM90_D128 = {
    "sm90 128x128": SM90["sm90 128x128"],
    "sm90 128x176": dict(block_M=128, block_N=176, num_stages=2, threads=256, pipelined=True),
    "sm90 128x128 plain": dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=False),
}
SM80 = {
    "sm80 128x64": dict(block_M=128, block_N=64, num_stages=1, threads=256),
    "sm80 128x128": dict(block_M=128, block_N=128, num_stages=1, threads=256),
    "sm80 64x64": dict(block_M=64, block_N=64, num_stages=1, threads=128),
    "sm80 64x128": dict(block_M=64, block_N=128, num_stages=1, threads=128),
}
# (name, B, Hq, Hkv, S, D, causal)
CASES = [
    ("bert 16x512", 16, 12, 12, 512, 64, False),
    ("gpt2 8x1024 causal", 8, 12, 12, 1024, 64, True),
    ("d128 8x2048", 8, 16, 16, 2048, 128, False),
    ("d128 8x2048 causal", 8, 16, 16, 2048, 128, True),
    ("gqa 4x2048 32/8 causal", 4, 32, 8, 2048, 128, True),
]


def bench(fn) -> float:
    graph, _ = capture(fn, torch.device("cuda"))
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1000


def run_case(name: str, b: int, hq: int, hkv: int, s: int, d: int, causal: bool, compile_only: bool,
             sm80: bool) -> None:
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    d128 = SM90_D128 if "--d128-tiles" in sys.argv else {"sm90 128x128": SM90["sm90 128x128"]}
    tiles = {**(SM90 if d == 64 else d128), **(SM80 if sm80 else {})}

    def ours(arch: str, cfg: dict) -> torch.Tensor:
        return A.flash_attention(q, k, v, causal, layout="bshd", arch=arch, config=cfg)

    if compile_only:
        for label, cfg in tiles.items():
            try:
                ours(label.split()[0], cfg)
            except Exception as e:  # noqa: BLE001 - the timing run reports it
                print(f"{name} {label}: failed {repr(e)[:200]}", flush=True)
        return
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), is_causal=causal,
                                         enable_gqa=hq != hkv).transpose(1, 2)
    sdpa = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv))
    flops = 4 * b * hq * s * s * d / (2 if causal else 1)
    print(f"{name}: sdpa {sdpa:.1f} us ({flops / sdpa / 1e6:.0f} TFLOP/s)", flush=True)
    for label, cfg in tiles.items():
        arch = label.split()[0]
        try:
            t0 = time.time()
            out = ours(arch, cfg)
            torch.cuda.synchronize()
            first = time.time() - t0
            us = bench(lambda cfg=cfg, arch=arch: ours(arch, cfg))
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"  {label}: {us:.1f} us  {sdpa / us:.2f}x sdpa  err {err:.1e}  first {first:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the other rows
            print(f"  {label}: failed {repr(e)[:300]}", flush=True)


def main() -> None:
    flags = {"--compile-only", "--sm90", "--d128-tiles"}
    only = [a for a in sys.argv[1:] if a not in flags]
    torch.manual_seed(0)
    for name, *shape in CASES:
        if not only or name in only:
            run_case(name, *shape, "--compile-only" in sys.argv, "--sm90" not in sys.argv)


if __name__ == "__main__":
    main()
