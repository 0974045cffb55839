"""SDPA kept whole in the torch.compile backend's aten trace: `tkopt::scaled_dot_product_attention`.

aten.scaled_dot_product_attention is a composite op: traced to aten, it becomes the kernel torch picks for
the tracing device, with the mask rewritten for that kernel. On the CPU the bool mask stays as it is; on
CUDA the efficient kernel gets Where(Not(mask), -inf, 0), padded to its alignment; and on Hopper and
Blackwell, where torch prefers cuDNN for a masked fp16/bf16 call, torch's conversion for cuDNN is
Where(Not(mask), -65504, 0), a finite fill. That bias is no mask: added to scores it equals the mask only
while every score stays far above -65504 (adversarial inputs break that), so no pass may read a causal or
key padding structure out of it. On the H200 (2026-12-02) the backend's nodes kept a whole (B, H, S, S)
mask: GPT-2's attention ran 0.187 ms fused against 0.121 unfused and was declined.

torch.export keeps SDPA whole with its documented semantics (a bool mask keeps where True, -inf
elsewhere). The backend does the same in inference: each F.scaled_dot_product_attention in Dynamo's graph is
routed through this op, which make_fx cannot see into and which calls aten's SDPA, so it runs the kernel
eager picks, on any device (and the mask it rewrites for it) exactly as the user's module does. The fx
frontend reads it as the aten op. Graphs that record a backward keep torch's own trace: the op has no
autograd formula.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import fx

Tensor = torch.Tensor
aten = torch.ops.aten


def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """aten.scaled_dot_product_attention, as one op; its fake implementation too: on fakes aten picks the kernel
    for their device, whose output has the strides the real call's has."""
    return aten.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                             enable_gqa=enable_gqa)


torch.library.custom_op("tkopt::scaled_dot_product_attention", _sdpa, mutates_args=()).register_fake(_sdpa)
OP = torch.ops.tkopt.scaled_dot_product_attention.default
_SIGNATURE = inspect.signature(_sdpa)


def keep_sdpa_whole(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` (a Dynamo graph), or a copy whose F.scaled_dot_product_attention calls without dropout go through
    this module's op (module docstring). `gm` itself is left as it is: it runs as the plain alternative."""
    calls = gm.graph.find_nodes(op="call_function", target=F.scaled_dot_product_attention)
    if not calls:
        return gm
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for call in calls:
        node = copies[call]
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
        if bound.arguments.get("dropout_p", 0.0) != 0.0:
            continue  # random: each trace of the op would draw its own mask
        node.target, node.args, node.kwargs = OP, tuple(bound.args), dict(bound.kwargs)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy
