"""Fused against unfused: per-output errors, one computation for numpy arrays and torch tensors alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# Max error relative to the output's largest magnitude that counts as a match, per output dtype.
TOLERANCES = {"float32": 1e-4, "float64": 1e-9, "float16": 1e-2, "bfloat16": 5e-2}
DEFAULT_TOLERANCE = 1e-4


@dataclass
class OutputError:
    """Fused vs unfused for one output. max_rel = max |fused - unfused| / max |unfused|."""

    name: str
    dtype: str
    shape: list[int]
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tolerance  # NaN compares False: never ok


@dataclass
class Accuracy:
    """Per-output errors and how each side ran (unfused: ORT; fused: "ort", "hybrid" or "reference")."""

    outputs: list[OutputError]  # per output, the worst error over all runs
    fused_runner: str
    unfused_runner: str = "ort"
    inputs: dict[str, list[int]] = field(default_factory=dict)  # input name -> shape, the first (example) run
    runs: list[dict[str, list[int]]] = field(default_factory=list)  # the input shapes of every run
    skipped: list[str] = field(default_factory=list)  # sizes the original would not run at, and why

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def checked(self) -> bool:
        """False when the original ran at no size tried: nothing was compared (`skipped` says why)."""
        return bool(self.runs)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for o, src in zip(d["outputs"], self.outputs, strict=True):
            o["ok"] = src.ok
        d["ok"] = self.ok
        return d


def _as_float64(x: Any) -> tuple[np.ndarray, str]:
    """An array or tensor as float64 numpy, and its dtype's name ("float32", "bfloat16", ...)."""
    if isinstance(x, np.ndarray | np.generic):
        a = np.asarray(x)
        return a.astype(np.float64), a.dtype.name
    import torch

    return x.detach().to("cpu", torch.float64).numpy(), str(x.dtype).removeprefix("torch.")


def output_error(name: str, got: Any, want: Any, dtype: str | None = None) -> OutputError:
    """max abs / max rel error (relative to the largest finite |want|) of `got` against `want`, in float64:
    NaN where `want` has NaN and the same infinity match, any other NaN is an infinite error. Arrays or
    tensors (`dtype` names the original dtype when they were upcast, e.g. bfloat16 held as float32); any
    other value (a Python scalar output) must be equal."""
    if not hasattr(want, "dtype") or not hasattr(want, "shape"):
        same = got == want
        err = 0.0 if same else float("inf")
        return OutputError(name, type(want).__name__, [], err, err, 0.0)
    w, want_dtype = _as_float64(want)
    dtype = dtype or want_dtype
    tol = TOLERANCES.get(dtype, DEFAULT_TOLERANCE)
    if not hasattr(got, "shape") or tuple(got.shape) != tuple(want.shape):
        return OutputError(name, dtype, list(want.shape), float("inf"), float("inf"), tol)
    g, _ = _as_float64(got)
    same = (np.isnan(g) & np.isnan(w)) | (np.isinf(g) & (g == w))
    diff = np.where(same, 0.0, np.abs(g - w))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_abs = float(diff.max()) if diff.size else 0.0
    finite = np.abs(w[np.isfinite(w)])
    scale = float(finite.max()) if finite.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return OutputError(name, dtype, list(want.shape), max_abs, max_rel, tol)
