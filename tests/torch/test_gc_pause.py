"""tkopt.compile and the torch.compile backend trace and optimize with Python's cyclic collector paused (full
collections walked every object of the process, whole models included), and leave it as they found it."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import tkopt
import tkopt.backends.dynamo as dynamo
import tkopt.torch_compile as torch_compile


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.fc(x)))


@pytest.mark.parametrize("entry", ["compile", "backend"])
@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_while_a_model_is_optimized_and_restored_after(entry: str, enabled: bool,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    seen: list[bool] = []
    module = torch_compile if entry == "compile" else dynamo
    real = module.import_fx
    monkeypatch.setattr(module, "import_fx", lambda *a, **kw: (seen.append(gc.isenabled()), real(*a, **kw))[1])
    x = torch.randn(2, 5, 16)
    m = Block().eval()
    (gc.enable if enabled else gc.disable)()
    try:
        with torch.no_grad():
            fast = tkopt.compile(m, (x,), select="all") if entry == "compile" else torch.compile(
                m, backend=dynamo.make_backend(select="all"))
            torch.testing.assert_close(fast(x), m(x))
        assert seen == [False] and gc.isenabled() == enabled
    finally:
        gc.enable()
