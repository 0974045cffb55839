"""torch.compile backend "tkopt": `torch.compile(model, backend="tkopt")`.

Dynamo's graph is lowered by AOTAutograd first, so tkopt sees the same aten ops as from
torch.export (one op mapping, functionalized, parameters as graph inputs) and training keeps
working: autograd is derived from the original graph, and only the forward graph is optimized
(a fusion whose intermediates backward needs is refused as illegal, since they are graph outputs).
Registered through the `torch_dynamo_backends` entry point in pyproject.toml.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from tkopt.backends.torch_module import to_torch_module
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
    report.kernel_fallbacks = prepare_kernels(graph, first_device(example_inputs))
    out = to_torch_module(graph)
    out.tkopt_report = report
    log.info("tkopt: %d fusions %s, %d -> %d nodes", report.total_fused, report.fusions, report.nodes_before,
             report.nodes_after)
    return out


def make_backend(disable: Iterable[str] = ()) -> Callable[..., Any]:
    """A torch.compile backend that skips the passes named in `disable`."""
    disabled = tuple(disable)

    def forward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(optimize_graph_module(gm, disabled, example_inputs).forward)

    def backward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        compiler = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
        return compiler(gm, example_inputs, **kwargs)

    return backend


tkopt_backend = make_backend()
