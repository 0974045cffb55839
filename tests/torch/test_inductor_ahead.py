"""Inductor's compile in a child process, ahead of the first call (tkopt.backends.inductor_ahead): real children,
real inductor compiles on CPU."""

from __future__ import annotations

import sys

import pytest
import torch

from tkopt.backends.inductor import InductorOrEager


class _Block(torch.nn.Module):
    """Parameters, a buffer and a constant, so the child rebuilds each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 48)
        self.down = torch.nn.Linear(48, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x))) * self.scale + torch.tensor([1.0, -1.0]).repeat(8)


def _program(x: torch.Tensor) -> tuple[torch.nn.Module, InductorOrEager]:
    torch.manual_seed(0)
    model = _Block().eval()
    return model, InductorOrEager(torch.export.export(model, (x,)).module())


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))


def test_the_first_call_finds_the_childs_code(inductor_cache) -> None:
    """The child compiled with fakes for every tensor; the first call here, with the real weights, reads its code
    from the FX graph cache, and computes what the model does."""
    x = torch.randn(5, 16)
    model, run = _program(x)
    with torch.no_grad():
        assert run.compile_ahead([x])
        assert not run.compile_ahead([x])  # one child per program
        out = run(x)
        torch.testing.assert_close(out, model(x))
    assert run.ahead.ok
    assert run.ahead.found


def test_a_child_that_fails_leaves_the_compile_here(inductor_cache, monkeypatch, caplog) -> None:
    """A child that cannot run is logged, and the first call compiles here as it would have."""
    x = torch.randn(3, 16)
    model, run = _program(x)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with torch.no_grad(), caplog.at_level("INFO", logger="tkopt.backends.inductor_ahead"):
        assert run.compile_ahead([x])
        torch.testing.assert_close(run(x), model(x))
    assert not run.ahead.ok
    assert "compile ahead failed (rc 1)" in caplog.text
    assert not run.ahead.found and run.ahead.here_seconds is not None


def test_no_child_once_compiled_or_inside_dynamo(inductor_cache) -> None:
    """A program compiled already, or compiled in Dynamo's context (the backend's), starts none."""
    x = torch.randn(2, 16)
    _, run = _program(x)
    with torch.no_grad():
        run(x)
    assert not run.compile_ahead([x])
    gm = torch.fx.symbolic_trace(torch.nn.Linear(16, 4))
    assert not InductorOrEager(gm, example_inputs=[x]).compile_ahead([x])


def test_a_stopped_child_leaves_nothing(inductor_cache, caplog) -> None:
    """A child whose code no program will read is stopped quietly, its input file gone."""
    x = torch.randn(4, 16)
    _, run = _program(x)
    with torch.no_grad(), caplog.at_level("INFO", logger="tkopt.backends.inductor_ahead"):
        assert run.compile_ahead([x])
        run.ahead.stop()
    assert run.ahead.proc.returncode is not None and not run.ahead.ok
    assert not run.ahead.path.exists() and run.ahead not in run.ahead.running
    assert "failed" not in caplog.text
