"""Check one fuzzed module on one path against eager, at every size the spec lists.

Paths: "fx" (tkopt.compile, fused ops on their torch references), "fx-kernels" (the same on TileLang's
CPU kernels), and "onnx-<exporter>[-static][-cpu]": torch.onnx.export with dynamo=True ("dynamo") or
the TorchScript exporter ("script"), dynamic batch/seq dims unless "-static" (a static model runs at
the example size only), optimize_onnx in "hybrid" mode, or with the native CPU op library ("-cpu").

An outcome is "ok"; "wrong": fused differs from eager beyond the dtype's tolerance, or has NaN/inf
where eager has none, or the reverse (on ONNX paths fused must match eager or the unfused export run
in ORT, which must itself match eager within EXPORT_TOLERANCE: ORT's float64 kernels are less
exact); "crash": an exception inside tkopt; or "rejected": eager, the exporter or ONNX Runtime on
the unfused export failed or disagreed with eager. That graph is not ours to run, so it is skipped
and counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import numpy as np
import torch

from tkopt.logs import loggers_at

FX_PATHS = ("fx", "fx-kernels")
ONNX_PATHS = ("onnx-dynamo", "onnx-dynamo-static", "onnx-script", "onnx-script-static", "onnx-dynamo-cpu")
PATHS = FX_PATHS + ONNX_PATHS
# |fused - eager| <= atol + rtol * max |eager|, per dtype.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-12, 1e-9)}
# ORT's own kernels against eager (only to tell a faithful export from a wrong one): any dtype.
EXPORT_TOLERANCE = (1e-4, 1e-3)


@dataclass
class Outcome:
    path: str
    status: str  # "ok" | "wrong" | "crash" | "rejected"; a campaign adds "timeout" and "harness" (its own bug)
    detail: str = ""  # the error's first line, or what differed
    where: str = ""  # crash: the innermost tkopt frame (file:line function)
    error: str = ""  # crash: the exception type
    shape: tuple[int, int] | None = None  # the (batch, seq) it failed at
    shapes: list[tuple[int, int]] = field(default_factory=list)  # the sizes it ran
    fused: dict[str, int] = field(default_factory=dict)  # fusions per pass, when tkopt got that far

    @property
    def failed(self) -> bool:
        return self.status in ("wrong", "crash")

    def signature(self) -> tuple[str, str, str]:
        """What two failures share when they are likely the same defect (used when shrinking)."""
        where = self.where.split(":")[0] + ":" + self.where.rsplit(" ", 1)[-1] if self.where else ""
        return (self.status, self.error, where)

    def __str__(self) -> str:
        at = f" at (batch, seq) {self.shape}" if self.shape else ""
        loc = f" [{self.error} in {self.where}]" if self.where else ""
        fused = " fused " + ", ".join(f"{k} {v}" for k, v in self.fused.items() if v) if self.fused else ""
        return f"{self.path}: {self.status}{at}{loc}: {self.detail}{fused}"


# ---- classifying failures -------------------------------------------------------------------------
def _tkopt_roots() -> tuple[str, ...]:
    import tkopt
    import tkopt.kernels
    import tkopt.models
    import tkopt.passes

    return tuple(str(Path(m.__file__).parent) + os.sep for m in (tkopt, tkopt.passes, tkopt.kernels, tkopt.models))


def _is_ours(filename: str, roots: tuple[str, ...]) -> bool:
    """tkopt's code (the fuzzer itself excepted: it only catches and reports)."""
    return filename.startswith(roots) and not filename.startswith(str(Path(__file__).parent) + os.sep)


def _frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(tb))


def classify(path: str, e: BaseException, shape: tuple[int, int] | None) -> Outcome:
    """A crash inside tkopt, or a rejection: torch.export or an exporter failing where tkopt called it."""
    roots = _tkopt_roots()
    frames = _frames(e.__traceback__)
    ours = [i for i, f in enumerate(frames) if _is_ours(f.filename, roots)]
    first_line = (str(e).strip().splitlines() or [""])[0][:300]
    if not ours:
        return Outcome(path, "rejected", f"{type(e).__name__}: {first_line}", shape=shape)
    exporters = (f"{os.sep}torch{os.sep}export{os.sep}", f"{os.sep}torch{os.sep}onnx{os.sep}")
    # tkopt calls into an exporter, which may trace tkopt's own wrapper before failing in torch or user code:
    # the exporter's failure unless a tkopt frame raised it.
    into_exporter = any(i + 1 < len(frames) and any(x in frames[i + 1].filename for x in exporters) for i in ours)
    if into_exporter and ours[-1] != len(frames) - 1:
        return Outcome(path, "rejected", f"torch.export: {type(e).__name__}: {first_line}", shape=shape)
    f = frames[ours[-1]]
    where = f"{os.path.relpath(f.filename, os.path.dirname(roots[0].rstrip(os.sep)))}:{f.lineno} {f.name}"
    return Outcome(path, "crash", first_line, where=where, error=type(e).__name__, shape=shape)


def compare(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor],
            tolerance: tuple[float, float] | None = None) -> str | None:
    """None if every output matches, else what differs (NaN and inf must sit where `want` has them).
    `tolerance` (atol, rtol) overrides the per-dtype TOLERANCE."""
    if len(got) != len(want):
        return f"{len(got)} outputs, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if tuple(g.shape) != tuple(w.shape):
            return f"output {i}: shape {tuple(g.shape)}, eager {tuple(w.shape)}"
        atol, rtol = tolerance or TOLERANCE.get(w.dtype, TOLERANCE[torch.float32])
        g64, w64 = g.detach().double().cpu(), w.detach().double().cpu()
        for name, fn in (("NaN", torch.isnan), ("+inf", lambda t: t == float("inf")),
                         ("-inf", lambda t: t == float("-inf"))):
            a, b = fn(g64), fn(w64)
            if not torch.equal(a, b):
                extra, missing = int((a & ~b).sum()), int((b & ~a).sum())
                return f"output {i}: {name} at {extra} places eager has none, missing at {missing}"
        finite = torch.isfinite(w64)
        if not finite.any():
            continue
        err = float((g64 - w64)[finite].abs().max())
        scale = float(w64[finite].abs().max())
        if not err <= atol + rtol * scale:
            rel = err / max(scale, 1e-30)
            return f"output {i}: max abs error {err:.3g} (relative to max |eager| {scale:.3g}: {rel:.3g})"
    return None


def wrong(path: str, diff: str, **kw: Any) -> Outcome:
    """A wrong result; its `error` says what kind (NaN, inf, shape, value), so shrinking keeps the kind."""
    kind = next((k for k in ("NaN", "inf", "shape", "outputs") if k in diff), "value")
    return Outcome(path, "wrong", diff, error=kind, **kw)


def _flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Exporters and tkopt warn a lot about things that are fine here; failures are caught, not logged."""
    with warnings.catch_warnings(), loggers_at(logging.ERROR, ("torch", "onnxscript", "tkopt", "torch._dynamo")):
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """stdout and stderr at the file-descriptor level (the TorchScript exporter prints its whole IR on
    a failure, from C++), restored afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@contextlib.contextmanager
def _kernels(mode: str) -> Iterator[None]:
    old = os.environ.get("TKOPT_KERNELS")
    os.environ["TKOPT_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["TKOPT_KERNELS"]
        else:
            os.environ["TKOPT_KERNELS"] = old


# ---- the paths ----------------------------------------------------------------------------------
def eager(mod: ModuleType) -> dict[tuple[int, int], tuple[tuple, list[torch.Tensor]]]:
    """(inputs, eager outputs) per size (raises if eager rejects the module)."""
    model = mod.make_model()
    out = {}
    with torch.no_grad():
        for shape in mod.SHAPES:
            inputs = mod.make_inputs(*shape)
            out[tuple(shape)] = (inputs, _flat(model(*inputs)))
    return out


def check(path: str, mod: ModuleType, runs: dict | None = None) -> Outcome:
    """Run `mod` (a rendered spec: make_model, make_inputs, SHAPES) on `path`; `runs` caches eager()."""
    if path not in PATHS:
        raise ValueError(f"unknown fuzz path {path!r}; expected one of {', '.join(PATHS)}")
    with _quiet():
        if runs is None:
            try:
                runs = eager(mod)
            except Exception as e:  # noqa: BLE001 - eager rejecting the graph is counted, not raised
                return Outcome(path, "rejected", f"eager: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        if path in FX_PATHS:
            with _kernels("tilelang" if path == "fx-kernels" else "reference"):
                return _check_fx(path, mod, runs)
        return _check_onnx(path, mod, runs)


def _check_fx(path: str, mod: ModuleType, runs: dict) -> Outcome:
    import tkopt

    shapes = list(runs)
    model = mod.make_model()
    with torch.no_grad():
        try:
            compiled = tkopt.compile(model, runs[shapes[0]][0], select="all")  # every fusion, measured faster or not
        except Exception as e:  # noqa: BLE001
            return _with_shapes(classify(path, e, shapes[0]), shapes)
        if compiled.export_error is not None:  # it runs through the tkopt backend: no exported program to check
            return _with_shapes(Outcome(path, "rejected", f"torch.export: {compiled.export_error[:300]}"), shapes)
        fused = dict(compiled.tkopt_report.fusions)
        for shape in shapes:
            inputs, want = runs[shape]
            try:
                got = _flat(compiled(*inputs))
            except Exception as e:  # noqa: BLE001
                return _with_shapes(classify(path, e, shape), shapes, fused)
            diff = compare(got, want)
            if diff is not None:
                return wrong(path, diff, shape=shape, shapes=shapes, fused=fused)
    return Outcome(path, "ok", shapes=shapes, fused=fused)


def _with_shapes(o: Outcome, shapes: list[tuple[int, int]], fused: dict[str, int] | None = None) -> Outcome:
    o.shapes, o.fused = shapes, dict(fused or {})
    return o


def _check_onnx(path: str, mod: ModuleType, runs: dict) -> Outcome:
    import onnx

    from tkopt.api import optimize_onnx
    from tkopt.models.export import export_onnx, input_names
    from tkopt.onnx_runtime_ref import run_model

    dynamo = path.startswith("onnx-dynamo")
    static = "-static" in path
    target = "cpu" if path.endswith("-cpu") else None
    shapes = list(runs)[:1] if static else list(runs)
    with tempfile.TemporaryDirectory(prefix="tkopt-fuzz-") as d:
        src = Path(d) / "model.onnx"
        try:
            with _silenced():
                export_onnx(mod.make_model(), runs[shapes[0]][0], src, dynamo=dynamo, dynamic_batch_seq=not static)
        except Exception as e:  # noqa: BLE001 - the exporter's failure, not ours
            return Outcome(path, "rejected", f"exporter: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                           shapes=shapes)
        original = onnx.load(str(src))
        names = set(i.name for i in original.graph.input)  # an input the graph never reads is not exported
        params = input_names(mod.make_model(), runs[shapes[0]][0])
        feeds = {s: {n: t.numpy() for n, t in zip(params, runs[s][0], strict=True) if n in names} for s in shapes}
        unfused = {}
        for s in shapes:
            try:
                unfused[s] = [torch.from_numpy(a) for a in run_model(original, feeds[s], provider="ort").values()]
            except Exception as e:  # noqa: BLE001
                return Outcome(path, "rejected", f"ORT on the unfused export: {str(e).splitlines()[0][:200]}",
                               shape=s, shapes=shapes)
            diff = compare(unfused[s], runs[s][1], EXPORT_TOLERANCE)
            if diff is not None:
                return Outcome(path, "rejected", f"the unfused export differs from eager: {diff}", shape=s,
                               shapes=shapes)
        try:
            optimized, report = optimize_onnx(src, Path(d) / "out.onnx", report=False, target=target, select="all")
        except Exception as e:  # noqa: BLE001
            return _with_shapes(classify(path, e, shapes[0]), shapes)
        provider = "ort" if report.library else "hybrid"
        fused = dict(report.passes.fusions)
        for s in shapes:
            try:
                got = run_model(optimized, feeds[s], provider=provider, custom_ops_library=report.library)
            except Exception as e:  # noqa: BLE001
                return _with_shapes(classify(path, e, s), shapes, fused)
            got_t = [torch.from_numpy(np.asarray(a)) for a in got.values()]
            diff = compare(got_t, unfused[s])
            if diff is not None and compare(got_t, runs[s][1]) is not None:
                return wrong(path, f"against the unfused export in ORT: {diff}", shape=s, shapes=shapes, fused=fused)
    return Outcome(path, "ok", shapes=shapes, fused=fused)
