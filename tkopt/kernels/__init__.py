"""tkopt.kernels: TileLang kernels per pattern and per arch (sm90, sm80, cpu), torch tensors in and out.

Names resolve lazily so that importing the package does not import TileLang until a kernel is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TileConfig": "config",
    "gemm": "gemm_epilogue",
    "gemm_custom": "gemm_epilogue",
    "gated_mlp": "gated_gemm",
    "gemm_group": "grouped_gemm",
    "flash_attention": "attention",
    "add_layer_norm": "norm",
    "add_rms_norm": "norm",
    "layer_norm": "norm",
    "rms_norm": "norm",
    "softmax": "row_softmax",
    "conv2d": "conv",
    "UnsupportedError": "arch",
    "matmul_precision": "precision",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tkopt.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
