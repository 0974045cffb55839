"""The `tkopt` command: optimize writes a checked model and reports; bad input is one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch

from tests.onnx.exports import Block, export
from tkopt.cli import main

# The TorchScript exporter is deprecated upstream but is one of the two exporters users run.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(Block().eval(), tmp_path_factory.mktemp("cli") / "block.onnx", False, 17, torch.randn(2, 3, 8))


def test_optimize_writes_default_output(model: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["optimize", str(model)]) == 0
    out = model.with_name("block.tkopt.onnx")
    optimized = onnx.load(str(out))
    onnx.checker.check_model(optimized)
    assert any(n.domain == "tkopt" for n in optimized.graph.node)
    text = capsys.readouterr().out
    assert "fusions" in text and "ok" in text  # report and accuracy table


def test_optimize_json_disable(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(model), "-o", str(out), "--disable", "gemm", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["output"] == str(out) and rep["disabled"] == ["gemm"] and "gemm" not in rep["fusions"]
    assert rep["accuracy"]["ok"] and rep["nodes_after"] <= rep["nodes_before"]
    assert out.exists()


def test_list_passes(capsys: pytest.CaptureFixture) -> None:
    assert main(["optimize", "--list-passes"]) == 0
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert "gemm" in names and "attention" in names


@pytest.mark.parametrize("case", ["garbage", "missing", "unknown_pass"])
def test_bad_input_one_line_error(case: str, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "in.onnx"
    args = ["optimize", str(src), "-o", str(tmp_path / "out.onnx"), "--no-check-accuracy"]
    if case == "garbage":
        src.write_bytes(b"\x08\x07garbage" * 50)
    elif case == "unknown_pass":
        src.write_bytes(model.read_bytes())
        args += ["--disable", "no_such_pass"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("tkopt: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert ("no_such_pass" if case == "unknown_pass" else "in.onnx") in err
    assert not (tmp_path / "out.onnx").exists()
    assert sorted(os.listdir(tmp_path)) == (["in.onnx"] if case != "missing" else [])


def test_console_script(tmp_path: Path) -> None:
    """The installed entry point exits non-zero with one line and no traceback."""
    exe = Path(sys.executable).with_name("tkopt")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tkopt.cli"]
    r = subprocess.run([*cmd, "optimize", str(tmp_path / "nope.onnx")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "nope.onnx" in r.stderr


@pytest.mark.slow
def test_demo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The demo exports the bundled example (dynamo exporter), optimizes it for the CPU op library with
    measured selection, and checks accuracy: every candidate gets a measured decision."""
    assert main(["demo", "--workdir", str(tmp_path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["target"] == "ort-cpu" and rep["select"] == "measured" and rep["accuracy"]["ok"]
    assert sum(rep["candidates"].values()) == len(rep["nodes"]) > 0
    assert all(n["decision"] in ("kept", "slower") and n["fused_ms"] > 0 for n in rep["nodes"])
    assert (tmp_path / "example.tkopt.onnx").exists()


def test_no_fusable_pattern_is_said(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["optimize", str(path)]) == 0
    assert f"no fusable pattern found in {path}" in " ".join(capsys.readouterr().out.split())
    out = onnx.load(str(tmp_path / "relu.tkopt.onnx"))
    assert [n.op_type for n in out.graph.node] == ["Relu"]


def test_select_measured_without_a_target_is_one_line(model: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """Without --target the fused ops run their references: there is nothing to measure, and it says so."""
    assert main(["optimize", str(model), "-o", str(tmp_path / "o.onnx"), "--select", "measured"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tkopt: error: select='measured' needs a device to measure on (onnx)")
    assert err.count("\n") == 1
    assert not (tmp_path / "o.onnx").exists()
