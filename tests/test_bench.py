"""`tkopt bench`: real exports, real ORT sessions, the real CPU op library and TileLang CPU kernels."""

from __future__ import annotations

import json
import math

import pytest

from tkopt.bench import BenchResult, bench_onnx
from tkopt.bench_torch import bench_module
from tkopt.cli import main
from tkopt.models.blocks import EXPECTED_FUSIONS, REFERENCE_MODELS
from tkopt.models.export import export_onnx


@pytest.fixture(scope="module")
def onnx_models(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("bench")
    out = {}
    for name in ("mlp", "bert_layer"):
        model, inputs = REFERENCE_MODELS[name]()
        out[name] = export_onnx(model, inputs, d / f"{name}.onnx", dynamo=True)
    return out


@pytest.fixture(scope="module")
def bert_cpu(onnx_models) -> BenchResult:
    """The BERT-style layer benched on the CPU op library (building it is the slow part: once per module)."""
    return bench_onnx(onnx_models["bert_layer"], target="cpu", runs=5, warmup=1, select="all")


def _finite(t) -> bool:
    return all(math.isfinite(x) and x > 0 for x in (t.median_ms, t.p10_ms, t.p90_ms)) and t.p10_ms <= t.p90_ms


def test_onnx_cpu_library_errors_latency_and_speedup(bert_cpu):
    r = bert_cpu
    assert r.claims_speedup and r.fused_runner.startswith("ort + tkopt op library")
    assert set(r.timings) == {"unfused", "fused"} and all(_finite(t) for t in r.timings.values())
    assert r.timings["fused"].runs == 5 and r.timings["fused"].method == "perf_counter"
    assert r.outputs and all(o.dtype == "float32" and o.max_rel < 1e-5 for o in r.outputs)
    assert r.speedups()["fused"] == pytest.approx(r.timings["unfused"].median_ms / r.timings["fused"].median_ms)
    assert r.fusions == {k: v for k, v in EXPECTED_FUSIONS["bert_layer"].items() if k in r.fusions}


def test_onnx_every_fused_node_has_a_row(bert_cpu):
    rows = bert_cpu.nodes
    fused = [k for k, v in bert_cpu.optimization["ops_after"].items() for _ in range(v) if k.startswith("tkopt::")]
    assert len(rows) == len(fused) == 7  # 3 gemm + the q, k, v group + attention + 2 add+norm
    assert sorted(n.op for n in rows) == sorted(k.removeprefix("tkopt::") for k in fused)
    for n in rows:
        assert n.note == "" and n.replaced >= 1, n
        assert _finite(n.fused) and _finite(n.unfused), n
        assert n.outputs and all(o.max_rel < 1e-5 for o in n.outputs), n
        assert n.speedup is not None and n.speedup > 0
    attention = next(n for n in rows if n.op == "FusedAttention")
    assert attention.replaced >= 5  # the matmuls, scale, mask add, softmax it stands for


def test_json_holds_everything(bert_cpu, tmp_path):
    path = bert_cpu.write_json(tmp_path / "out" / "bench.json")
    d = json.loads(path.read_text())
    assert d == json.loads(bert_cpu.to_json())
    s = d["summary"]
    assert s["ok"] and s["fused_nodes"] == 7 and s["speedup"] > 0 and s["node_max_rel_error"] < 1e-5
    assert d["timings"]["unfused"]["median_ms"] > 0 and len(d["nodes"]) == 7
    assert d["optimization"]["target"] == "ort-cpu" and d["inputs"]
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temporary file left


def test_cli_hybrid_prints_tables_and_writes_json(onnx_models, tmp_path, capsys):
    out = tmp_path / "mlp.json"
    rc = main(["bench", str(onnx_models["mlp"]), "--target", "none", "--runs", "3", "--warmup", "1", f"--json={out}"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "latency (ms)" in text and "outputs: fused vs unfused" in text and "hybrid" in text
    assert "no speed claim" in text and "speedup vs unfused" in text
    d = json.loads(out.read_text())
    assert not d["claims_speedup"] and d["summary"]["speedup"] is None and set(d["timings"]) == {"unfused"}
    assert d["summary"]["outputs_ok"] and len(d["nodes"]) == 3
    assert all(n["fused"] is None and n["unfused"]["median_ms"] > 0 and n["ok"] for n in d["nodes"])


def test_cli_missing_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.onnx"
    assert main(["bench", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tkopt: error:") and str(missing) in err and "\n" not in err


def test_cli_bad_runs_is_refused(onnx_models, capsys):
    assert main(["bench", str(onnx_models["mlp"]), "--runs", "0"]) == 2
    assert "--runs" in capsys.readouterr().err


def test_bench_module_on_cpu():
    model, inputs = REFERENCE_MODELS["mlp"]()
    r = bench_module(model, inputs, runs=3, warmup=1, name="mlp", select="all")
    assert r.kind == "torch" and r.device == "cpu" and r.claims_speedup
    assert set(r.timings) == {"eager", "tkopt"}  # no inductor on CPU by default
    assert all(_finite(t) for t in r.timings.values())
    assert [o.name for o in r.outputs] == ["output"] and r.outputs[0].max_rel < 1e-5
    assert r.fusions["gemm"] == 3 and len(r.nodes) == 3
    for n in r.nodes:
        assert n.op == "FusedGemm" and n.replaced >= 1 and not n.note
        assert _finite(n.fused) and _finite(n.unfused) and n.outputs[0].max_rel < 1e-5
    assert json.loads(r.to_json())["summary"]["fused_nodes"] == 3
