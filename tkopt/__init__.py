"""tkopt: graph-level fusion optimizer (FX and ONNX graphs in, fused torch modules and ONNX models out).

Public names are imported lazily so that `import tkopt` stays cheap (no torch, no onnx). TileLang's log is
routed through Python logging from the moment it is imported (tkopt.logs), and `torch.compile(model,
backend="tkopt")` works from then on, installed or not (tkopt.backends.registration).
"""

from __future__ import annotations

import importlib
from typing import Any

from tkopt import logs
from tkopt.backends import registration

logs.install()
registration.install()

_LAZY = {
    "compile": "tkopt.torch_compile",
    "optimize_onnx": "tkopt.api",
    "compare_onnx": "tkopt.api",
    "AccuracyError": "tkopt.api",
    "import_onnx": "tkopt.frontends.onnx",
    "ModelLoadError": "tkopt.frontends.onnx",
    "export_onnx": "tkopt.backends.onnx_model",
    "run_model": "tkopt.onnx_runtime_ref",
    "last_report": "tkopt.report",
    "Report": "tkopt.report",
}

__all__ = sorted(_LAZY)


_SUBPACKAGES = ("ort", "kernels", "passes", "models")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES:  # tkopt.ort.InferenceSession(...) after a bare `import tkopt`
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tkopt' has no attribute {name!r}")
