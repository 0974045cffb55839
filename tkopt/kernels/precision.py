"""fp32 GEMM precision: what torch's switch allows, read the way `A @ B` reads it.

cuBLAS runs an fp32 matmul on TF32 tensor cores exactly when torch's CUDA matmul precision resolves to
"tf32" (`torch.backends.cuda.matmul.fp32_precision`, set by `torch.set_float32_matmul_precision("high")`
or "medium", by `torch.backends.cuda.matmul.allow_tf32 = True`, or by the new per-backend API);
otherwise (torch's default, "highest") it computes in full fp32. tkopt's fp32 GEMMs follow the same
switch, read at call time: "tf32" lets the kernel use one TF32 product, "ieee" needs full fp32
accuracy (three TF32 products of split operands, or FMA on CUDA cores; `TileConfig.math` says which).
The precision is part of every compile and tuning key.
"""

from __future__ import annotations

import torch

PRECISIONS = ("ieee", "tf32")


def matmul_precision() -> str:
    """"tf32" if torch lets fp32 CUDA matmuls use TF32 now, else "ieee".

    >>> from tkopt.kernels import matmul_precision
    >>> matmul_precision()  # torch's default, "highest"
    'ieee'
    """
    getter = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # torch >= 2.9
    if getter is not None:
        return "tf32" if getter == "tf32" else "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
