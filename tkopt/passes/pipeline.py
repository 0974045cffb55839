"""The pass pipeline: canonicalize, recognise, fuse, then expand what no fusion consumed.

Each pass module registers its passes with `register`; `PASS_MODULES` fixes their order. Passes
can be switched off one by one by name (as ORT's optimizer offers --disable_attention).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tkopt.ir import Graph

from .base import PassResult, Refusal

PassFn = Callable[[Graph, PassResult], None]

# Order matters: attention and norm fusions claim their adds before the GEMM residual epilogue does.
PASS_MODULES = ("canonicalize", "recognize", "attention", "norm", "gemm", "finalize")
_REGISTRY: dict[str, list[tuple[str, PassFn, bool]]] = {}
_REQUIRED: set[str] = set()  # passes that cannot be disabled (finalize: backends need it)


def register(name: str, *, fusion: bool = False, required: bool = False) -> Callable[[PassFn], PassFn]:
    """Add a pass under `name` to the calling module's list (run in definition order)."""

    def deco(fn: PassFn) -> PassFn:
        module = fn.__module__.rsplit(".", 1)[-1]
        _REGISTRY.setdefault(module, []).append((name, fn, fusion))
        if required:
            _REQUIRED.add(name)
        return fn

    return deco


def all_passes() -> list[tuple[str, PassFn, bool]]:
    for m in PASS_MODULES:
        importlib.import_module(f"{__package__}.{m}")
    return [p for m in PASS_MODULES for p in _REGISTRY.get(m, [])]


def pass_names() -> list[str]:
    return [name for name, _, _ in all_passes()]


@dataclass
class PassReport:
    """What the passes did: nodes before/after, fusions per pass, canonicalization edits, refusals, and
    which pass made each fused node (the candidates; the pipeline then settles which of them run fused)."""

    nodes_before: int
    nodes_after: int = 0
    fusions: dict[str, int] = field(default_factory=dict)
    edits: dict[str, int] = field(default_factory=dict)
    refusals: list[Refusal] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    fused_by: dict[str, str] = field(default_factory=dict)  # fused node name -> the pass that made it

    @property
    def total_fused(self) -> int:
        return sum(self.fusions.values())


def run_passes(graph: Graph, disable: Iterable[str] = ()) -> PassReport:
    """Optimize `graph` in place. `disable` names passes to skip; an unknown name is an error."""
    passes = all_passes()
    disabled = set(disable)
    unknown = disabled - {name for name, _, _ in passes}
    if unknown:
        raise ValueError(f"unknown pass names {sorted(unknown)}; known: {[n for n, _, _ in passes]}")
    if disabled & _REQUIRED:
        raise ValueError(f"passes {sorted(disabled & _REQUIRED)} always run and cannot be disabled")
    report = PassReport(nodes_before=len(graph.nodes), disabled=sorted(disabled))
    for name, fn, fusion in passes:
        if name in disabled:
            continue
        result = PassResult(name)
        fn(graph, result)
        if fusion:
            report.fusions[name] = report.fusions.get(name, 0) + result.fused
            for n in graph.nodes:
                if n.is_fused:
                    report.fused_by.setdefault(n.name, name)
        elif result.changed:
            report.edits[name] = report.edits.get(name, 0) + result.changed
        report.refusals.extend(result.refusals)
    report.nodes_after = len(graph.nodes)
    return report
