"""`tkopt bench`: fused vs unfused, accuracy and speed, for the whole model and for every fused node.

The result (BenchResult) is one shape for ONNX models (`bench_onnx`, here) and torch modules
(`bench_module`, tkopt/bench_torch.py): per-output errors, latency distributions per variant,
speedups against a baseline (only where the fused side runs real kernels: a "hybrid" ONNX run uses
torch references and is reported for accuracy only), and per fused node its error and its time
against the original nodes it replaced, fed with the node's real inputs from the full model.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from rich.console import Console
from rich.table import Table

from tkopt.report import OutputError

ONNX_CUDA_PROVIDERS = ["CUDAExecutionProvider", "CPUExecutionProvider"]


# ---- measurements -------------------------------------------------------------------------------
@dataclass
class Timing:
    """Latency of one variant over `runs` timed calls after `warmup` untimed ones (milliseconds)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    warmup: int
    method: str  # "perf_counter" or "cuda_events"

    @classmethod
    def of(cls, samples_ms: list[float], warmup: int, method: str) -> Timing:
        q = np.percentile(samples_ms, [10, 90]) if samples_ms else [math.nan, math.nan]
        med = statistics.median(samples_ms) if samples_ms else math.nan
        return cls(float(med), float(q[0]), float(q[1]), len(samples_ms), warmup, method)


def time_calls(fn: Callable[[], Any], runs: int, warmup: int) -> Timing:
    """Wall-clock time of `fn()` (CPU work, or ORT runs, which return host arrays: synchronous)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(samples, warmup, "perf_counter")


def _speedup(base: Timing | None, other: Timing | None) -> float | None:
    if base is None or other is None or not other.median_ms > 0:
        return None
    return base.median_ms / other.median_ms


@dataclass
class NodeBench:
    """One fused node against the original nodes it replaced, on the node's real inputs."""

    node: str
    op: str
    replaced: int  # how many original nodes it stands for
    outputs: list[OutputError] = field(default_factory=list)
    fused: Timing | None = None
    unfused: Timing | None = None
    note: str = ""  # why a part is missing (inputs not capturable, no native kernel, ...)

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def max_rel(self) -> float | None:
        return max((o.max_rel for o in self.outputs), default=None)

    @property
    def speedup(self) -> float | None:
        return _speedup(self.unfused, self.fused)


@dataclass
class BenchResult:
    """Fused vs unfused for one model. `timings` maps a variant to its latency; speedups are
    baseline median / variant median, listed only where `claims_speedup` (real kernels ran)."""

    kind: str  # "onnx" or "torch"
    source: str
    device: str
    fused_runner: str
    outputs: list[OutputError]
    timings: dict[str, Timing]
    baseline: str
    fused: str  # the timings key of the fused variant
    claims_speedup: bool
    target: str | None = None
    nodes: list[NodeBench] = field(default_factory=list)
    inputs: dict[str, list[int]] = field(default_factory=dict)
    fusions: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    optimization: dict[str, Any] | None = None  # the optimization report (tkopt.report.Report.to_dict())

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs) and all(n.ok for n in self.nodes)

    def speedups(self) -> dict[str, float]:
        """Each variant's speedup over the baseline (empty when the fused side makes no speed claim)."""
        if not self.claims_speedup:
            return {}
        base = self.timings.get(self.baseline)
        out = {k: _speedup(base, t) for k, t in self.timings.items() if k != self.baseline}
        return {k: v for k, v in out.items() if v is not None}

    def summary(self) -> dict[str, Any]:
        node_speedups = [n.speedup for n in self.nodes if n.speedup is not None]
        node_rel = [n.max_rel for n in self.nodes if n.max_rel is not None]
        return {
            "ok": self.ok,
            "outputs_ok": all(o.ok for o in self.outputs),
            "max_rel_error": max((o.max_rel for o in self.outputs), default=None),
            "speedup": self.speedups().get(self.fused),
            "speedups": self.speedups(),
            "fused_nodes": len(self.nodes),
            "nodes_ok": all(n.ok for n in self.nodes),
            "node_max_rel_error": max(node_rel, default=None),
            "node_speedup_geomean": (math.exp(statistics.fmean(math.log(s) for s in node_speedups))
                                     if node_speedups else None),
        }

    def to_dict(self) -> dict[str, Any]:
        def outs(errors: list[OutputError]) -> list[dict[str, Any]]:
            return [{**asdict(o), "ok": o.ok} for o in errors]

        return _finite({
            "summary": self.summary(),
            "kind": self.kind,
            "source": self.source,
            "device": self.device,
            "target": self.target,
            "fused_runner": self.fused_runner,
            "baseline": self.baseline,
            "fused": self.fused,
            "claims_speedup": self.claims_speedup,
            "inputs": self.inputs,
            "outputs": outs(self.outputs),
            "timings": {k: asdict(t) for k, t in self.timings.items()},
            "fusions": self.fusions,
            "nodes": [
                {"node": n.node, "op": n.op, "replaced": n.replaced, "ok": n.ok, "outputs": outs(n.outputs),
                 "fused": None if n.fused is None else asdict(n.fused),
                 "unfused": None if n.unfused is None else asdict(n.unfused),
                 "speedup": n.speedup, "note": n.note}
                for n in self.nodes
            ],
            "notes": list(self.notes),
            "optimization": self.optimization,
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def write_json(self, path: str | Path) -> Path:
        """Write to_json() atomically (a temporary file beside `path`, then os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def render(self, console: Console | None = None) -> None:
        render(self, console or Console())


def _finite(x: Any) -> Any:
    """JSON has no NaN/inf: write them as strings ("nan", "inf") so the file stays standard JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


# ---- report ---------------------------------------------------------------------------------------
def _ms(t: Timing | None) -> str:
    return "-" if t is None else f"{t.median_ms:.3f}"


def _x(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}x"


def _ok(ok: bool) -> str:
    return "[green]ok[/green]" if ok else "[red]MISMATCH[/red]"


def render(r: BenchResult, console: Console) -> None:
    """Rich tables: outputs (errors), latency per variant (with speedups), fused nodes."""
    console.print(f"[bold]tkopt bench[/bold] {r.source}  ({r.kind}, {r.device}"
                  + (f", target {r.target}" if r.target else "") + ")")
    console.print(f"fused model runs: {r.fused_runner}")
    if r.fusions:
        console.print("fusions: " + ", ".join(f"{k} {v}" for k, v in r.fusions.items() if v))
    t = Table(title=f"outputs: {r.fused} vs {r.baseline}")
    for col in ("output", "dtype", "shape", "max abs", "max rel", "tol", ""):
        t.add_column(col)
    for o in r.outputs:
        t.add_row(o.name, o.dtype, str(o.shape), f"{o.max_abs:.3g}", f"{o.max_rel:.3g}", f"{o.tolerance:.0e}",
                  _ok(o.ok))
    console.print(t)
    speed = r.speedups()
    lt = Table(title="latency (ms)")
    for col in ("variant", "median", "p10", "p90", "runs", f"speedup vs {r.baseline}"):
        lt.add_column(col, justify="left" if col == "variant" else "right")
    for name, tm in r.timings.items():
        lt.add_row(name, f"{tm.median_ms:.3f}", f"{tm.p10_ms:.3f}", f"{tm.p90_ms:.3f}", str(tm.runs),
                   "-" if name == r.baseline else _x(speed.get(name)))
    console.print(lt)
    if r.nodes:
        nt = Table(title="fused nodes vs the nodes they replaced (on their real inputs)")
        nt.add_column("node", no_wrap=True)
        for col in ("replaced", "max rel", "fused ms", "unfused ms", "speedup"):
            nt.add_column(col, justify="right")
        nt.add_column("")
        for n in r.nodes:
            rel = "-" if n.max_rel is None else f"{n.max_rel:.3g}"
            status = (_ok(n.ok) if n.outputs else "") + (f" {n.note}" if n.note else "")
            nt.add_row(n.node, str(n.replaced), rel, _ms(n.fused), _ms(n.unfused),
                       _x(n.speedup if r.claims_speedup else None), status)
        console.print(nt)
    for note in r.notes:
        console.print(f"note: {note}")
    s = r.summary()
    if s["speedup"] is not None:
        console.print(f"[bold]{r.fused} vs {r.baseline}: {s['speedup']:.2f}x[/bold] (median latency)")
    console.print("accuracy: " + ("[green]all outputs within tolerance[/green]" if s["outputs_ok"]
                                  else "[red]outputs differ beyond tolerance[/red]"))


# ---- ONNX -----------------------------------------------------------------------------------------
def _providers(target: str | None) -> list[str]:
    """ORT providers for a target; a CUDA target needs onnxruntime-gpu (its CUDA EP)."""
    if target in (None, "cpu"):
        return ["CPUExecutionProvider"]
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(f"--target {target}: this onnxruntime has no CUDAExecutionProvider (install "
                           "onnxruntime-gpu) to run the CUDA op library (`tkopt optimize --target` builds it "
                           "without running it)")
    return ONNX_CUDA_PROVIDERS


def _session(model: onnx.ModelProto | Path, providers: list[str], library: Path | None, tmp: Path) -> Any:
    """An ORT session; models of 2 GB or more go through a file (with external data) in `tmp`."""
    import onnxruntime as ort

    from tkopt.backends.onnx_model import TWO_GB, save

    so = ort.SessionOptions()
    if library is not None:
        so.register_custom_ops_library(str(library))
    if isinstance(model, onnx.ModelProto):
        if model.ByteSize() < TWO_GB:
            return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
        model = save(model, Path(tempfile.mkdtemp(dir=tmp)) / "model.onnx", external_data=True)
    return ort.InferenceSession(str(model), so, providers=providers)


def _out_errors(names: Iterable[str], got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]
                ) -> list[OutputError]:
    from tkopt.api import _errors

    return [_errors(n, np.asarray(got[n]), np.asarray(want[n])) for n in names]


def bench_onnx(
    path: str | Path,
    target: str | None = None,
    runs: int = 20,
    warmup: int = 3,
    disable: Iterable[str] = (),
    seed: int = 0,
    nodes: bool = True,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> BenchResult:
    """Optimize the ONNX model at `path` and compare fused with unfused (original, plain ORT).

    With `target` the fused model runs in ORT on the native op library built for it, and both
    sides are timed (time.perf_counter around session.run). Without it the fused model runs
    "hybrid" (tkopt.onnx_runtime_ref: fused ops through torch references): accuracy only.
    The pipeline is optimize_onnx's (import, passes, build_library, export, check) done here so
    the fused IR graph stays at hand for the per-node rows (tkopt.bench_nodes.onnx_node_rows).
    """
    from tkopt.backends.onnx_model import check, export_onnx, save
    from tkopt.bench_nodes import onnx_node_rows
    from tkopt.frontends.onnx import import_onnx
    from tkopt.onnx_runtime_ref import has_fused_nodes, run_hybrid
    from tkopt.ort.library import build_library, check_target
    from tkopt.passes.finalize import seal
    from tkopt.passes.pipeline import run_passes
    from tkopt.report import Report

    if target is not None:
        check_target(target)
    if runs < 1 or warmup < 0:
        raise ValueError(f"--runs must be >= 1 and --warmup >= 0 (got {runs}, {warmup})")
    providers = _providers(target)
    graph = import_onnx(path)
    source = graph.meta["source"]
    original: onnx.ModelProto = graph.meta["onnx_model"]
    ops_before = graph.count_ops()
    passes = run_passes(graph, disable)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tkopt-bench-") as tmpdir:
        tmp = Path(tmpdir)
        lib = build_library(graph, target, tmp / "ops.so") if target is not None else None
        if lib is None:
            seal(graph)
        fused_model = export_onnx(graph)
        check(fused_model)
        rep = Report(source=source, passes=passes, ops_before=ops_before, ops_after=graph.count_ops())
        if lib is not None:
            rep.target, rep.unfused = lib.target, lib.unfused
            notes += [f"{n} left unfused for {target}: {why}" for n, why in lib.unfused]
        library = lib.path if lib is not None and lib.nodes else None
        feeds = dict(inputs) if inputs is not None else _make_inputs(original, seed)
        names = [o.name for o in original.graph.output]
        unfused_sess = _session(Path(path) if isinstance(path, str | Path) else original, providers, None, tmp)
        want = dict(zip(names, unfused_sess.run(names, feeds), strict=True))
        timings = {"unfused": time_calls(lambda: unfused_sess.run(names, feeds), runs, warmup)}
        if library is not None or not has_fused_nodes(fused_model):
            fused_sess = _session(save(fused_model, tmp / "fused.onnx",
                                       external_data=True if graph.meta["external_data"] else None),
                                  providers, library, tmp)
            got = dict(zip(names, fused_sess.run(names, feeds), strict=True))
            timings["fused"] = time_calls(lambda: fused_sess.run(names, feeds), runs, warmup)
            runner, claims = (f"ort + tkopt op library ({target})" if library else "ort (nothing fused)"), True
        else:
            got = run_hybrid(fused_model, feeds)
            runner, claims = "hybrid (standard ops in ORT, fused ops via torch references)", False
            notes.append("no --target: the fused model ran 'hybrid' (fused ops through tkopt's torch references, "
                         "not kernels); accuracy only, no speed claim")
        node_rows = (onnx_node_rows(graph, original, feeds, providers, library, runs, warmup, tmp)
                     if nodes else [])
    return BenchResult(
        kind="onnx", source=source, device=providers[0].removesuffix("ExecutionProvider").lower(),
        fused_runner=runner, outputs=_out_errors(names, got, want), timings=timings, baseline="unfused",
        fused="fused", claims_speedup=claims, target=target, nodes=node_rows,
        inputs={k: list(v.shape) for k, v in feeds.items()}, fusions=dict(passes.fusions), notes=notes,
        optimization=rep.to_dict(),
    )


def _make_inputs(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    from tkopt.api import make_inputs

    return make_inputs(model, seed)
