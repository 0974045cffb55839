"""Inductor on what tkopt leaves unfused, shared by tkopt.compile and the torch.compile backend.

Inductor fuses the elementwise ops tkopt leaves (RoPE, casts, masks) and calls the tkopt:: ops as extern
kernels, through their fake impls while tracing. On CUDA this is what keeps tkopt's program at least as
fast as torch.compile's around the fused nodes.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from tkopt.backends.inductor_ahead import AheadCompile
from tkopt.backends.trig_tables import realize_broadcast_tables
from tkopt.cuda_graphs import signature

log = logging.getLogger(__name__)


class InductorOrEager:
    """`gm` compiled by inductor (lazily, at the first call); if inductor fails on it, `gm` itself from
    then on, with a warning naming the error: inductor is an optimization here, never a requirement.

    Without `example_inputs`, as tkopt.compile runs its program: the first call's inputs are compiled
    statically by inductor's compile_fx, and calls with that input signature (cuda_graphs.signature) run that
    code. torch.compile would first have Dynamo trace again the program tkopt traced (most of a warm compile:
    3.9 of 6.5 s for a 4-layer BERT on CPU). Any other signature goes through torch.compile(gm) with
    compile_graph as its backend (Dynamo's graph gets the same passes), with its guards, and with automatic
    dynamic shapes where `dynamic` (static code first, dynamic dims on a recompile: every dim dynamic ran
    slower than static code).

    Given `example_inputs` (the graph's inputs as Dynamo sees them: fakes with their symbolic sizes), through
    compile_fx as a torch.compile backend calls it, for a torch.compile backend: there a nested torch.compile
    traces nothing (Dynamo skips its own graphs' frames, and calls them with frame evaluation disabled), and
    Dynamo's guards cover what inductor assumed.
    """

    def __init__(self, gm: fx.GraphModule, dynamic: bool = False, example_inputs: Sequence[Any] | None = None) -> None:
        self.gm = gm
        self.dynamic = dynamic
        self.first: tuple[Hashable, Callable[..., Any]] | None = None  # the first signature and its static code
        self.traced: Callable[..., Any] | None = None  # torch.compile(gm), for every other signature
        self.compiled: Callable[..., Any] | None = self._static_first
        self.ahead: AheadCompile | None = None  # the first call's compile, started in a child (compile_ahead)
        if example_inputs is not None:
            self.compiled = _compile_fx_at_first_call(gm, list(example_inputs))

    def compile_ahead(self, example_inputs: Sequence[Any]) -> bool:
        """Start inductor's compile of the first call's static code in a child process (inductor_ahead), given
        that call's inputs flat (tensors, or fakes of them): the first call then finds it in inductor's cache.
        Whether a child started (not where this compiles in Dynamo's context, or compiled already)."""
        if self.compiled != self._static_first or self.first is not None or self.ahead is not None:
            return False
        fakes = static_fakes(example_inputs)
        try:
            self.ahead = AheadCompile(inductor_copy(self.gm, fakes), fakes)
        except Exception as e:  # noqa: BLE001 - compiling ahead is an optimization: the first call compiles here
            log.info("tkopt: inductor's compile ahead did not start (%s: %s)", type(e).__name__, e)
            return False
        return True

    def _static_first(self, *args: Any) -> Any:
        key = signature(pytree.tree_leaves(args))
        if self.first is None:
            if self.ahead is None:
                self.first = key, compile_graph(self.gm, static_fakes(args))
            else:
                with self.ahead.then_here():
                    self.first = key, compile_graph(self.gm, static_fakes(args))
        if key == self.first[0]:
            return self.first[1](*args)
        if self.traced is None:
            self.traced = torch.compile(self.gm, fullgraph=True, dynamic=None if self.dynamic else False,
                                        backend=compile_graph)
        return self.traced(*args)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            return self.gm(*args)
        try:
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - any inductor failure: run the fused graph as it is
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            warnings.warn(f"tkopt: inductor failed on the unfused remainder ({type(e).__name__}: {e}); "
                          "running it without inductor", stacklevel=2)
            self.compiled = None
            return self.gm(*args)


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Inductor's code for `gm` (a copy: inductor edits the graph it compiles), by compile_fx as a torch.compile
    backend calls it: `example_inputs` as Dynamo passes them (real tensors, or fakes with symbolic sizes),
    in the current tracing context (Dynamo's, inside a backend), if any. Broadcast cos/sin tables are realized
    once first (trig_tables): inductor would recompute them in every consumer. A graph that takes pytrees (an
    export's) keeps its calling convention: compile_fx flattens the arguments, the example's and each call's."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(inductor_copy(gm, example_inputs), list(example_inputs))


def inductor_copy(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """The copy of `gm` that `compile_graph` compiles (inductor_ahead compiles it in a child, so one function
    makes it): the input guards left out, the broadcast cos/sin tables realized."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node meta shared, not deep-copied: it holds fakes
    graph._codegen = gm.graph._codegen  # compile_fx replaces it on the copy; the original keeps it
    # torch.export's input guards: tkopt checks them before it calls (input_sizes.guards_refuse), and their
    # module cannot be pickled, so a graph that calls it would never hit inductor's caches.
    for n in graph.find_nodes(op="call_module", target="_guards_fn"):
        graph.erase_node(n)
    copy = fx.GraphModule(gm, graph)
    realize_broadcast_tables(copy, example_inputs)
    return copy


def static_fakes(args: Sequence[Any]) -> list[Any]:
    """`args` with each tensor a fake of its static shape, in a fake mode with a shape env: inductor's and
    AOTAutograd's caches serve only compiles that have one (with real inputs, a warm compile compiled again)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return pytree.tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t, static_shapes=True), list(args))


def _compile_fx_at_first_call(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    compiled: Callable[..., Any] | None = None

    def run(*args: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = compile_graph(gm, example_inputs)
        return compiled(*args)

    return run
