"""The static count in this README's "Where the D=64 kernel's time goes": the SASS instructions one consumer thread
runs in a steady-state step of BERT's attention kernel (64x128 tile, two CTAs per SM), from the wait for QK^T to
the wait for PV, with the tail block's masking skipped (a real branch). Run from the repository root on a machine
with nvcc (no GPU needed) and cuobjdump + nvdisasm on PATH (PyPI: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm):
`python <this file> nomask` or `keys` (the key padding mask whose every batch row keeps every key)."""

import collections
import re
import subprocess
import sys

sys.path[:0] = [".", "tests/kernels"]
from conftest import cuda_compile, lower_cuda  # noqa: E402

from tkopt.kernels import attention as A  # noqa: E402


def main(kind: str) -> None:
    mask = None if kind == "nomask" else "bool"
    bcast = (False, True, True, False) if mask else (False,) * 4
    config = dict(block_M=64, block_N=128, num_stages=2, threads=128, pipelined=True, min_blocks=2)
    func = A.gpu_program("float16", 64, 12, 12, False, ("bshd",) * 4, mask, bcast, None, kept_rows=bool(mask),
                         strided_qkv=A.reads_strided("sm90"), **config)
    src = lower_cuda(func, "sm90", A._pass_configs("sm90"))
    build = cuda_compile(src, "sm90", ("--use_fast_math",))  # the kernels build with tl.enable_fast_math
    sass = subprocess.run(["cuobjdump", "-sass", build.cubin], capture_output=True, text=True, check=True).stdout
    ins = [(int(m[1], 16), m[2].strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    start = next(i for i, (_, t) in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in t)
    # on a full block every branch before the softmax is taken: follow the last one
    jumps = [i for i in range(start, len(ins)) if re.match(r"@!?P\d BRA", ins[i][1])]
    first = start
    for i in jumps:
        if any(op.startswith("MUFU") for _, op in ins[first:i]):
            break
        target = int(ins[i][1].split()[-1], 16)
        first = next(k for k, (a, _) in enumerate(ins) if a == target)
    end = next(i for i in range(first, len(ins)) if "DEPBAR.LE gsb0, 0x0" in ins[i][1])
    ops = collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for _, t in ins[first:end])
    print(kind, end - first, "instructions:", ", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main(sys.argv[1])
