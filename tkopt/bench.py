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
import statistics
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from rich.console import Console
from rich.table import Table

from tkopt.accuracy import OutputError, output_error
from tkopt.ir import Graph, Node
from tkopt.measure import Timing, speedup, time_calls
from tkopt.report import json_safe


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
        return speedup(self.unfused, self.fused)


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
        out = {k: speedup(base, t) for k, t in self.timings.items() if k != self.baseline}
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

        return json_safe({
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
        from tkopt.files import write_atomic

        path = Path(path)
        write_atomic(path, self.to_json().encode())
        return path

    def render(self, console: Console | None = None) -> None:
        render(self, console or Console())


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
        nt = Table(title=f"fused nodes vs the nodes they replaced, in ORT on {r.device} (on their real inputs)"
                   if r.kind == "onnx" else "fused nodes vs the nodes they replaced (on their real inputs)")
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
def bench_onnx(
    path: str | Path,
    target: str | None = None,
    runs: int = 20,
    warmup: int = 3,
    disable: Iterable[str] = (),
    seed: int = 0,
    nodes: bool = True,
    inputs: Mapping[str, np.ndarray] | None = None,
    select: str | None = None,
) -> BenchResult:
    """Optimize the ONNX model at `path` (tkopt.pipeline, as optimize_onnx does) and compare fused with
    unfused (original, plain ORT).

    With `target` ("cpu", "sm80", "sm90", or "auto": tkopt.ort.library.resolve_target) the fused model runs
    in ORT on the native op library built for it, and both sides are timed (time.perf_counter around
    session.run; on a GPU target with inputs and outputs on the GPU, so ORT's CUDA kernels face the library's
    without copies). Without it (None, "none") the fused model runs "hybrid" (tkopt.onnx_runtime_ref: fused
    ops through torch references): accuracy only.
    Per fused node: a one-node model against a model of the nodes it replaced, on the node's inputs as
    the original model computes them on the same feeds.
    """
    from tkopt.backends.onnx_model import check, save
    from tkopt.frontends.onnx import import_onnx
    from tkopt.onnx_runtime_ref import has_fused_nodes, run_hybrid
    from tkopt.ort import run
    from tkopt.ort.library import check_prerequisites, cuda_missing, resolve_target
    from tkopt.pipeline import optimize
    from tkopt.targets.ort_target import OrtTarget

    if runs < 1 or warmup < 0:
        raise ValueError(f"--runs must be >= 1 and --warmup >= 0 (got {runs}, {warmup})")
    target, chose = resolve_target(target)
    if target is not None:
        check_prerequisites(target)
        why = None if target == "cpu" else cuda_missing()
        if why is not None:
            raise ValueError(f"bench --target {target} runs the {target} op library, which cannot run here: {why}")
    providers = run.providers(target)
    graph = import_onnx(path)
    source = graph.meta["source"]
    original: onnx.ModelProto = graph.meta["onnx_model"]
    run.check_loads(original, source)
    notes: list[str] = [chose] if chose else []
    with tempfile.TemporaryDirectory(prefix="tkopt-bench-") as tmpdir:
        tmp = Path(tmpdir)
        ort_target = OrtTarget(target, original, tmp)
        result = optimize(graph, ort_target, select=select, disable=disable)
        rep, fused_model, library = result.report, result.artifact.model, result.artifact.library
        if result.winner == "tkopt":
            check(fused_model)
        notes += [f"{d.node} left unfused: {d.decision.replace('_', ' ')}: {d.reason}" for d in rep.nodes
                  if d.decision != "kept"]
        feeds = dict(inputs) if inputs is not None else run.make_inputs(original, seed)
        names = [o.name for o in original.graph.output]
        unfused = run.Bound(run.session(Path(path) if isinstance(path, str | Path) else original, None, providers),
                            feeds, names, providers)
        want = unfused.results()
        timings = {"unfused": time_calls(unfused, runs, warmup)}
        fused_nodes = [n for n in result.graph.nodes if n.is_fused] if result.winner == "tkopt" else []
        lowered = ort_target.lowered(fused_nodes)
        if library is not None or not has_fused_nodes(fused_model):
            external = True if graph.meta["external_data"] else None
            fused_path = save(fused_model, tmp / "fused.onnx", external_data=external)
            fused = run.Bound(run.session(fused_path, library, providers), feeds, names, providers)
            got = fused.results()
            timings["fused"] = time_calls(fused, runs, warmup)
            runner = (f"ort + tkopt op library ({target})" if library else
                      "ort (fused nodes as ONNX Runtime's own ops)" if lowered else "ort (nothing fused)")
            claims = True
        else:
            got = run_hybrid(fused_model, feeds)
            runner, claims = "hybrid (standard ops in ORT, fused ops via torch references)", False
            notes.append("no --target: the fused model ran 'hybrid' (fused ops through tkopt's torch references, "
                         "not kernels); accuracy only, no speed claim")
        node_rows = (onnx_node_rows(result.graph, fused_nodes, original, feeds, providers, library, runs, warmup,
                                    lowered) if nodes else [])
    return BenchResult(
        kind="onnx", source=source, device=providers[0].removesuffix("ExecutionProvider").lower(),
        fused_runner=runner, outputs=[output_error(n, got[n], want[n]) for n in names], timings=timings,
        baseline="unfused", fused="fused", claims_speedup=claims, target=target, nodes=node_rows,
        inputs={k: list(v.shape) for k, v in feeds.items()}, fusions=rep.fusions, notes=notes,
        optimization=rep.to_dict(),
    )


def onnx_node_rows(graph: Graph, fused: list[Node], original: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                   providers: list[str], library: Path | None, runs: int, warmup: int,
                   lowered: Mapping[str, list[onnx.NodeProto]]) -> list[NodeBench]:
    """A NodeBench per fused node: a one-node model (as ORT's own ops where `lowered` has it, else on `library`;
    without one, the node's torch reference, errors only) against a model of its replaced nodes, on its inputs
    as computed by the original model from `feeds`."""
    from tkopt.ort import run
    from tkopt.targets.ort_target import nodes_model, outer_inputs

    needed = [v.name for n in fused for v in (*outer_inputs([n]), *outer_inputs(n.replaced))]
    values = run.capture(original, needed, feeds, providers) if fused else {}
    rows = []
    for n in fused:
        row = NodeBench(n.name, n.op, len(n.replaced))
        rows.append(row)
        missing = sorted({v.name for v in (*outer_inputs([n]), *outer_inputs(n.replaced)) if v.name not in values})
        if missing:
            row.note = f"inputs {missing} are not values of the original model; not measured"
            continue
        out_names = [v.name for v in n.outputs]
        ufeeds = {v.name: values[v.name] for v in outer_inputs(n.replaced)}
        unfused = run.Bound(run.session(nodes_model(graph, n.replaced, n.outputs, f"{n.name}_unfused"), None,
                                        providers), ufeeds, out_names, providers)
        want = unfused.results()
        row.unfused = time_calls(unfused, runs, warmup)
        ffeeds = {v.name: values[v.name] for v in outer_inputs([n])}
        if n.name in lowered or library is not None:
            model = nodes_model(graph, [n], n.outputs, n.name, lowered)
            fused = run.Bound(run.session(model, None if n.name in lowered else library, providers), ffeeds,
                              out_names, providers)
            got = fused.results()
            row.fused = time_calls(fused, runs, warmup)
        else:
            got = _reference(n, values)
            row.note = "reference"
        row.outputs = [output_error(name, got[name], want[name]) for name in out_names]
    return rows


def _reference(n: Node, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    from tkopt.fused_ops import run_reference
    from tkopt.onnx_runtime_ref import to_numpy, to_torch

    ins = [None if v is None else to_torch(v.const if v.const is not None else values[v.name]) for v in n.inputs]
    outs = run_reference(n.op, ins, n.attrs)
    return {v.name: to_numpy(t) for v, t in zip(n.outputs, outs, strict=False)}
