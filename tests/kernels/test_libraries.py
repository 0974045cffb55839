"""tkopt.kernels.libraries: a GPU kernel TileLang compiled in one process is loaded in the next from its library,
without importing TileLang; a library that is gone, or a different program, compiles through TileLang again.
Real TileLang compiles for sm80 with nvcc (no GPU needed to build or load; the calls are the GPU tests')."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")

# One process: compile an sm80 RMSNorm kernel (block_rows given by argv) and say how it came and what was imported.
CHILD = """
import json, sys
from tkopt.kernels import libraries
from tkopt.kernels.norm import compile_norm
flags = tuple(sorted(dict(has_residual=True, has_weight=True, has_bias=False, write_sum=False, eps=1e-6).items()))
kernel = compile_norm("rms", 256, "float16", "float16", "sm80", flags, (("block_rows", int(sys.argv[1])),
                                                                         ("threads_per_row", 32)), "sm_80")
print(json.dumps({"kind": type(kernel).__name__, "tilelang": "tilelang" in sys.modules,
                  "path": getattr(kernel, "path", None)}))
"""


def _run(tmp_path: Path, block_rows: int = 4) -> dict:
    env = dict(os.environ, TKOPT_CACHE_DIR=str(tmp_path / "tkopt"), TILELANG_CACHE_DIR=str(tmp_path / "tilelang"))
    r = subprocess.run([sys.executable, "-c", CHILD, str(block_rows)], env=env, capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_kernel_compiled_before_loads_without_tilelang(tmp_path) -> None:
    first = _run(tmp_path)
    assert first["kind"] == "JITKernel" and first["tilelang"]
    index = json.loads((tmp_path / "tkopt" / "kernel-libraries.json").read_text())
    (recorded,) = index.values()
    assert Path(recorded).is_relative_to(tmp_path / "tilelang") and Path(recorded).is_file()

    again = _run(tmp_path)
    assert again == {"kind": "Library", "tilelang": False, "path": recorded}

    other = _run(tmp_path, block_rows=8)  # another program: compiled and recorded beside the first
    assert other["kind"] == "JITKernel"
    assert len(json.loads((tmp_path / "tkopt" / "kernel-libraries.json").read_text())) == 2


def test_a_library_that_is_gone_compiles_through_tilelang_again(tmp_path) -> None:
    _run(tmp_path)
    shutil.rmtree(tmp_path / "tilelang")
    again = _run(tmp_path)
    assert again["kind"] == "JITKernel"
    assert _run(tmp_path)["kind"] == "Library"  # recorded anew


def test_a_library_that_fails_to_run_hands_over_to_tilelang(tmp_path) -> None:
    """Its first call failing (here: arguments the kernel does not take; in an install, a function its library
    needs that nothing registered), the kernel TileLang builds runs instead, with a warning."""
    from tkopt.kernels.libraries import Library

    _run(tmp_path)
    (path,) = json.loads((tmp_path / "tkopt" / "kernel-libraries.json").read_text()).values()
    calls = []
    library = Library(path, lambda: lambda *args: calls.append(args))
    with pytest.warns(UserWarning, match="failed to run"):
        library("not", "tensors")
    library("again")
    assert calls == [("not", "tensors"), ("again",)]


ATTENTION = """
import json, sys, torch
from tkopt.kernels import flash_attention
torch.manual_seed(0)
q = torch.randn(2, 8, 200, 128, device="cuda", dtype=torch.float16)
k, v = (torch.randn(2, 2, 200, 128, device="cuda", dtype=torch.float16) for _ in range(2))
keep = torch.rand(2, 1, 1, 200, device="cuda") > 0.2
run = lambda: flash_attention(q, k, v, causal=True, mask=keep, arch=sys.argv[1])
out = run().float()
kf, vf = (t.float().repeat_interleave(4, dim=1) for t in (k, v))
causal = torch.ones(200, 200, dtype=torch.bool, device="cuda").tril()
want = torch.nn.functional.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=keep & causal)
side = torch.cuda.Stream()  # the kernel launches on torch's current stream: a side stream, a CUDA graph
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    on_side = run()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = run()
q.mul_(0.5)
graph.replay()
torch.cuda.synchronize()
halved = torch.nn.functional.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=keep & causal)
print(json.dumps({"err": max((out - want).abs().max().item(), (on_side.float() - want).abs().max().item(),
                             (captured.float() - halved).abs().max().item()),
                  "tilelang": "tilelang" in sys.modules}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_a_loaded_attention_kernel_computes_as_compiled(tmp_path, arch) -> None:
    """The flash attention kernel (sm90: TMA loads, whose descriptors TileLang's library creates) loaded from its
    library in a fresh process gives what the compiled one gave (causal, GQA, a key padding mask), on the current
    stream, a side stream and replayed in a CUDA graph on new inputs."""
    env = dict(os.environ, TKOPT_CACHE_DIR=str(tmp_path / "tkopt"), TILELANG_CACHE_DIR=str(tmp_path / "tilelang"),
               TKOPT_AUTOTUNE="0")
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", ATTENTION, arch], env=env, capture_output=True, text=True,
                           cwd=tmp_path, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[0]["tilelang"] and not runs[1]["tilelang"], runs
    assert all(run["err"] < 2e-3 for run in runs), runs
