"""One-off: the D=64 attention nodes with four CTAs per SM (64x64, a 24/104 register split; ptxas spills 48 bytes
a thread there) beside the tuned three-CTA tile and SDPA, as CUDA-graph replays in one process, through
`../2026-12-07-e/arch_tiles.py`'s timing. Run from the repository root on the device: `python <this file>`."""

import os
import sys

import torch

sys.path[:0] = [os.getcwd(), os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-07-e")]
import arch_tiles  # noqa: E402

arch_tiles.SM90 = {
    "sm90 64x64 mb3": dict(block_M=64, block_N=64, num_stages=2, threads=128, pipelined=True, min_blocks=3),
    "sm90 64x64 mb4": dict(block_M=64, block_N=64, num_stages=2, threads=128, pipelined=True, min_blocks=4),
}
CASES = [
    ("bert 16x512", 16, 12, 12, 512, 64, False),
    ("gpt2 8x1024 causal", 8, 12, 12, 1024, 64, True),
    ("d64 8x2048", 8, 16, 16, 2048, 64, False),
    ("d64 8x2048 causal", 8, 16, 16, 2048, 64, True),
]

if __name__ == "__main__":
    torch.manual_seed(0)
    for case in CASES:
        arch_tiles.run_case(*case, False, False)
