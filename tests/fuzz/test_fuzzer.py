"""The fuzzer itself: seeded generation, rendering, classification of outcomes, shrinking, reproducers."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tkopt.fuzz.paths import Outcome, check, classify, compare, eager
from tkopt.fuzz.render import load, render
from tkopt.fuzz.shrink import features, reproducer, shrink
from tkopt.fuzz.spec import OPTIONS, Block, GraphSpec, generate


def test_seeds_are_deterministic_and_cover_every_option() -> None:
    assert render(generate(7)) == render(generate(7)) and render(generate(7)) != render(generate(8))
    seen: set[tuple[str, str, object]] = set()
    for seed in range(600):
        spec = generate(seed)
        ast.parse(render(spec))
        assert GraphSpec.from_json(spec.to_json()) == spec
        seen |= {(b.kind, k, v) for b in spec.blocks for k, v in b.opts.items()}
    missing = [(kind, k, v) for kind, opts in OPTIONS.items() for k, vs in opts.items() for v in vs
               if (kind, k, v) not in seen]
    assert not missing


def test_generated_modules_run_in_eager(tmp_path: Path) -> None:
    """A graph eager rejects is counted, not checked: the generator must not waste seeds on them."""
    for seed in range(40):
        eager(load(render(generate(seed)), tmp_path, f"fuzz_eager_{seed}"))


def test_compare_holds_nan_and_inf_to_their_places() -> None:
    want = torch.tensor([1.0, float("nan"), float("-inf")])
    assert compare([want.clone()], [want]) is None
    assert "NaN" in compare([torch.tensor([1.0, 0.0, float("-inf")])], [want])
    assert "-inf" in compare([torch.tensor([1.0, float("nan"), -1e30])], [want])
    assert "max abs error" in compare([torch.tensor([1.001, float("nan"), float("-inf")])], [want])
    one = torch.tensor([1.0], dtype=torch.float64)
    assert compare([one + 1e-12], [one]) is None and compare([one + 1e-6], [one]) is not None


def _default(kind: str, /, **opts: object) -> Block:
    return Block(kind, {**{k: v[0] for k, v in OPTIONS[kind].items()}, **opts})


def test_shrink_keeps_only_what_the_failure_needs() -> None:
    """Greedy shrinking against a failure that needs a band-masked attention block and nothing else."""
    big = GraphSpec(seed=1, dtype="float64", batch=3, seq=9, head_dim=5, heads=4, kv_heads=2, ffn=9, max_seq=26,
                    window=3, blocks=[_default("mlp", act="gelu_tanh_hand", prenorm="rms_norm_hand"),
                                      _default("attention", mask="band_buffer", form="decomposed", fill="-1e4"),
                                      _default("norm", kind="layer_norm_hand"), _default("reuse", kind="side_output")])
    failure = Outcome("fx", "wrong", "value", error="value")

    def run(spec: GraphSpec) -> Outcome:
        band = any(b.kind == "attention" and b.opts["mask"] == "band_buffer" for b in spec.blocks)
        return failure if band else Outcome("fx", "ok")

    small, outcome = shrink(big, failure, run)
    assert outcome is failure
    assert features(small) == ["attention(mask=band_buffer)", "float32"]
    assert (small.batch, small.seq, small.heads, small.kv_heads, small.head_dim) == (1, 1, 1, 1, 1)


def test_classify_tells_tkopt_crashes_from_rejections() -> None:
    from tkopt.backends.torch_module import to_torch_module
    from tkopt.ir import Graph

    with pytest.raises(ValueError) as crash:
        to_torch_module(Graph("g"))
    o = classify("fx", crash.value, (2, 3))
    assert o.status == "crash" and o.error == "ValueError" and o.where.startswith("tkopt/backends/torch_module.py:")
    with pytest.raises(ZeroDivisionError) as user:
        _ = 1 / 0
    assert classify("fx", user.value, None).status == "rejected"


def test_graph_torch_export_rejects_is_counted_not_ours(tmp_path: Path) -> None:
    spec = GraphSpec(seed=3, dtype="float32", batch=2, seq=3, head_dim=2, heads=2, kv_heads=2, ffn=4, max_seq=14,
                     window=1, blocks=[_default("linear")])
    source = render(spec).replace("        h = x\n", "        h = x\n        if h.sum() > 0:\n            h = h * 2\n")
    o = check("fx", load(source, tmp_path, "data_dependent"))
    assert o.status == "rejected" and o.detail.startswith("torch.export:"), o


def test_reproducer_runs_standalone(tmp_path: Path) -> None:
    spec = GraphSpec(seed=5, dtype="float32", batch=2, seq=3, head_dim=2, heads=2, kv_heads=1, ffn=5, max_seq=14,
                     window=1, blocks=[_default("attention", mask="causal_tril", gqa="expand_reshape")])
    mod = load(render(spec), tmp_path, "fuzz_repro_5")
    outcome = check("fx", mod)
    assert outcome.status == "ok" and outcome.fused["attention"] == 1 and outcome.shapes == spec.shapes()
    script = tmp_path / "repro.py"
    script.write_text(reproducer(spec, outcome))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TKOPT_KERNELS": "reference"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("fx: ok")
