"""tkopt never runs user code it was not asked to run (issue 8).

Kernel precompilation in worker processes must not re-import the user's __main__: a script without
an `if __name__ == "__main__":` guard (a notebook turned script) would run again in every worker,
printing, loading models and writing files again. Each test runs such a script as a subprocess and
counts its line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LINE = "user script body ran"


def _run_once(script: str, tmp_path: Path, timeout: int, **env_vars: str) -> None:
    """Run `script` as a user would; its body must run once, and the script must succeed."""
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "TKOPT_CACHE_DIR": str(tmp_path / "cache"), **env_vars}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.stdout.count(LINE) == 1, proc.stdout
    if proc.returncode != 0:
        pytest.fail(f"the script failed:\n{proc.stderr[-3000:]}")


def test_parallel_precompile_does_not_rerun_an_unguarded_script(tmp_path: Path) -> None:
    """The worker pool precompile uses, driven directly with two CPU kernels and two workers."""
    _run_once(f"""
        print({LINE!r}, flush=True)
        import torch
        from tkopt.kernels.config import default_config
        from tkopt.kernels.gemm_epilogue import precompile

        config = default_config("cpu", torch.float32)
        keys = [("cpu", 16, 16, torch.float32, config, True, True, act, False, False, None) for act in ("relu", None)]
        result = precompile(keys, workers=2)
        assert all(err is None for _, err in result.values()), result
    """, tmp_path, timeout=300)


@pytest.mark.gpu
def test_compile_does_not_rerun_an_unguarded_script(tmp_path: Path) -> None:
    """tkopt.compile of a model with several GEMMs in half precision on the GPU (the build wave compiles the
    GEMMs' candidate kernels in parallel workers)."""
    _run_once(f"""
        print({LINE!r}, flush=True)
        import torch
        from torch import nn
        import tkopt

        # three GEMMs of one shape and epilogue: one tuning key, so one set of candidate compiles
        model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(1024, 1024), nn.ReLU())]).half().cuda().eval()
        x = torch.randn(4, 128, 1024, device="cuda", dtype=torch.half)
        compiled = tkopt.compile(model, (x,), select="all")
        assert compiled.tkopt_report.fusions["gemm"] == 3
        torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)
    """, tmp_path, timeout=1200, TKOPT_AUTOTUNE="1", TKOPT_BUILD_WORKERS="2")  # gpu_session.sh turns both off
