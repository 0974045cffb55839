"""torch.compile backend "tkopt": `torch.compile(model, backend="tkopt")`.

Dynamo's graph is lowered by AOTAutograd first, so tkopt sees the same aten ops as from
torch.export (one op mapping, functionalized, parameters as graph inputs) and training keeps
working: autograd is derived from the original graph, and only the forward graph is optimized
(a fusion whose intermediates backward needs is refused as illegal, since they are graph outputs).
Registered through the `torch_dynamo_backends` entry point in pyproject.toml.

The forward graph goes through tkopt.pipeline like tkopt.compile's (measured selection by default,
on real stand-ins for Dynamo's fake example inputs); where the whole optimized graph measures slower
than the forward graph as traced, the traced one runs. `tkopt.last_report()` shows what happened.

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

from tkopt.cuda_graphs import GraphCache, capturable, signature
from tkopt.frontends.fx import import_fx
from tkopt.pipeline import optimize
from tkopt.targets.torch_target import TorchTarget

log = logging.getLogger(__name__)


def real_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """Real stand-ins for Dynamo's fake example inputs, to measure on: each tensor's shape (symbolic sizes
    at their hints), dtype and device, with random floats, zero integers (valid indices) and true bools;
    SymInts as their hints."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def hint(d: Any) -> int:
        return d if isinstance(d, int) else int(d.node.hint)

    out: list[Any] = []
    with unset_fake_temporarily():
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                shape = [hint(d) for d in x.shape]
                if x.is_floating_point():
                    out.append(torch.randn(shape, dtype=x.dtype, device=x.device))
                else:
                    fill = True if x.dtype == torch.bool else 0
                    out.append(torch.full(shape, fill, dtype=x.dtype, device=x.device))
            else:
                out.append(hint(x) if isinstance(x, torch.SymInt) else x)
    return out


def optimize_graph_module(
    gm: fx.GraphModule, disable: Iterable[str] = (), example_inputs: Sequence[Any] = (), select: str | None = None,
    cuda_graphs: bool = True,
) -> tuple[fx.GraphModule, Callable[..., Any]]:
    """Optimize an aten-level forward GraphModule through tkopt.pipeline. Returns the module that runs
    (tkopt's, or `gm` itself where the whole graph measured faster as traced), with the report in
    `.tkopt_report`, and the callable to run it by (on CUDA: replayed as CUDA graphs)."""
    args = real_inputs(example_inputs)
    on_gpu = any(isinstance(x, torch.Tensor) and x.is_cuda for x in args)
    graphed = replay_as_cuda_graphs if cuda_graphs and on_gpu else (lambda m: m)
    target = TorchTarget(args, wrap=graphed, alternatives={"eager": lambda: graphed(gm)}, cuda_graphs=False)
    result = optimize(import_fx(gm), target, select=select, disable=disable, source="torch.compile forward graph")
    out = result.emitted if result.winner == "tkopt" else gm
    out.tkopt_report = report = result.report
    log.info("tkopt: %d fusions %s, %d -> %d nodes", report.total_fused, report.fusions, report.passes.nodes_before,
             report.nodes_after)
    return out, target.runner(out) if result.winner == "tkopt" else result.artifact


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


def make_backend(disable: Iterable[str] = (), cuda_graphs: bool = True, select: str | None = None
                 ) -> Callable[..., Any]:
    """A torch.compile backend that skips the passes named in `disable`; `cuda_graphs` and `select` as in
    tkopt.compile."""
    disabled = tuple(disable)

    def forward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        optimized, run = optimize_graph_module(gm, disabled, example_inputs, select, cuda_graphs)
        backend.graph_modules.append(optimized)
        return make_boxed_func(run)

    def backward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        compiler = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
        return compiler(gm, example_inputs, **kwargs)

    backend.graph_modules = []  # the optimized forward graphs, newest last (with .tkopt_report)
    return backend


tkopt_backend = make_backend()
