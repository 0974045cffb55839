"""The coverage matrix on a fast subset, with the fusion counts each cell must reach (the full matrix:
`tkopt coverage --out benchmarks/results/coverage.md`)."""

from __future__ import annotations

import pytest

from tkopt.cli import main
from tkopt.coverage import cases, run

# (model, entry point) -> fusions per layer: attention, norm, GEMM-family (gemm + gemm_group + gated_mlp)
EXPECTED = {
    ("nn.TransformerEncoderLayer", "compile"): (1, 2, 4),
    ("nn.TransformerEncoderLayer", "backend"): (1, 2, 4),  # eval fast path: q, k, v projected apart, one group
    ("nn.TransformerEncoderLayer", "backend_train"): (1, 2, 4),
    ("nn.TransformerEncoderLayer", "onnx_static"): (1, 2, 4),
    ("blocks.llama_block", "onnx_torchscript"): (1, 2, 4),  # q, k, v one group; o, down; gate/up one gated MLP
}


def test_subset_matches_eager_with_expected_fusions() -> None:
    models = sorted({m for m, _ in EXPECTED})
    entries = sorted({e for _, e in EXPECTED})
    rows, cells = run(models, entries)
    by_case = {c.name: c for c in rows}
    checked = 0
    for cell in cells:
        want = EXPECTED.get((cell.model, cell.entry))
        if want is None:
            continue
        case = by_case[cell.model]
        assert cell.error is None, cell.error
        assert cell.ok(case), (cell.model, cell.entry, cell.max_rel, cell.fusions, cell.refusals)
        assert tuple(cell.per_layer(case).values()) == want, (cell.model, cell.entry, cell.fusions)
        checked += 1
    assert checked == len(EXPECTED)


def test_command_writes_the_table(tmp_path) -> None:
    out = tmp_path / "coverage.md"
    assert main(["coverage", "--models", "nn.MultiheadAttention", "--entries", "compile", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Command: `tkopt coverage --models nn.MultiheadAttention --entries compile`" in text
    assert "| nn.MultiheadAttention | ✓ 1/0/2 · " in text


def test_unknown_names_are_one_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown models \\['nope'\\]"):
        run(["nope"])
    with pytest.raises(ValueError, match="unknown entry points \\['nope'\\]"):
        run([cases()[0].name], ["nope"])
