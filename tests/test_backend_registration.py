"""torch.compile(backend="tkopt") must work wherever tkopt is importable, not only where pip installed its
entry point: the GPU machine runs tkopt from a source checkout, and Dynamo answered "Invalid backend"."""

from __future__ import annotations

import os
import subprocess
import sys

# Dynamo's entry-point discovery made blind, as in a source checkout without `pip install`.
HIDE_ENTRY_POINTS = """
import importlib.metadata as md
real = md.entry_points
md.entry_points = lambda **kw: real(group="none") if kw.get("group") == "torch_dynamo_backends" else real(**kw)
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TKOPT_KERNELS": "reference"}
    return subprocess.run([sys.executable, "-c", HIDE_ENTRY_POINTS + body], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_tkopt_before_torch_makes_the_backend_available_without_an_entry_point() -> None:
    r = _run("""
import sys
assert "tkopt" not in md.entry_points(group="torch_dynamo_backends").names  # really blind
import tkopt
assert "torch" not in sys.modules, "import tkopt must stay cheap"
import torch
f = torch.compile(lambda x: x.sin() + 1, backend="tkopt")
x = torch.randn(5)
torch.testing.assert_close(f(x), x.sin() + 1)
print("ok", "tkopt.backends.dynamo" in sys.modules)
""")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["ok", "True"]

