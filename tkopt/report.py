"""What an optimization did, for every entry point: one `Report`, for people (`print(report)`, the CLI's
table) and machines (`report.to_dict()`, the JSON).

Per fused node the pipeline's decision: kept (it runs its kernel), slower (measured against what it
replaces on the target, with both times), kernel_failed (its kernel could not be built or run, and why)
or declined (why). Only kept nodes count as fused. `last_report()` is the latest report in the process:
a `torch.compile(backend="tkopt")` user has no other handle on it.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from tkopt.accuracy import Accuracy
from tkopt.passes.pipeline import PassReport

DECISIONS = ("kept", "slower", "kernel_failed", "declined")


@dataclass
class NodeDecision:
    """One candidate fusion and what became of it. Times are the fastest calls (tkopt.measure.compare) at
    the size where the decision fell (the last one measured); `cached`: read from the decision cache."""

    node: str
    op: str
    fusion: str  # the pass that made it
    replaced: int  # how many original nodes it stands for
    decision: str = "kept"
    reason: str = ""
    fused_ms: float | None = None
    unfused_ms: float | None = None
    cached: bool = False
    runs_as: str = ""  # kept: what it runs as where not tkopt's kernel (Target.runs_as)

    @property
    def speedup(self) -> float | None:
        if self.fused_ms is None or self.unfused_ms is None or not self.fused_ms > 0:
            return None
        return self.unfused_ms / self.fused_ms


@dataclass
class WholeGraph:
    """The final graph against the plain alternatives the user already has, at the example inputs."""

    winner: str  # "tkopt", "tkopt unfused" (its program with every fusion put back) or the alternative that was faster
    times_ms: dict[str, float]  # variant -> its median call, variants in rotating turns (tkopt.measure.race)
    host_ms: dict[str, float] = field(default_factory=dict)  # variant -> the CPU's time per call, where timed
    cached: bool = False
    note: str = ""


@dataclass
class Report:
    """One optimization run: where it came from and went, what the passes proposed, what the target kept."""

    source: str
    target: str  # "torch-cpu", "torch-cuda", "ort-cpu", "ort-sm80", "ort-sm90", or "onnx" (no kernels)
    select: str  # "measured" or "all"
    passes: PassReport
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    nodes_after: int
    nodes: list[NodeDecision] = field(default_factory=list)
    whole_graph: WholeGraph | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall time
    output: str | None = None
    library: str | None = None
    accuracy: Accuracy | None = None
    notes: list[str] = field(default_factory=list)  # what the user must know about the output, one line each

    # ---- queries --------------------------------------------------------------------------------
    def decided(self, decision: str) -> list[NodeDecision]:
        if decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
        return [n for n in self.nodes if n.decision == decision]

    @property
    def fusions(self) -> dict[str, int]:
        """Per fusion pass, how many of its nodes run fused (passes.fusions counts its candidates)."""
        kept = Counter(n.fusion for n in self.decided("kept"))
        return {name: kept[name] for name in self.passes.fusions}

    @property
    def total_fused(self) -> int:
        return len(self.decided("kept"))

    # ---- machines -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        p = self.passes
        return json_safe({
            "source": self.source,
            "output": self.output,
            "target": self.target,
            "select": self.select,
            "library": self.library,
            "nodes_before": p.nodes_before,
            "nodes_after": self.nodes_after,
            "candidates": dict(p.fusions),
            "fusions": self.fusions,
            "total_fused": self.total_fused,
            "nodes": [{**asdict(n), "speedup": n.speedup} for n in self.nodes],
            "whole_graph": None if self.whole_graph is None else asdict(self.whole_graph),
            "edits": dict(p.edits),
            "disabled": list(p.disabled),
            "refusals": [asdict(r) for r in p.refusals],
            "ops_before": dict(self.ops_before),
            "ops_after": dict(self.ops_after),
            "seconds": dict(self.seconds),
            "accuracy": None if self.accuracy is None else self.accuracy.to_dict(),
            "notes": list(self.notes),
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # ---- people ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        buf = io.StringIO()
        self.render(Console(file=buf, width=120, color_system=None, force_terminal=False))
        return buf.getvalue().rstrip("\n")

    def render(self, console: Console | None = None, verbose: bool = False) -> None:
        """Print the report; `verbose` lists every fused node, every refusal and the full op counts."""
        console = console or Console()
        p = self.passes
        console.print(f"[bold]tkopt[/bold] {self.source}" + (f" -> {self.output}" if self.output else "")
                      + f"  (target {self.target}, select {self.select})")
        counts = Counter(n.decision for n in self.nodes)
        console.print(f"nodes: {p.nodes_before} -> {self.nodes_after}  fused: {self.total_fused} of "
                      f"{len(self.nodes)} candidates"
                      + "".join(f", {counts[d]} {d.replace('_', ' ')}" for d in DECISIONS[1:] if counts[d])
                      + (f"  disabled: {', '.join(p.disabled)}" if p.disabled else ""))
        if not self.nodes:
            console.print(f"[yellow]no fusable pattern found in {self.source}[/yellow]: the output is the model "
                          "re-emitted without fusions" + (" (near matches: --verbose)" if p.refusals else ""))
        t = Table(title="fusions")
        for col in ("pass", "candidates", "fused"):
            t.add_column(col, justify="left" if col == "pass" else "right")
        kept = self.fusions
        for name, n in p.fusions.items():
            t.add_row(name, str(n), str(kept.get(name, 0)))
        console.print(t)
        if self.nodes:
            console.print(self._node_table(verbose))
        if self.whole_graph is not None and not self.whole_graph.times_ms:
            console.print(f"whole graph: {self.whole_graph.winner} runs; {self.whole_graph.note}")
        elif self.whole_graph is not None:
            w = self.whole_graph
            ordered = sorted(w.times_ms.items(), key=lambda kv: kv[0] != "tkopt")
            times = ", ".join(f"{k} {v:.3f} ms" + (f" (CPU {w.host_ms[k]:.3f})" if k in w.host_ms else "")
                              for k, v in ordered)
            console.print(f"whole graph: {times}: [bold]{w.winner}[/bold] runs" + (" (cached)" if w.cached else "")
                          + (f"; {w.note}" if w.note else ""))
        if p.edits:
            console.print("canonicalization: " + ", ".join(f"{k} {v}" for k, v in p.edits.items()))
        self._render_refusals(console, verbose)
        if verbose:
            ops = Table(title="ops")
            for col in ("op", "before", "after"):
                ops.add_column(col, justify="right" if col != "op" else "left")
            for op in sorted(set(self.ops_before) | set(self.ops_after)):
                ops.add_row(op, str(self.ops_before.get(op, 0)), str(self.ops_after.get(op, 0)))
            console.print(ops)
        if self.seconds:
            console.print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        if self.library is not None:
            console.print(f"op library ({self.target}): {self.library}")
        if self.accuracy is not None:
            self._render_accuracy(console)
        for note in self.notes:
            console.print(f"[yellow]note[/yellow]: {note}")

    def _node_table(self, verbose: bool) -> Table:
        """Every fused node with its times (verbose), else one row per (op, decision, reason) with a count
        and the median node's speedup."""
        t = Table(title="fused nodes" if verbose else "fused nodes (-v: one row each, with times)")
        cols = ("node", "op", "decision", "fused ms", "unfused ms", "speedup") if verbose else \
            ("nodes", "op", "decision", "speedup")
        for col in cols:
            t.add_column(col, justify="right" if col.endswith(("ms", "speedup")) or col == "nodes" else "left",
                         no_wrap=True, overflow="ellipsis", max_width=32)
        t.add_column("why", ratio=1)
        rows: dict[tuple, list[NodeDecision]] = {}
        for n in self.nodes:
            rows.setdefault((n.node,) if verbose else (n.op, n.decision, n.reason, n.runs_as), []).append(n)
        for group in rows.values():
            n = group[0]
            mid = sorted(group, key=lambda d: d.speedup or 0.0)[len(group) // 2]
            x = "-" if mid.speedup is None else f"{mid.speedup:.2f}x"
            why = (n.reason or (f"runs as {n.runs_as}" if n.runs_as else "")) + (" (cached)" if n.cached else "")
            if verbose:
                t.add_row(n.node, n.op, _decision(n.decision), _ms(n.fused_ms), _ms(n.unfused_ms), x, why)
            else:
                t.add_row(str(len(group)), n.op, _decision(n.decision), x, why)
        return t

    def _render_refusals(self, console: Console, verbose: bool) -> None:
        refusals = self.passes.refusals
        if not refusals:
            return
        if verbose:
            r = Table(title="near matches refused")
            for col in ("rule", "node", "reason"):
                r.add_column(col)
            for ref in refusals:
                r.add_row(ref.rule, ref.node, ref.reason)
            console.print(r)
            return
        by_rule = Counter(ref.rule for ref in refusals)
        console.print("refused: " + ", ".join(f"{k} {v}" for k, v in by_rule.items())
                      + " (--verbose lists the reasons)")

    def _render_accuracy(self, console: Console) -> None:
        a = self.accuracy
        assert a is not None
        if not a.checked:
            console.print(f"[yellow]accuracy check skipped[/yellow]: {a.skipped[0] if a.skipped else 'no run'}")
            return
        console.print(f"accuracy checked at {len(a.runs)} input size(s): "
                      + "; ".join(", ".join(f"{k} {v}" for k, v in r.items()) for r in a.runs))
        for why in a.skipped:
            console.print(f"  not checked at {why}")
        t = Table(title=f"fused ({a.fused_runner}) vs unfused ({a.unfused_runner})")
        for col in ("output", "dtype", "shape", "max abs", "max rel", "tol", ""):
            t.add_column(col)
        for o in a.outputs:
            t.add_row(o.name, o.dtype, str(o.shape), f"{o.max_abs:.3g}", f"{o.max_rel:.3g}", f"{o.tolerance:.0e}",
                      "[green]ok[/green]" if o.ok else "[red]MISMATCH[/red]")
        console.print(t)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _decision(d: str) -> str:
    return {"kept": "[green]kept[/green]", "kernel_failed": "[red]kernel failed[/red]"}.get(d, d)


def json_safe(x: Any) -> Any:
    """JSON has no NaN/inf: write them as strings ("nan", "inf") so the file stays standard JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


_LAST: list[Report] = []


def remember(report: Report) -> None:
    """Make `report` the one `last_report()` returns (the pipeline calls this for every run)."""
    _LAST[:] = [report]


def last_report() -> Report | None:
    """The latest optimization report in this process (None before the first), from any entry point:
    tkopt.compile, torch.compile(backend="tkopt"), optimize_onnx, the benchmarks."""
    return _LAST[0] if _LAST else None
