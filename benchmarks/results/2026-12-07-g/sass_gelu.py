"""The static count in this README's "SASS": the instructions the GELU adds to a thread of BERT-base 16x512's
intermediate GEMM (8192x3072x768 fp16 + bias) on sm90, per schedule, for the shipped epilogue (degree-6 fit for
16-bit outputs, fabsf) and the one before it (degree 10, |x| as max(x, -x)). Run from the repository root on a
machine with nvcc (no GPU needed) and cuobjdump on PATH (PyPI: nvidia-cuda-cuobjdump):
`python <this file> [coop|pingpong]`."""

import collections
import functools
import re
import subprocess
import sys

sys.path[:0] = [".", "tests/kernels"]
from conftest import cuda_compile, lower_cuda  # noqa: E402

from tkopt.kernels import activations  # noqa: E402
from tkopt.kernels import gemm_epilogue as G  # noqa: E402
from tkopt.kernels.config import TileConfig  # noqa: E402
from tkopt.kernels.constants import const  # noqa: E402

SCHEDULES = {
    "coop": TileConfig((128, 192, 64), warp_tile=(16, 192), stages=4, threads=256, overlap=True, persistent=132),
    "pingpong": TileConfig((128, 128, 64), warp_tile=(32, 128), stages=4, threads=256, overlap=True,
                           persistent=132, pingpong=True),
}
SHIPPED = activations._gelu_fp32


def before(x, _coeffs, _cuda):
    """activations._gelu_fp32 as of 2026-12-07-f: degree 10 whatever the output, |x| as max(x, -x)."""
    import tilelang.language as T

    f32 = functools.partial(const, dtype="float32")
    y = T.min(T.max(x, -x), f32(activations._GELU_TAIL))
    p = f32(activations._LOG2_PHI_NEG[-1])
    for c in reversed(activations._LOG2_PHI_NEG[:-1]):
        p = p * y + f32(c)
    pos = x >= f32(0.0)
    s = T.Select(pos, f32(1.0), f32(0.0))
    k = T.Select(pos, f32(-1.0), T.Select(x < f32(-activations._GELU_TAIL), f32(0.0), f32(1.0)))
    return x * (s + k * T.exp2(p))


def sass_ops(cfg: TileConfig, act: str | None) -> collections.Counter:
    func = G.gemm_program("sm90", 3072, 768, "float16", cfg, b_transposed=True, has_bias=True, act=act)
    build = cuda_compile(lower_cuda(func, "sm90", G.program_pass_configs(cfg)), "sm90", ("--use_fast_math",))
    sass = subprocess.run(["cuobjdump", "-sass", build.cubin], capture_output=True, text=True, check=True).stdout
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
    return collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in ins)


def main(names: list[str]) -> None:
    for name in names:
        cfg = SCHEDULES[name]
        plain = sass_ops(cfg, None)
        for label, fn in (("before", before), ("shipped", SHIPPED)):
            activations._gelu_fp32 = fn
            ops = sass_ops(cfg, "gelu")
            extra = sum(ops.values()) - sum(plain.values())
            elements = ops["MUFU"] - plain["MUFU"]  # one exp2 an element (pingpong: each warpgroup's copy)
            diff = {op: ops[op] - plain[op] for op in ops if ops[op] - plain[op] >= elements}
            print(f"{name} {label}: {extra} instructions over the plain kernel's {sum(plain.values())}, "
                  f"{extra / elements:.1f} an element ({elements} elements in the code); {diff}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SCHEDULES))
