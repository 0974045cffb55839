"""The `tkopt` command as a newcomer meets it (issue 12's first hour): real exports of the bundled blocks through
both exporters (the dynamo one with external data), real CLI runs, real ORT sessions on what was written."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import tkopt
from tkopt.cli import main
from tkopt.models.blocks import REFERENCE_MODELS
from tkopt.models.export import export_onnx
from tkopt.ort.run import make_inputs

# The TorchScript exporter is deprecated upstream but is one of the two exporters users run.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The MLP and GPT-2-style blocks, each through the dynamo exporter (weights in external data, as
    torch.onnx.export writes them by default) and the TorchScript one."""
    d = tmp_path_factory.mktemp("exports")
    out = {}
    for name in ("mlp", "gpt2_block"):
        model, inputs = REFERENCE_MODELS[name]()
        out[f"{name}_dynamo"] = export_onnx(model, inputs, d / f"{name}_dynamo.onnx", dynamo=True, external_data=True)
        out[f"{name}_ts"] = export_onnx(model, inputs, d / f"{name}_ts.onnx", dynamo=False)
    return out


def _copy(src: Path, dst_dir: Path) -> Path:
    """The model with its data file (re-saved, so the data's name follows the copy's)."""
    dst = dst_dir / src.name
    onnx.save_model(onnx.load(str(src)), str(dst), save_as_external_data=bool(list(src.parent.glob(f"{src.name}.*"))),
                    location=f"{src.name}.data")
    return dst


def _one_line_error(err: str, *needles: str) -> None:
    assert err.startswith("tkopt: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def _outputs_match(original: Path, optimized: Path) -> None:
    """The written model loads (its library registered) and computes what the original does."""
    model = onnx.load(str(original))
    feeds = make_inputs(model, sizes=(3, 5))
    want = ort.InferenceSession(str(original)).run(None, feeds)
    got = tkopt.ort.InferenceSession(optimized).run(None, feeds)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# ---- 1. re-running replaces the output as one transaction --------------------------------------
def test_rerun_replaces_model_data_and_library(exports: dict[str, Path], tmp_path: Path, monkeypatch,
                                               capsys) -> None:
    """Optimizing a dynamo export (external data) twice in its own folder failed the second time ("External
    data file exists": onnx checks the data file's name against the working directory). Now each run
    writes its data and library under names of their content, replaces the model last, and removes what
    the old model read: one model, one data file, one library, always consistent."""
    model = _copy(exports["mlp_dynamo"], tmp_path)
    monkeypatch.chdir(tmp_path)
    args = ["optimize", model.name, "--target", "cpu", "--select", "all", "--json", "-q"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*args, "--disable", "gemm"]) == 0  # different content: new data, no library
    second = json.loads(capsys.readouterr().out)
    assert main(args) == 0  # and back
    third = json.loads(capsys.readouterr().out)
    out = tmp_path / "mlp_dynamo.tkopt.onnx"
    assert first["total_fused"] == third["total_fused"] == 3 and second["total_fused"] == 0
    written = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("mlp_dynamo.tkopt", "mlp_dynamo.tkopt-")))
    data = [n for n in written if n.endswith(".data")]
    libs = [n for n in written if n.endswith(".so")]
    assert len(data) == 1 and len(libs) == 1 and len(written) == 3, written
    assert third["library"] == libs[0] and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    meta = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert meta["tkopt.op_library"] == libs[0] and meta["tkopt.target"] == "cpu"
    _outputs_match(model, out)


def test_a_failed_save_leaves_the_old_output_whole(exports: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    """A failure at the commit (the model's own rename) leaves the previous model, data and library as they
    were, and nothing new beside them."""
    import tkopt.backends.onnx_model as backend

    model = _copy(exports["mlp_dynamo"], tmp_path)
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(model), "-o", str(out), "--target", "cpu", "--select", "all", "-q"]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_replace = os.replace

    def failing(src, dst):  # noqa: ANN001 - os.replace's own signature
        if Path(dst) == out:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(backend.os, "replace", failing)
    code = main(["optimize", str(model), "-o", str(out), "--target", "cpu", "--select", "all", "--disable", "gemm",
                 "-q", "--no-check-accuracy"])
    assert code == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    _outputs_match(model, out)


# ---- 2. the default writes what ONNX Runtime runs -----------------------------------------------
def test_default_target_writes_a_model_ort_runs(exports: dict[str, Path], tmp_path: Path, capsys) -> None:
    """No --target: "auto", which on a machine without a CUDA GPU and onnxruntime-gpu is the CPU library,
    and the report says why. (The TorchScript GPT-2 block: measured selection unfuses its attention, whose
    fallback reads a mask made after it; that export failed onnx.checker before.)"""
    out = tmp_path / "g.onnx"
    assert main(["optimize", str(exports["gpt2_block_ts"]), "-o", str(out), "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    if shutil.which("nvcc") is None or "CUDAExecutionProvider" not in ort.get_available_providers():
        assert rep["target"] == "ort-cpu" and rep["notes"][0].startswith("--target auto chose cpu: ")
    assert rep["accuracy"]["ok"] and rep["output"] == str(out)
    _outputs_match(exports["gpt2_block_ts"], out)


def test_no_library_says_what_the_output_needs(exports: dict[str, Path], tmp_path: Path, capsys) -> None:
    """--target none writes fused nodes without a library: the report says ONNX Runtime cannot load it, and
    that is true."""
    out = tmp_path / "m.onnx"
    assert main(["optimize", str(exports["mlp_ts"]), "-o", str(out), "--target", "none", "--no-check-accuracy"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "note: the model has tkopt fused nodes and no op library: ONNX Runtime cannot load it" in text
    with pytest.raises(Exception, match="tkopt"):
        ort.InferenceSession(str(out))


# ---- 3. a GPU target on a machine that cannot run it ---------------------------------------------
@pytest.mark.slow
def test_gpu_target_without_cuda_ort_builds_reports_what_it_wrote(exports: dict[str, Path], tmp_path: Path,
                                                                   capsys) -> None:
    """--target sm90 where no CUDA onnxruntime is: the library is built (nvcc), selection keeps every fusion
    with a kernel (nothing to measure on), the accuracy check runs the fused ops' references instead of
    crashing in ORT, each with one line saying so, and the report counts what the written model holds (the
    attention at head dim 16 among it: nvcc builds its sm90 kernel into the library)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime has the CUDA provider here")
    out = tmp_path / "g.onnx"
    assert main(["optimize", str(exports["gpt2_block_dynamo"]), "-o", str(out), "--target", "sm90",
                 "--disable", "gemm", "--json"]) == 0
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    assert any("the sm90 op library is built, not run: " in n and "torch references" in n for n in rep["notes"])
    assert rep["select"] == "all" and rep["accuracy"]["ok"] and rep["accuracy"]["fused_runner"] == "hybrid"
    assert "Traceback" not in captured.err and "kernel failed" not in captured.err
    written = onnx.load(str(out), load_external_data=False)
    fused_ops = sorted(n.op_type for n in written.graph.node if n.domain == "tkopt")
    kept = sorted(n["op"] for n in rep["nodes"] if n["decision"] == "kept")
    assert fused_ops == kept == ["FusedAddNorm", "FusedAddNorm", "FusedAttention"] and rep["total_fused"] == 3
    assert not [n for n in rep["nodes"] if n["decision"] == "kernel_failed"]
    assert {p.key: p.value for p in written.metadata_props}["tkopt.target"] == "sm90"
    assert Path(rep["library"]).is_file()
    with pytest.raises(tkopt.ort.OpLibraryError, match="built for sm90, which runs on ONNX Runtime's CUDA provider"):
        tkopt.ort.InferenceSession(out)
    assert main(["optimize", str(exports["mlp_dynamo"]), "-o", str(out), "--target", "sm90", "--select",
                 "measured"]) == 2
    _one_line_error(capsys.readouterr().err, "select='measured' needs a device to measure on (ort-sm90)")
    assert main(["bench", str(exports["mlp_dynamo"]), "--target", "sm90"]) == 2
    _one_line_error(capsys.readouterr().err, "bench --target sm90 runs the sm90 op library, which cannot run here")


# ---- 4. failures are one line --------------------------------------------------------------------
def _unknown_op_model(path: Path) -> Path:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])
    nodes = [helper.make_node("Foo", ["x"], ["t"], domain="com.example"), helper.make_node("Relu", ["t"], ["y"])]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]), path)
    return path


def test_a_model_ort_cannot_load_is_one_line(tmp_path: Path, capsys) -> None:
    """An op from a domain ORT does not know: the default (a target runs the original) refuses in one line
    naming ORT's reason and the way out, before any work; without a target it is optimized, and the
    accuracy check says in one line that the original runs nowhere."""
    path = _unknown_op_model(tmp_path / "foo.onnx")
    assert main(["optimize", str(path)]) == 2
    _one_line_error(capsys.readouterr().err, "foo.onnx does not load in ONNX Runtime",
                    "com.example:Foo(-1) is not a registered function/op", "--target none")
    assert main(["bench", str(path)]) == 2
    _one_line_error(capsys.readouterr().err, "foo.onnx does not load in ONNX Runtime")
    assert main(["optimize", str(path), "--target", "none"]) == 0
    assert "accuracy check skipped: the original model does not run in ort" in " ".join(capsys.readouterr().out.split())


def test_an_unforeseen_error_is_one_line_and_debug_shows_it(exports: dict[str, Path], tmp_path: Path, monkeypatch,
                                                            capsys) -> None:
    import tkopt.api

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(tkopt.api, "optimize", broken)
    args = ["optimize", str(exports["mlp_ts"]), "-o", str(tmp_path / "o.onnx"), "--target", "none"]
    assert main(args) == 2
    assert capsys.readouterr().err == "tkopt: error: KeyError: 'boom' (run with --debug for the traceback)\n"
    with pytest.raises(KeyError, match="boom"):
        main([*args, "--debug"])
    assert not list(tmp_path.iterdir())


def test_an_accuracy_mismatch_shows_the_report_writes_nothing_and_exits_3(exports: dict[str, Path], tmp_path: Path,
                                                                         monkeypatch, capsys) -> None:
    """A fused op computing the wrong thing (here its reference, off by one) must not be written."""
    import tkopt.onnx_runtime_ref as ref

    real = ref.run_reference
    monkeypatch.setattr(ref, "run_reference", lambda op, ins, attrs: [t + 1 for t in real(op, ins, attrs)])
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(exports["mlp_ts"]), "-o", str(out), "--target", "none", "-q"]) == 3
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out
    _one_line_error(captured.err, "differ from the original beyond tolerance; nothing was written")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("case", ["garbage", "missing", "unknown_pass"])
def test_bad_input_one_line_error(case: str, exports: dict[str, Path], tmp_path: Path, capsys) -> None:
    src = tmp_path / "in.onnx"
    args = ["optimize", str(src), "-o", str(tmp_path / "out.onnx"), "--no-check-accuracy"]
    if case == "garbage":
        src.write_bytes(b"\x08\x07garbage" * 50)
    elif case == "unknown_pass":
        shutil.copy(exports["mlp_ts"], src)
        args += ["--disable", "no_such_pass"]
    assert main(args) == 2
    _one_line_error(capsys.readouterr().err, "no_such_pass" if case == "unknown_pass" else "in.onnx")
    assert sorted(os.listdir(tmp_path)) == (["in.onnx"] if case != "missing" else [])


# ---- 5. outputs are checked before any work ------------------------------------------------------
@pytest.mark.parametrize("case", ["directory", "under_a_file", "unwritable", "the_input", "json_directory"])
def test_bad_outputs_are_refused_before_any_work(case: str, exports: dict[str, Path], tmp_path: Path, monkeypatch,
                                                 capsys) -> None:
    import tkopt.api

    def no_work(*args, **kwargs):
        raise AssertionError("the model was read before the output was checked")

    monkeypatch.setattr(tkopt.api, "import_onnx", no_work)
    model = _copy(exports["mlp_ts"], tmp_path)
    (tmp_path / "dir").mkdir()
    output = {"directory": tmp_path / "dir", "under_a_file": model / "out.onnx", "unwritable": Path("/proc/o.onnx"),
              "the_input": model, "json_directory": tmp_path / "o.onnx"}[case]
    extra = [f"--json={tmp_path / 'dir'}"] if case == "json_directory" else []
    before = sorted(os.listdir(tmp_path))
    assert main(["optimize", str(model), "-o", str(output), *extra]) == 2
    why = {"directory": "is a directory", "under_a_file": "is not a directory", "unwritable": "cannot write in /proc",
           "the_input": "is the input model; pass --force to overwrite it", "json_directory": "is a directory"}[case]
    _one_line_error(capsys.readouterr().err, why)
    assert sorted(os.listdir(tmp_path)) == before


def test_force_overwrites_the_input(exports: dict[str, Path], tmp_path: Path) -> None:
    model = _copy(exports["mlp_dynamo"], tmp_path)
    assert main(["optimize", str(model), "-o", str(model), "--force", "--target", "none", "-q"]) == 0
    assert any(n.domain == "tkopt" for n in onnx.load(str(model), load_external_data=False).graph.node)


# ---- 6. options are consistent -------------------------------------------------------------------
def test_disable_is_repeatable_and_comma_separated_and_json_never_takes_the_model(
        exports: dict[str, Path], tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    model = str(exports["mlp_ts"])
    common = ["--target", "none", "--no-check-accuracy", "-q"]
    assert main(["optimize", "--disable", "attention", "--json", model, "-o", "a.onnx", *common]) == 0
    assert json.loads(capsys.readouterr().out)["disabled"] == ["attention"]
    assert main(["optimize", model, "-o", "b.onnx", "--disable", "attention,add_norm", "--disable", "gemm",
                 f"--json={tmp_path / 'r.json'}", *common]) == 0
    assert "fusions" in capsys.readouterr().out  # the table, with the JSON in the file
    rep = json.loads((tmp_path / "r.json").read_text())
    assert sorted(rep["disabled"]) == ["add_norm", "attention", "gemm"] and rep["total_fused"] == 0
    bench = ["bench", model, "--target", "none", "--runs", "1", "--warmup", "0", "--no-nodes", "-q"]
    assert main([*bench, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "onnx"
    assert main([*bench, f"--json={tmp_path / 'b.json'}"]) == 0
    assert "latency (ms)" in capsys.readouterr().out and json.loads((tmp_path / "b.json").read_text())["kind"]


def test_list_passes(capsys) -> None:
    assert main(["optimize", "--list-passes"]) == 0
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert "gemm" in names and "attention" in names


# ---- 7. the command is where the README says ----------------------------------------------------
def test_version_python_m_and_the_console_script(tmp_path: Path) -> None:
    from importlib.metadata import version

    r = subprocess.run([str(Path(sys.executable).with_name("tkopt")), "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"tkopt {version('tkopt')}"
    r = subprocess.run([sys.executable, "-m", "tkopt", "optimize", str(tmp_path / "nope.onnx")], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nope.onnx" in r.stderr
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "source .venv/bin/activate" in readme and ".venv/bin/tkopt" in readme


# ---- 10. outputs get the user's umask; the demo cleans up after itself -----------------------------
def test_outputs_have_the_umasks_mode(exports: dict[str, Path], tmp_path: Path, capsys) -> None:
    """The external data file, the library and the JSON were written 0600 (temporary files renamed into place)."""
    old = os.umask(0o022)
    try:
        out = tmp_path / "o.onnx"
        assert main(["optimize", str(exports["mlp_dynamo"]), "-o", str(out), "--target", "cpu", "--select", "all",
                     f"--json={tmp_path / 'r.json'}", "-q"]) == 0
    finally:
        os.umask(old)
    modes = {p.suffix: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {".onnx": 0o644, ".data": 0o644, ".so": 0o755, ".json": 0o644}, modes


@pytest.mark.slow
def test_demo_reports_and_leaves_nothing_behind(tmp_path: Path, monkeypatch, capsys) -> None:
    """The demo exports the bundled example (dynamo exporter), optimizes it for this machine with measured
    selection and checks accuracy; its temporary folder is gone afterwards."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["select"] == "measured" and rep["accuracy"]["ok"] and rep["target"].startswith("ort-")
    assert sum(rep["candidates"].values()) == len(rep["nodes"]) > 0
    assert all(n["decision"] in ("kept", "slower") and n["fused_ms"] > 0 for n in rep["nodes"])
    assert list(tmp_path.iterdir()) == []


def test_no_fusable_pattern_is_said(tmp_path: Path, capsys) -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["optimize", str(path), "-q"]) == 0
    assert f"no fusable pattern found in {path}" in " ".join(capsys.readouterr().out.split())
    out = onnx.load(str(tmp_path / "relu.tkopt.onnx"))
    assert [n.op_type for n in out.graph.node] == ["Relu"]


# ---- prerequisites: one line each when missing ----------------------------------------------------
def test_missing_compiler_and_headers_are_one_line_before_any_work(exports: dict[str, Path], tmp_path: Path,
                                                                   monkeypatch, capsys) -> None:
    import tkopt.api

    def no_work(*args, **kwargs):
        raise AssertionError("the model was read before the prerequisites were checked")

    monkeypatch.setattr(tkopt.api, "import_onnx", no_work)
    args = ["optimize", str(exports["mlp_ts"]), "-o", str(tmp_path / "o.onnx"), "--target", "cpu"]
    monkeypatch.setenv("CXX", "no-such-c++")
    assert main(args) == 2
    _one_line_error(capsys.readouterr().err, "needs a C++ compiler: no-such-c++ is not on PATH")
    monkeypatch.setenv("CXX", shutil.which("g++") or shutil.which("c++") or "g++")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("TKOPT_ORT_INCLUDE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm
    assert main(args) == 2
    _one_line_error(capsys.readouterr().err, "npm is not installed", "TKOPT_ORT_INCLUDE")


# ---- 11. progress on a terminal, quiet elsewhere; TileLang's log routed ----------------------------
@pytest.mark.parametrize("quiet", [False, True])
def test_progress_on_a_terminal_only_and_quiet_silences_it(exports: dict[str, Path], tmp_path: Path,
                                                           quiet: bool) -> None:
    import pty

    primary, secondary = pty.openpty()
    cmd = [sys.executable, "-m", "tkopt", "optimize", str(exports["mlp_ts"]), "-o", str(tmp_path / "o.onnx"),
           "--target", "none"] + (["--quiet"] if quiet else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=secondary, env={**os.environ, "COLUMNS": "120"})
    os.close(secondary)
    err = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the pty closes with the process
            break
        if not chunk:
            break
        err += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(primary)
    assert proc.returncode == 0 and b"fusions" in out and b"tkopt:" not in out
    shown = b"tkopt: passes" in err and b"tkopt: checking accuracy" in err
    assert shown != quiet, err[-2000:]


def test_tilelang_logs_nothing_unless_verbose(capfd) -> None:
    """TileLang's logger printed INFO lines on every kernel compile, to stdout, mixing with the CLI's JSON."""
    import logging

    import tilelang  # noqa: F401 - its import installs the handler tkopt takes over

    from tkopt import logs

    logging.getLogger("tilelang").info("compiled a kernel")
    assert capfd.readouterr() == ("", "")
    logs.set_verbose(True)
    try:
        logging.getLogger("tilelang.jit.kernel").info("compiled a kernel")
    finally:
        logs.set_verbose(False)
    out, err = capfd.readouterr()
    assert out == "" and "TileLang INFO: compiled a kernel" in err
