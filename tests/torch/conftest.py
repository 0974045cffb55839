"""Graph-side torch tests run fused ops on their torch references: they check import, passes and
rebuild, not kernels (tests/test_fused_execution.py runs the same modules on the TileLang kernels)."""

import pytest


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
