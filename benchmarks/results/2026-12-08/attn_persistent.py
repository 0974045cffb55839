"""One-off: the persistent attention schedule (gpu_program's `persistent`: resident CTAs walk the tiles, a TMA
producer warpgroup loading ahead across them) beside the non-persistent tiles and SDPA, as CUDA-graph replays in one
process, through `../2026-12-07-e/arch_tiles.py`'s timing. Run from the repository root on the device:
`python <this file> [case ...]`."""

import os
import sys

import torch

sys.path[:0] = [os.getcwd(), os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-07-e")]
import arch_tiles  # noqa: E402

SMS = torch.cuda.get_device_properties(0).multi_processor_count
D64 = {
    "sm90 64x64 mb3": dict(block_M=64, block_N=64, num_stages=2, threads=128, pipelined=True, min_blocks=3),
    "sm90 64x128 mb2": dict(block_M=64, block_N=128, num_stages=2, threads=128, pipelined=True, min_blocks=2),
    "sm90 persistent 128x128": dict(block_M=128, block_N=128, num_stages=2, threads=256, persistent=SMS),
    "sm90 persistent 128x128 s3": dict(block_M=128, block_N=128, num_stages=3, threads=256, persistent=SMS),
    "sm90 persistent 128x128 pingpong": dict(block_M=128, block_N=128, num_stages=2, threads=256, persistent=SMS,
                                             pingpong=True),
    "sm90 persistent 64x128 mb2": dict(block_M=64, block_N=128, num_stages=2, threads=128, min_blocks=2,
                                       persistent=2 * SMS),
    "sm90 persistent 64x64 mb3": dict(block_M=64, block_N=64, num_stages=2, threads=128, min_blocks=3,
                                      persistent=3 * SMS),
}
D128 = {
    "sm90 128x128": dict(block_M=128, block_N=128, num_stages=2, threads=256, pipelined=True),
    "sm90 persistent 128x128": dict(block_M=128, block_N=128, num_stages=2, threads=256, persistent=SMS),
    "sm90 persistent 128x128 pingpong": dict(block_M=128, block_N=128, num_stages=2, threads=256, persistent=SMS,
                                             pingpong=True),
    "sm90 persistent 128x64 s3": dict(block_M=128, block_N=64, num_stages=3, threads=256, persistent=SMS),
}
CASES = [*arch_tiles.CASES, ("d64 8x2048", 8, 16, 16, 2048, 64, False)]

if __name__ == "__main__":
    torch.manual_seed(0)
    only = sys.argv[1:]
    for name, *shape in CASES:
        if only and name not in only:
            continue
        arch_tiles.SM90 = D64 if shape[4] == 64 else D128
        arch_tiles.SM90_D128 = arch_tiles.SM90
        sys.argv[1:] = ["--d128-tiles"]
        arch_tiles.run_case(name, *shape, False, False)
