"""benchmarks/whole_models.py's interleaved rounds, with stand-in variants on the CPU: every variant timed once per
round, the order rotated, its median over the rounds reported. The numbers are the H200's business."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "whole_models.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("whole_models_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    module.DEVICE = "cpu"  # perf_counter timing, as the script's --device cpu smoke run
    return module


def test_interleaved_rounds_rotate_the_order_and_report_the_median_of_rounds() -> None:
    wm = _bench_module()
    calls: list[str] = []
    timed = {name: (lambda name=name: calls.append(name)) for name in ("eager", "inductor", "tkopt")}
    variants = {name: {"median_ms": 9.0} for name in timed}
    wm.interleaved(timed, variants, argparse.Namespace(rounds=3, runs=2, warm_s=0.0))
    per_turn = 3 + 2  # warm-up calls, then timed ones
    turns = calls[::per_turn]
    assert len(calls) == 9 * per_turn and calls == [n for n in turns for _ in range(per_turn)]
    assert turns == ["eager", "inductor", "tkopt", "inductor", "tkopt", "eager", "tkopt", "eager", "inductor"]
    for v in variants.values():
        assert v["sequential_ms"] == 9.0 and len(v["round_ms"]) == 3
        assert v["median_ms"] == statistics.median(v["round_ms"])


def test_one_variant_or_no_rounds_keeps_the_sequential_timing() -> None:
    wm = _bench_module()
    variants = {"eager": {"median_ms": 9.0}, "tkopt": {"median_ms": 8.0}}
    wm.interleaved({"eager": lambda: None}, variants, argparse.Namespace(rounds=3, runs=2, warm_s=0.0))
    wm.interleaved({"eager": lambda: None, "tkopt": lambda: None}, variants,
                   argparse.Namespace(rounds=0, runs=2, warm_s=0.0))
    assert variants == {"eager": {"median_ms": 9.0}, "tkopt": {"median_ms": 8.0}}


def test_a_model_served_at_another_size_is_called_at_its_compile_size_first_then_timed_at_the_served_size() -> None:
    wm = _bench_module()
    wm.DTYPE = torch.float32  # as the script's --device cpu smoke run
    seen: list[tuple[int, ...]] = []

    class Recorder(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(tuple(x.shape))
            return super().forward(x)

    model = wm.Model("served", lambda: Recorder(4, 4), lambda: (torch.randn(1, 8, 4),),
                     compile_inputs=lambda: (torch.randn(2, 3, 4),))
    args = argparse.Namespace(runs=2, warmup=1, warm_s=0.0, profile=False, rounds=0)
    row = wm.run_model(model, ["eager"], args, {"tflops": 1.0, "copy_tb_s": 1.0})
    assert "error" not in row["variants"]["eager"], row["variants"]["eager"]
    first = seen.index((2, 3, 4))
    assert seen[first + 1] == (1, 8, 4) and set(seen[first + 1:]) == {(1, 8, 4)}


class _Shared(nn.Linear):
    """Models of one class: one forward code object, as the transformers models' LastHidden wrapper."""


def test_every_model_gets_a_fresh_dynamo_and_a_variant_that_ran_eagerly_is_an_error(monkeypatch) -> None:
    """Two models sharing a forward code object under a recompile limit of 1: each model's torch.compile variant
    compiles (Dynamo is reset per model); without the reset the second one runs eagerly, and its row says so."""
    wm = _bench_module()
    wm.DTYPE = torch.float32
    args = argparse.Namespace(runs=2, warmup=1, warm_s=0.0, profile=False, rounds=0)
    ceil = {"tflops": 1.0, "copy_tb_s": 1.0}

    def rows() -> list[dict]:
        models = [wm.Model(f"m{i}", lambda: _Shared(4, 4), lambda: (torch.randn(2, 4),)) for i in range(2)]
        return [wm.run_model(m, ["eager", "inductor"], args, ceil)["variants"]["inductor"] for m in models]

    with torch._dynamo.config.patch(recompile_limit=1):
        assert all("error" not in v for v in rows())
        monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
        first, second = rows()
    assert "error" not in first or "no graph" in first["error"]
    assert "Dynamo compiled no graph" in second.get("error", ""), second
