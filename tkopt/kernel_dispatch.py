"""Run fused ops on the TileLang kernels (tkopt.kernels), and probe a node's kernel before relying on it.

The torch custom ops call `run_kernel`; `probe` compiles and runs a node's kernel once on small
random tensors of the node's dtype, static dims and device, so that `tkopt.compile` can leave a
node unfused (with a warning naming it) when its kernel cannot be built, instead of failing later.
TKOPT_KERNELS=reference runs every fused op through its torch reference instead (a debugging aid).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from tkopt import fused_ops
from tkopt.ir import Graph, Node
from tkopt.passes.base import unfuse
from tkopt.passes.finalize import seal

Tensor = torch.Tensor
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "bool": torch.bool, "int64": torch.int64, "int32": torch.int32}


def use_kernels() -> bool:
    mode = os.environ.get("TKOPT_KERNELS", "tilelang")
    if mode not in ("tilelang", "reference"):
        raise ValueError(f"TKOPT_KERNELS must be 'tilelang' or 'reference', got {mode!r}")
    return mode == "tilelang"


def _act(attrs: dict[str, Any]) -> str | None:
    return None if attrs["activation"] == "none" else attrs["activation"]


def run_kernel(op: str, inputs: Sequence[Tensor | None], attrs: dict[str, Any]) -> list[Tensor]:
    """Fused op `op` on its TileLang kernel for the tensors' device (sm90 / sm80 / cpu variant)."""
    from tkopt import kernels

    attrs = fused_ops.schema(op).full_attrs(attrs)
    if op == "FusedGemm":
        a, b, bias, residual = inputs
        return [kernels.gemm(a, b, bias, _act(attrs), residual, b_transposed=bool(attrs["trans_b"]))]
    if op == "FusedGatedMLP":
        x, wg, wu, bg, bu = inputs
        return [kernels.gated_mlp(x, wg, wu, _act(attrs) or "silu", bg, bu,
                                  weights_transposed=bool(attrs["trans_b"]))]
    if op == "FusedAttention":
        q, k, v, mask = inputs
        scale = float(attrs["scale"])
        return [kernels.flash_attention(q, k, v, causal=bool(attrs["causal"]), mask=mask,
                                        scale=None if scale <= 0 else scale, layout=attrs["layout"],
                                        mask_scale=float(attrs["mask_scale"]), mask_fill=float(attrs["mask_fill"]),
                                        guard=attrs["guard"], mask_keeps=bool(attrs["mask_keeps"]))]
    if op == "FusedAddNorm":
        x, residual, weight, bias = inputs
        if attrs["kind"] == "layer":
            y, s = kernels.add_layer_norm(x, residual, weight, bias, attrs["epsilon"])
        else:
            y, s = kernels.add_rms_norm(x, residual, weight, attrs["epsilon"])
        return [y, s]
    raise ValueError(f"no kernel for fused op {op!r}")


def _concrete(shape: Sequence[Any] | None, sizes: dict[str, int]) -> list[int]:
    if shape is None:
        raise ValueError("unknown rank")
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif d is None:
            raise ValueError("a dim of unknown size")
        else:
            out.append(sizes.setdefault(str(d), 3 + len(sizes)))
    return out


def probe(node: Node, device: torch.device) -> str | None:
    """Build and run `node`'s kernel once on random data; None if it works, else the reason it does not.

    Symbolic dims get small sizes (the same symbol, the same size). Only dtypes and static dims
    matter to the kernels' compile-time keys, so one probe builds the kernel every call will use.
    A torch.compile backend runs under Dynamo's fake mode, so the probe leaves it for real tensors.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        try:
            run_kernel(node.op, _random_inputs(node, device), node.attrs)
        except Exception as e:  # noqa: BLE001 - any failure means this node's kernel is unusable
            return f"{type(e).__name__}: {e}"
    return None


def _random_inputs(node: Node, device: torch.device) -> list[Tensor | None]:
    sizes: dict[str, int] = {}
    gen = torch.Generator().manual_seed(0)
    tensors: list[Tensor | None] = []
    for v in node.inputs:
        if v is None:
            tensors.append(None)
            continue
        dtype = DTYPES.get(v.dtype or "")
        if dtype is None:
            raise ValueError(f"input {v.name} has dtype {v.dtype}, which no kernel takes")
        shape = _concrete(v.shape, sizes)
        if dtype == torch.bool:
            t = torch.rand(shape, generator=gen) > 0.1
        else:
            t = torch.randn(shape, generator=gen).to(dtype)
        tensors.append(t.to(device))
    return tensors


def decline_unprofitable(graph: Graph, device: torch.device) -> list[tuple[str, str]]:
    """Put back unfused the fused nodes that cannot beat what they replace on `device`; (node, why) each.

    On CUDA a FusedGemm that replaced a single linear/addmm with at most a bias fuses nothing: cuBLAS
    adds the bias in its own epilogue, and on mid-size projections it is 10-35% faster than our
    kernel (H200, BERT-base and Llama layers). Part of prepare_kernels; unfusing needs the graph unsealed.
    """
    declined: list[tuple[str, str]] = []
    if device.type != "cuda":
        return declined
    residual_at = fused_ops.schema("FusedGemm").inputs.index("residual")
    for node in [n for n in graph.nodes if n.op == "FusedGemm"]:
        residual = node.inputs[residual_at] if len(node.inputs) > residual_at else None
        if len(node.replaced) == 1 and node.attrs.get("activation", "none") == "none" and residual is None:
            unfuse(graph, node)
            declined.append((node.name, "a lone linear (+bias): nothing to fuse beyond cuBLAS's own epilogue"))
    return declined


def prepare_kernels(
    graph: Graph, device: torch.device
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Settle how every fused node runs on `device`, then seal the graph: the fusions that cannot win
    there are declined (decline_unprofitable); every other fused node's kernel is probed, and each
    that fails is put back unfused with a warning. With TKOPT_KERNELS=reference nothing is probed.

    Returns (declined, fallbacks): (node name, reason) per node left unfused, for the report.
    """
    declined = decline_unprofitable(graph, device)
    if not use_kernels():
        seal(graph)
        return declined, []
    fallbacks = []
    for node in [n for n in graph.nodes if n.is_fused]:
        reason = probe(node, device)
        if reason is not None:
            warnings.warn(f"tkopt: {node.name} ({node.op}) runs unfused on {device}: its kernel failed: {reason}",
                          stacklevel=2)
            unfuse(graph, node)
            fallbacks.append((node.name, reason))
    seal(graph)
    return declined, fallbacks


def first_device(values: Sequence[Any]) -> torch.device:
    """The device of the first tensor among `values` (example inputs), cpu if none."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")
