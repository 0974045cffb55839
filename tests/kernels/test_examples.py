"""The kernel library as its users meet it: every public kernel's docstring example runs (CPU variants, small
shapes), and the README's kernel quick start runs verbatim on a GPU."""

import doctest
import logging
import pathlib
import re

import pytest
import torch

import tkopt.kernels as K

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# Public names that are not kernels (no example needed).
NOT_KERNELS = {"UnsupportedError"}


@pytest.fixture
def quiet_tilelang():
    """TileLang logs compiles at INFO to stdout, which doctest would take for the example's output."""
    logger = logging.getLogger("tilelang")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("name", sorted(set(K.__all__) - NOT_KERNELS))
def test_docstring_example_runs(name, quiet_tilelang):
    obj = getattr(K, name)
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
    examples = [ex for t in tests for ex in t.examples]
    assert examples, f"tkopt.kernels.{name} has no runnable example in its docstring"
    assert any("import" in ex.source for ex in examples), f"{name}'s example does not show its imports"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{name}'s docstring example failed (doctest output above)"


def readme_quick_start() -> str:
    """The README's kernel quick start: the python block under the kernel library heading that imports gemm."""
    text = README.read_text()
    section = text[text.index("## Kernel library"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block and "from tkopt.kernels import gemm" in block.group(1), "README: kernel quick start not found"
    return block.group(1)


def test_readme_quick_start_is_the_issue_s():
    code = readme_quick_start()
    assert "assert torch.allclose(C, A @ B, atol=1e-4)" in code
    assert "TileConfig(block_tile=(128, 128, 32), warp_tile=(64, 64, 16), use_tensorcore=True)" in code
    assert 'device="cuda"' in code


@pytest.mark.gpu
def test_readme_quick_start_runs_verbatim():
    """fp32 at torch's default precision: gemm must match A @ B to 1e-4 at K=1024 (TF32 misses by ~0.1)."""
    assert torch.get_float32_matmul_precision() == "highest"
    exec(compile(readme_quick_start(), str(README), "exec"), {})
