"""Inductor on what tkopt leaves unfused, shared by tkopt.compile and the torch.compile backend.

Inductor fuses the elementwise ops tkopt leaves (RoPE, casts, masks) and calls the tkopt:: ops as extern
kernels, through their fake impls while tracing. On CUDA this is what keeps tkopt's program at least as
fast as torch.compile's around the fused nodes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx


class InductorOrEager:
    """`gm` compiled by inductor (lazily, at the first call); if inductor fails on it, `gm` itself from
    then on, with a warning naming the error: inductor is an optimization here, never a requirement.

    Through torch.compile, or, given `example_inputs` (the graph's inputs as Dynamo sees them: fakes with
    their symbolic sizes), through inductor's compile_fx as a torch.compile backend calls it. The second is
    for a torch.compile backend: there a nested torch.compile traces nothing (Dynamo skips its own graphs'
    frames, and calls them with frame evaluation disabled).
    """

    def __init__(self, gm: fx.GraphModule, dynamic: bool = False, example_inputs: Sequence[Any] | None = None) -> None:
        self.gm = gm
        if example_inputs is None:
            # dynamic=None is torch's automatic dynamic: static shapes first, dynamic dims only on a recompile.
            # Compiling the remainder with every dim dynamic (dynamic=True) ran it slower than static code.
            self.compiled: Any = torch.compile(gm, fullgraph=True, dynamic=None if dynamic else False)
        else:
            self.compiled = _compile_fx_at_first_call(gm, list(example_inputs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.gm(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any inductor failure: run the fused graph as it is
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            warnings.warn(f"tkopt: inductor failed on the unfused remainder ({type(e).__name__}: {e}); "
                          "running it without inductor", stacklevel=2)
            self.compiled = None
            return self.gm(*args, **kwargs)


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Inductor's code for `gm` (a copy: inductor edits the graph it compiles), by compile_fx as a torch.compile
    backend calls it: `example_inputs` as Dynamo passes them (real tensors, or fakes with symbolic sizes),
    in the current tracing context (Dynamo's, inside a backend), if any."""
    from torch._inductor.compile_fx import compile_fx

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node meta shared, not deep-copied: it holds fakes
    return compile_fx(fx.GraphModule(gm, graph), list(example_inputs))


def _compile_fx_at_first_call(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    compiled: Callable[..., Any] | None = None

    def run(*args: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = compile_graph(gm, example_inputs)
        return compiled(*args)

    return run
