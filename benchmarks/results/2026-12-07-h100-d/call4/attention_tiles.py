"""Call 4's one-off script: BERT-base 16x512's attention node (fp16, D=64, "bshd"), each tile config as CUDA-graph
replays against SDPA's, with and without the node's key padding mask (its per-row summary computed once, as the
model does). Run from the repository root on the device: `python <this file>`; `--prof` runs each kernel once
between cudaProfilerStart/Stop, for `ncu --profile-from-start off` (not reached on 2026-12-07)."""

import os
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.getcwd())
from tkopt.cuda_graphs import capture  # noqa: E402
from tkopt.kernels import attention as A  # noqa: E402
from tkopt.kernels import gemm  # noqa: E402

B, H, S, D = 16, 12, 512, 64
BASE = dict(block_M=64, block_N=128, num_stages=2, threads=128, pipelined=True, min_blocks=2)
VARIANTS = {
    "base": BASE,
    "s3": {**BASE, "num_stages": 3},
    "s1": {**BASE, "num_stages": 1},
    "n64": {**BASE, "block_N": 64},
    "plain": {**BASE, "pipelined": False},
    "64x64mb3": {**BASE, "block_N": 64, "min_blocks": 3},
}


def main() -> None:
    prof = "--prof" in sys.argv
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda")
    kept = A.kept_rows(mask)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2).float()

    def ours(cfg, mk):
        return A.flash_attention(q, k, v, mask=mk, kept=None if mk is None else kept, layout="bshd", arch="sm90",
                                 config=cfg)

    if prof:
        a = torch.randn(8192, 768, device="cuda", dtype=torch.float16)
        w = torch.randn(3072, 768, device="cuda", dtype=torch.float16) / 30
        bias = torch.randn(3072, device="cuda", dtype=torch.float16)
        fns = [lambda: ours(BASE, None), lambda: ours(BASE, mask), lambda: F.scaled_dot_product_attention(qt, kt, vt),
               lambda: gemm(a, w, bias, act="gelu", b_transposed=True), lambda: F.linear(a, w, bias)]
        for fn in fns * 2:
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    for name, cfg in VARIANTS.items():
        for mk in (None, mask) if name == "base" else (None,):
            label = f"{name} {'keys' if mk is not None else 'nomask'}"
            try:
                t0 = time.time()
                out = ours(cfg, mk)
                torch.cuda.synchronize()
                first_s = time.time() - t0
                graph, _ = capture(lambda cfg=cfg, mk=mk: ours(cfg, mk), q.device)
                ms = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row = dict(us=round(ms * 1000, 1), err=f"{err:.1e}", compile_s=round(first_s, 1))
            except Exception as e:  # noqa: BLE001 - one failure must not lose the other rows
                row = dict(failed=repr(e)[:300])
            print(label, row, flush=True)
    graph, _ = capture(lambda: F.scaled_dot_product_attention(qt, kt, vt), q.device)
    ms = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
    print("sdpa nomask", round(ms * 1000, 1))


if __name__ == "__main__":
    main()
