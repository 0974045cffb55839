"""Tiny real ONNX exports shared by the ONNX tests (each exporter runs once per session: CPU time)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.onnx.exports import Block, export


@pytest.fixture(scope="session")
def ts_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TorchScript exporter, opset 17, dynamic batch."""
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("ts")
    return export(Block().eval(), d / "block.onnx", False, 17, torch.randn(2, 3, 8))


@pytest.fixture(scope="session")
def dynamo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Dynamo exporter, opset 18 (writes external data by default), dynamic batch."""
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("dynamo")
    return export(Block().eval(), d / "block.onnx", True, 18, torch.randn(2, 3, 8))
