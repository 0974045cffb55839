"""The sm90/sm80 op libraries in a real CUDA ONNX Runtime session, and `tkopt bench` against ORT's CUDA kernels.

Needs a GPU and onnxruntime-gpu (its CUDAExecutionProvider): skipped without either. On the H200 the wheel is
carried in (see the README, "ONNX Runtime on CUDA"); torch's CUDA 13 libraries, loaded by `import torch`, serve it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import tkopt
from tkopt.accuracy import output_error
from tkopt.bench import bench_onnx
from tkopt.cli import main
from tkopt.models.blocks import GPT2Block, GPT2BlockConfig
from tkopt.models.export import export_onnx
from tkopt.ort.run import CUDA_PROVIDERS, make_inputs

pytestmark = pytest.mark.gpu


def _need(arch: str) -> None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed: this onnxruntime has no CUDAExecutionProvider")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    if arch == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 kernels need a Hopper GPU")


@pytest.fixture(scope="module")
def gpt2_16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2-style block with head dim 64 (what the GPU attention takes) and a causal mask, float16, exported
    by dynamo. (A padding mask would be float16 here, which the GPU attention does not take.)"""
    torch.manual_seed(0)
    model = GPT2Block(GPT2BlockConfig(hidden=256, heads=4, max_seq=64)).eval().half()
    (x,) = model.example_inputs()
    return export_onnx(model, (x.half(),), tmp_path_factory.mktemp("cuda") / "gpt2_16.onnx", dynamo=True,
                       external_data=True)


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_library_runs_in_a_cuda_session(arch: str, gpt2_16: Path, tmp_path: Path) -> None:
    """Optimized for the GPU arch, the model loads through tkopt.ort.InferenceSession on CUDA's provider, and
    at sizes other than the export's (1 token, odd, longer) computes what the original computes in ORT's CUDA
    kernels. The accuracy check ran the library too, in ORT, not a reference."""
    _need(arch)
    out = tmp_path / "gpt2.onnx"
    _, rep = tkopt.optimize_onnx(gpt2_16, out, report=False, check_accuracy=True, target=arch, select="all")
    kept = {d.op for d in rep.decided("kept")}
    assert {"FusedGemm", "FusedAttention", "FusedAddNorm"} <= kept, [(d.node, d.decision, d.reason) for d in rep.nodes]
    assert rep.accuracy is not None and rep.accuracy.fused_runner == "ort" and rep.accuracy.ok
    assert not rep.notes, rep.notes  # built and run here: nothing to warn about
    fused = tkopt.ort.InferenceSession(out)
    assert fused.get_providers()[0] == "CUDAExecutionProvider"
    plain = ort.InferenceSession(str(gpt2_16), providers=CUDA_PROVIDERS)
    original = onnx.load(str(gpt2_16))
    for sizes in ((1, 1), (3, 13), (4, 40)):
        feeds = make_inputs(original, seed=1, sizes=sizes)
        want, got = plain.run(None, feeds), fused.run(None, feeds)
        for o, w, g in zip(original.graph.output, want, got, strict=True):
            err = output_error(o.name, np.asarray(g), np.asarray(w))
            assert err.ok, (sizes, err)


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_bench_times_each_node_against_orts_cuda_kernels(arch: str, gpt2_16: Path, tmp_path: Path, capsys) -> None:
    """`tkopt bench --target <arch>`: the whole model and every fused node on the library against ORT's CUDA
    kernels for what it replaced, inputs and outputs on the GPU."""
    _need(arch)
    r = bench_onnx(gpt2_16, target=arch, runs=10, warmup=3, select="all")
    assert r.device == "cuda" and r.claims_speedup and r.ok and r.fused_runner == f"ort + tkopt op library ({arch})"
    assert len(r.nodes) >= 3 and all(n.fused is not None and n.unfused is not None and n.speedup for n in r.nodes)
    assert main(["bench", str(gpt2_16), "--target", arch, "--runs", "5", "--json", "-q"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device"] == "cuda" and d["target"] == arch and all(n["speedup"] for n in d["nodes"])
