"""Shrink a failing spec to a minimal one that fails the same way, and write it as a reproducer.

Greedy: take the first simplification (`spec.simpler`: drop a block, set an option to its simplest
value, shrink a size) that still fails on the same path with the same signature, and start over
from it; stop when none does or the budget of checks is spent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .paths import Outcome, check
from .render import InvalidSpec, load, render
from .spec import OPTIONS, GraphSpec, simpler

Checker = Callable[[GraphSpec], Outcome | None]


def checker(path: str, workdir: Path) -> Checker:
    """A function running `path` on a spec (None if the spec does not render)."""
    count = 0

    def run(spec: GraphSpec) -> Outcome | None:
        nonlocal count
        count += 1
        try:
            source = render(spec)
        except InvalidSpec:
            return None
        return check(path, load(source, workdir, f"fuzz_shrink_{spec.seed}_{count}"))

    return run


def shrink(spec: GraphSpec, failure: Outcome, run: Checker, budget_s: float = 120.0) -> tuple[GraphSpec, Outcome]:
    """The smallest spec found that `run` fails with `failure`'s signature, and that failure."""
    deadline = time.monotonic() + budget_s
    best, best_outcome = spec, failure
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in simpler(best):
            if time.monotonic() >= deadline:
                break
            o = run(cand)
            if o is not None and o.failed and o.signature() == failure.signature():
                best, best_outcome, improved = cand, o, True
                break
    return best, best_outcome


def features(spec: GraphSpec) -> list[str]:
    """What a (shrunk) spec has that the simplest graph does not: names a failure class."""
    out = []
    for b in spec.blocks:
        extra = [f"{k}={v}" for k, v in b.opts.items() if v != OPTIONS[b.kind][k][0]]
        out.append(b.kind + (f"({', '.join(extra)})" if extra else ""))
    if spec.kv_heads < spec.heads:
        out.append(f"gqa {spec.heads}/{spec.kv_heads}")
    out.append(spec.dtype)
    return out


def reproducer(spec: GraphSpec, outcome: Outcome) -> str:
    """A standalone script: the module's source and the check that fails on it."""
    return render(spec) + (
        "\n\nif __name__ == \"__main__\":\n"
        "    import sys\n\n"
        "    from tkopt.fuzz.paths import check\n\n"
        f"    # fuzzing saw: {outcome}\n"
        f"    print(check({outcome.path!r}, sys.modules[__name__]))\n"
    )
