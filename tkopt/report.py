"""What an optimization run did, for people (rich tables) and machines (to_dict / JSON).

Wraps the pass pipeline's report (nodes before/after, fusions per pass, canonicalization edits,
refusals with reasons) with op counts and the fused-vs-unfused accuracy check.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from tkopt.passes.pipeline import Report as PassReport

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


@dataclass
class Report:
    """One optimization run: source/output, the pipeline's report, op counts, accuracy (if checked)."""

    source: str
    passes: PassReport
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    output: str | None = None
    accuracy: Accuracy | None = None
    target: str | None = None  # the op library's target, when one was built
    library: str | None = None
    unfused: list[tuple[str, str]] = field(default_factory=list)  # (node, why no kernel serves it)

    def to_dict(self) -> dict[str, Any]:
        p = self.passes
        return {
            "source": self.source,
            "output": self.output,
            "nodes_before": p.nodes_before,
            "nodes_after": p.nodes_after,
            "fusions": dict(p.fusions),
            "total_fused": p.total_fused,
            "edits": dict(p.edits),
            "disabled": list(p.disabled),
            "refusals": [asdict(r) for r in p.refusals],
            "ops_before": dict(self.ops_before),
            "ops_after": dict(self.ops_after),
            "accuracy": None if self.accuracy is None else self.accuracy.to_dict(),
            "target": self.target,
            "library": self.library,
            "unfused_for_target": [{"node": n, "reason": r} for n, r in self.unfused],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def render(self, console: Console | None = None, verbose: bool = False) -> None:
        """Print the report; `verbose` lists every refusal and the full op counts."""
        console = console or Console()
        p = self.passes
        console.print(f"[bold]tkopt[/bold] {self.source}" + (f" -> {self.output}" if self.output else ""))
        console.print(f"nodes: {p.nodes_before} -> {p.nodes_after}  fused: {p.total_fused}"
                      + (f"  disabled: {', '.join(p.disabled)}" if p.disabled else ""))
        if p.total_fused == 0:
            console.print(f"[yellow]no fusable pattern found in {self.source}[/yellow]: the output is the model "
                          "re-emitted unchanged" + (" (near matches: --verbose)" if p.refusals else ""))
        t = Table(title="fusions")
        t.add_column("pass")
        t.add_column("fused", justify="right")
        for name, n in p.fusions.items():
            t.add_row(name, str(n))
        console.print(t)
        fused_ops = {k.removeprefix("tkopt::"): v for k, v in self.ops_after.items() if k.startswith("tkopt::")}
        if fused_ops:
            console.print("fused nodes: " + ", ".join(f"{k} {v}" for k, v in fused_ops.items()))
        if p.edits:
            console.print("canonicalization: " + ", ".join(f"{k} {v}" for k, v in p.edits.items()))
        if p.refusals:
            if verbose:
                r = Table(title="near matches refused")
                for col in ("rule", "node", "reason"):
                    r.add_column(col)
                for ref in p.refusals:
                    r.add_row(ref.rule, ref.node, ref.reason)
                console.print(r)
            else:
                by_rule: dict[str, int] = {}
                for ref in p.refusals:
                    by_rule[ref.rule] = by_rule.get(ref.rule, 0) + 1
                console.print("refused: " + ", ".join(f"{k} {v}" for k, v in by_rule.items())
                              + " (--verbose lists the reasons)")
        if verbose:
            ops = Table(title="ops")
            for col in ("op", "before", "after"):
                ops.add_column(col, justify="right" if col != "op" else "left")
            for op in sorted(set(self.ops_before) | set(self.ops_after)):
                ops.add_row(op, str(self.ops_before.get(op, 0)), str(self.ops_after.get(op, 0)))
            console.print(ops)
        if self.target is not None:
            console.print(f"op library ({self.target}): {self.library or 'not written'}")
            for node, reason in self.unfused:
                console.print(f"  left unfused for {self.target}: {node}: {reason}")
        if self.accuracy is not None:
            self.render_accuracy(console)

    def render_accuracy(self, console: Console) -> None:
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
