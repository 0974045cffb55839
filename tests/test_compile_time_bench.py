"""benchmarks/compile_time.py's CPU smoke run: four fresh processes per model (torch.compile and tkopt.compile,
cold and warm), each compiling at one size and then serving another, each result and ratio written as JSON and
markdown. The numbers are the H200's business."""

from __future__ import annotations

import json
import os
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_time.py"


@pytest.mark.slow  # bytecode for torch, then four fresh interpreters, two compiling with inductor: ~40 s
def test_cpu_smoke_run_measures_cold_and_warm_in_fresh_processes(tmp_path) -> None:
    env = dict(os.environ, TKOPT_KERNELS="reference")  # the script, not TileLang's CPU compiles, is under test
    r = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--calls", "2", "--out", str(tmp_path),
                        "--profile", "--compile-bytecode"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "compile_time.json").read_text())
    assert result["meta"]["bytecode caches"] == "compiled ahead" and result["meta"]["bytecode compiled ahead, s"] > 0
    [row] = result["results"]
    name = "encoder_layer_tiny_1x24_from_2x16"
    assert row["model"] == name
    for variant in ("torch_compile", "tkopt"):
        for run in ("cold", "warm"):
            v = row["runs"][variant][run]
            assert "error" not in v and 0 < v["first_call_s"] < v["first_call_s"] + v["resize_s"] < v["process_s"], v
            assert len(v["after_ms"]) == 2 and v["max_rel_err"] < 1e-4, v
            assert 0 < v["build_s"] < v["first_call_s"] and "cumulative" in v["profile"], v
            profile = pstats.Stats(str(tmp_path / f"{name}-{variant}-{run}.prof"))
            assert profile.total_tt > 0
    tkopt = row["runs"]["tkopt"]
    first, served = tkopt["cold"]["laps"]["first"], tkopt["cold"]["laps"]["served"]
    assert {"passes", "kernels", "emit"} <= set(first["seconds"]) and tkopt["warm"]["laps"]["first"]["fused"]
    # the served size was exported again (a second specialization), with its own report: its first call holds that
    assert served["seconds"]["export"] < tkopt["cold"]["resize_s"] and served["seconds"] != first["seconds"]
    cold, warm = row["ratios"]["cold"], row["ratios"]["warm"]
    assert cold == tkopt["cold"]["first_call_s"] / row["runs"]["torch_compile"]["cold"]["first_call_s"] and warm > 0
    resize = row["resize"]
    assert resize["cold"] == tkopt["cold"]["resize_s"] / row["runs"]["torch_compile"]["cold"]["resize_s"]
    md = (tmp_path / "compile_time.md").read_text()
    assert f"| {name} | {row['runs']['torch_compile']['cold']['first_call_s']:.1f} |" in md
    assert f"{cold:.2f}x | {warm:.2f}x" in md
    assert f"| {name} | warm | first |" in md and f"| {name} | cold | served |" in md
    assert f"| {name} | {row['runs']['torch_compile']['cold']['resize_s']:.1f} |" in md
    assert f"{resize['cold']:.2f}x | {resize['warm']:.2f}x |" in md
