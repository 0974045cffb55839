"""torch.compile backend "tkopt": `torch.compile(model, backend="tkopt")`.

Dynamo's graph is lowered by AOTAutograd first, so tkopt sees the same aten ops as from
torch.export (one op mapping, functionalized, parameters as graph inputs) and training keeps
working: autograd is derived from the original graph, and only the forward graph is optimized
(a fusion whose intermediates backward needs is refused as illegal, since they are graph outputs).
Registered through the `torch_dynamo_backends` entry point in pyproject.toml.

On CUDA the optimized forward graph is replayed as a CUDA graph per input signature, as in
tkopt.compile (tkopt.cuda_graphs); parameters, which Dynamo passes as graph inputs, are captured
where they live instead of being copied in on every call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from tkopt.backends.torch_module import to_torch_module
from tkopt.cuda_graphs import GraphCache, capturable, signature
from tkopt.frontends.fx import import_fx
from tkopt.kernel_dispatch import first_device, prepare_kernels
from tkopt.passes.pipeline import run_passes

log = logging.getLogger(__name__)


def optimize_graph_module(
    gm: fx.GraphModule, disable: Iterable[str] = (), example_inputs: Sequence[Any] = ()
) -> fx.GraphModule:
    """Import an aten-level GraphModule, run the passes, rebuild it (report in `.tkopt_report`)."""
    graph = import_fx(gm)
    report = run_passes(graph, disable)
    report.declined, report.kernel_fallbacks = prepare_kernels(graph, first_device(example_inputs))
    out = to_torch_module(graph)
    out.tkopt_report = report
    log.info("tkopt: %d fusions %s, %d -> %d nodes", report.total_fused, report.fusions, report.nodes_before,
             report.nodes_after)
    return out


def replay_as_cuda_graphs(gm: fx.GraphModule) -> Callable[..., Any]:
    """`gm`'s forward, replayed as a CUDA graph per input signature when its inputs are CUDA tensors."""
    cache = GraphCache()
    gm.tkopt_graphs = cache

    def run(*args: Any) -> Any:
        gm.tkopt_uncaptured_reason = capturable(args, gm)
        if gm.tkopt_uncaptured_reason is not None:
            return gm(*args)
        flat, spec = pytree.tree_flatten((args, {}))
        return cache(signature(flat), gm, flat, spec, in_place=lambda t: isinstance(t, nn.Parameter))

    return run


def make_backend(disable: Iterable[str] = (), cuda_graphs: bool = True) -> Callable[..., Any]:
    """A torch.compile backend that skips the passes named in `disable`; `cuda_graphs` as in tkopt.compile."""
    disabled = tuple(disable)

    def forward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        optimized = optimize_graph_module(gm, disabled, example_inputs)
        backend.graph_modules.append(optimized)
        on_gpu = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
        return make_boxed_func(replay_as_cuda_graphs(optimized) if cuda_graphs and on_gpu else optimized.forward)

    def backward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        compiler = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
        return compiler(gm, example_inputs, **kwargs)

    backend.graph_modules = []  # the optimized forward graphs, newest last (with .tkopt_report)
    return backend


tkopt_backend = make_backend()
