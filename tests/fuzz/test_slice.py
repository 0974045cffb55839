"""The fuzzer's fixed CI slice: seeded random graphs, fused against eager, on every path.

Most seeds run tkopt.compile with the fused ops' torch references (the graph rewriting is under test);
a few run TileLang's CPU kernels, both ONNX exporters, and the native CPU op library. A seed may be
rejected (eager, the exporter or ORT cannot run it: not ours), never wrong or crashing. Seeds that
show a known, open defect are strict xfails naming it: fixing the defect turns them into failures
that ask for the mark to go. `python -m tkopt.fuzz --help` runs the same checks at scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tkopt.fuzz.paths import check
from tkopt.fuzz.render import load, render
from tkopt.fuzz.spec import generate

FX_SEEDS = range(40)
SLICE = [(seed, "fx") for seed in FX_SEEDS] + [
    (1, "fx-kernels"), (26, "fx-kernels"), (180, "fx-kernels"),
    (1, "onnx-dynamo"), (35, "onnx-dynamo"), (43, "onnx-dynamo-static"),
    (44, "onnx-script"), (50, "onnx-script"), (26, "onnx-script-static"), (92, "onnx-script"), (6, "onnx-dynamo-cpu"),
    # graphs that showed issue 8's defects 2, 3, 5 and 6 before they were fixed (and, in float64, the
    # fx-kernels 180 and onnx-script 92 above: kernel constants and fused ops' float attributes; fx 1047: a
    # -1e9 additive mask scaled after it is added, in float64, computed as S * c + M * c)
    (57, "fx"), (98, "fx"), (98, "onnx-dynamo"), (30, "onnx-dynamo"), (1047, "fx"),
    # fx 3618 (campaign 2026-12-06 f): a query row that reaches a maskless SDPA as NaN, to which torch's CPU flash
    # kernel gives 0 (FusedAttention's guard "sdpa")
    (3618, "fx"), (3618, "fx-kernels"),
]
# (seed, path) -> the open defect it shows; strict xfails
KNOWN: dict[tuple[int, str], str] = {}


def _param(seed: int, path: str) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN[seed, path])] if (seed, path) in KNOWN else []
    return pytest.param(seed, path, marks=marks, id=f"{path}-{seed}")


@pytest.mark.parametrize(("seed", "path"), [_param(s, p) for s, p in SLICE])
def test_fuzz_slice(seed: int, path: str, tmp_path: Path) -> None:
    outcome = check(path, load(render(generate(seed)), tmp_path, f"fuzz_slice_{seed}"))
    assert outcome.status in ("ok", "rejected"), str(outcome)
