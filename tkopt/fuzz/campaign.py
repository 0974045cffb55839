"""A fuzzing campaign: many seeds, each graph on its paths, failures shrunk into classes, one JSON result.

Every seed runs on "fx"; every `kernels_every`-th also on "fx-kernels" (TileLang CPU kernels), every
`onnx_every`-th through both ONNX exporters (static and dynamic, hybrid), every `native_every`-th
also with the native CPU op library. Failures are shrunk (within a total time budget) and grouped
by signature and by what their minimal graph contains.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .paths import Outcome, check, eager
from .render import InvalidSpec, load, render
from .shrink import checker, features, reproducer, shrink
from .spec import GraphSpec, generate

ONNX_SLICE = ("onnx-dynamo", "onnx-dynamo-static", "onnx-script", "onnx-script-static")


@dataclass
class Plan:
    kernels_every: int = 20  # 0: never
    onnx_every: int = 10
    native_every: int = 100
    timeout_s: int = 300  # per graph and path
    shrink_total_s: float = 1800.0  # all shrinking together
    shrink_each_s: float = 120.0
    shrink_per_signature: int = 5  # minimal reproducers per (path, signature); later ones are listed as found

    def paths(self, seed: int) -> list[str]:
        out = ["fx"]
        if self.kernels_every and seed % self.kernels_every == 0:
            out.append("fx-kernels")
        if self.onnx_every and seed % self.onnx_every == 0:
            out.extend(ONNX_SLICE)
        if self.native_every and seed % self.native_every == 0:
            out.append("onnx-dynamo-cpu")
        return out


@dataclass
class Failure:
    seed: int
    outcome: Outcome
    features: list[str]  # of the shrunk graph when shrunk, else of the original
    shrunk: bool = False
    reproducer: str | None = None


@dataclass
class Campaign:
    plan: Plan
    repro_dir: Path | None = None
    totals: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    rejections: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    graphs: int = 0
    shrink_spent: float = 0.0
    shrunk: Counter = field(default_factory=Counter)  # per (path, signature)

    def run(self, seeds: Iterable[int], log: Any = print) -> None:
        with tempfile.TemporaryDirectory(prefix="tkopt-fuzz-") as d:
            work = Path(d)
            for seed in seeds:
                self.run_seed(seed, work, log)
                if self.graphs % 25 == 0:
                    log(f"-- {self.graphs} graphs: " + "; ".join(
                        f"{p} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for p, c in self.totals.items()))

    def run_seed(self, seed: int, work: Path, log: Any = print) -> list[Outcome]:
        spec = generate(seed)
        try:
            mod = load(render(spec), work, f"fuzz_{seed}")
        except InvalidSpec as e:  # a generator bug: say so loudly, it must not hide graphs
            raise RuntimeError(f"seed {seed}: the generator drew an invalid spec: {e}") from e
        self.graphs += 1
        outcomes: list[Outcome] = []
        try:
            runs = _timed(self.plan.timeout_s, eager, mod)
        except (Exception, Timeout) as e:  # noqa: BLE001 - counted per path below
            runs = e
        for path in self.plan.paths(seed):
            if isinstance(runs, (Exception, Timeout)):
                o = Outcome(path, "rejected", f"eager: {type(runs).__name__}: {str(runs).splitlines()[0][:200]}")
            else:
                try:
                    o = _timed(self.plan.timeout_s, check, path, mod, runs)
                except Timeout:
                    o = Outcome(path, "timeout", f"no result within {self.plan.timeout_s} s")
                except Exception as e:  # noqa: BLE001 - the fuzzer's own bug: counted and shown, the run goes on
                    o = Outcome(path, "harness", f"{type(e).__name__}: {e}", where=_where(e))
            outcomes.append(o)
            self.totals[path][o.status] += 1
            if o.status == "rejected":
                self.rejections[_reason(o.detail)] += 1
            if o.failed or o.status in ("timeout", "harness"):
                # the same kind of failure on another path of this graph is most likely the same defect
                again = any(p.signature()[:2] == o.signature()[:2] for p in outcomes[:-1])
                f = self._failure(seed, spec, o, work, minimize=not again)
                self.failures.append(f)
                log(f"seed {seed}: {o}  [{'; '.join(f.features)}]" + (f" -> {f.reproducer}" if f.reproducer else ""))
        sys.modules.pop(f"fuzz_{seed}", None)
        return outcomes

    def _failure(self, seed: int, spec: GraphSpec, o: Outcome, work: Path, minimize: bool) -> Failure:
        key = (o.path, *o.signature())
        if (not minimize or not o.failed or self.shrink_spent >= self.plan.shrink_total_s
                or self.shrunk[key] >= self.plan.shrink_per_signature):
            return Failure(seed, o, features(spec))
        self.shrunk[key] += 1
        t = time.monotonic()
        budget = min(self.plan.shrink_each_s, self.plan.shrink_total_s - self.shrink_spent)
        small, small_o = shrink(spec, o, checker(o.path, work), budget)
        self.shrink_spent += time.monotonic() - t
        path = None
        if self.repro_dir is not None:
            self.repro_dir.mkdir(parents=True, exist_ok=True)
            path = self.repro_dir / f"seed{seed}_{o.path}.py"
            path.write_text(reproducer(small, small_o))
        return Failure(seed, small_o, features(small), shrunk=True, reproducer=str(path) if path else None)

    def classes(self) -> list[dict[str, Any]]:
        """Failures grouped by (status, error, where) and the shrunk graph's features."""
        groups: dict[tuple, list[Failure]] = defaultdict(list)
        for f in self.failures:
            key = (*f.outcome.signature(), tuple(f.features) if f.shrunk else ("(not shrunk)",))
            groups[key].append(f)
        out = []
        for (status, error, where, feats), fs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            out.append({
                "status": status, "error": error, "where": where, "minimal_graph": list(feats), "count": len(fs),
                "paths": sorted({f.outcome.path for f in fs}), "seeds": [f.seed for f in fs][:20],
                "example": str(fs[0].outcome), "reproducer": next((f.reproducer for f in fs if f.reproducer), None),
            })
        return out

    def to_dict(self, command: str, elapsed_s: float) -> dict[str, Any]:
        import onnx
        import onnxruntime
        import torch

        return {
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": round(elapsed_s, 1),
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
                         "onnxruntime": onnxruntime.__version__},
            "plan": asdict(self.plan),
            "graphs": self.graphs,
            "totals": {p: dict(c) for p, c in self.totals.items()},
            "rejections": dict(self.rejections.most_common()),
            "classes": self.classes(),
            "failures": [{"seed": f.seed, **asdict(f.outcome), "features": f.features, "shrunk": f.shrunk,
                          "reproducer": f.reproducer} for f in self.failures],
        }


def _where(e: BaseException) -> str:
    f = traceback.extract_tb(e.__traceback__)[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _reason(detail: str) -> str:
    """A rejection's reason without its specifics (names, numbers, ORT's error prefix), for counting."""
    text = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", detail)
    text = re.sub(r"'[^']*'|\d+(\.\d+)?(e-?\d+)?", "_", text)
    return text[:160]


class Timeout(BaseException):
    """A check ran past its time (a BaseException, so that no `except Exception` inside swallows it)."""


def _timed(seconds: int, fn: Any, *args: Any) -> Any:
    """fn(*args), interrupted with Timeout after `seconds` (SIGALRM: main thread only)."""

    def alarm(signum: int, frame: Any) -> None:
        raise Timeout(f"timed out after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
