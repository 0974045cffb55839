"""Tiny real models exported with both torch exporters, for the ONNX and CLI tests."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class Block(nn.Module):
    """Linear -> LayerNorm -> GELU -> reshape/mean, plus an unsqueeze: common ops of real exports."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.norm(self.lin(x)))
        return h.reshape(x.shape[0], -1, 4).mean(-1).unsqueeze(1)


def export(module: nn.Module, path: Path, dynamo: bool, opset: int, x: torch.Tensor) -> Path:
    torch.manual_seed(0)
    if dynamo:
        torch.onnx.export(module, (x,), str(path), dynamo=True, opset_version=opset, input_names=["x"],
                          dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
    else:
        torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=opset, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return path


class MaskedAttention(nn.Module):
    """Self-attention with an integer attention_mask input (as HF models take it)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        keep = attention_mask[:, None, None, :].bool()
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(y.transpose(1, 2).reshape(b, t, 16))
