"""torch.compile backend "tkopt": `torch.compile(model, backend="tkopt")`.

Dynamo's graph is traced to a functional aten graph of the forward first (torch's fused inference
fast paths decomposed, tkopt.frontends.decompositions), so tkopt sees the same aten ops as from
torch.export, and is fused there: before AOTAutograd differentiates it. The fused nodes are tkopt::
custom ops with an autograd formula (their reference, recomputed from their saved inputs), so in
training AOTAutograd saves the fused ops' inputs and the backward recomputes what it needs: no
fusion is refused because backward needs an intermediate. Under no_grad the same fused graph is
AOTAutograd's inference graph. Dynamo finds the name "tkopt" through the `torch_dynamo_backends` entry
point in pyproject.toml where tkopt is installed, and through tkopt.backends.registration wherever it is
imported (`import tkopt` is enough).

The aten graph goes through tkopt.pipeline like tkopt.compile's (measured selection by default, on the
real values Dynamo holds for the graph's inputs: the parameters themselves). The whole-graph alternative
is Dynamo's own graph as torch runs it (torch's fused fast paths included: what the user's module does
eagerly); where it measures faster, the backend returns it as is, as backend="eager" would. Inductor's
compilations of the graph are not raced: built with compile_fx inside the backend call they ran on CPU,
but faulted on the H200 (unspecified launch failure, 2026-12-01), cause not found.
`tkopt.last_report()` shows what happened.

On CUDA the optimized forward graph is replayed as a CUDA graph per input signature, as in
tkopt.compile (tkopt.cuda_graphs); parameters, which Dynamo passes as graph inputs, are captured
where they live instead of being copied in on every call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import TensorifyScalarRestartAnalysis
from torch._dynamo.symbolic_convert import TensorifyState
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._sympy.symbol import SymT, symbol_is_type

from tkopt.cuda_graphs import GraphCache, capturable, signature
from tkopt.frontends.decompositions import TRACE_DECOMPOSITIONS, ensure_fake_impls
from tkopt.frontends.fx import import_fx, node_val
from tkopt.pipeline import optimize
from tkopt.targets.torch_target import TorchTarget

log = logging.getLogger(__name__)
ensure_fake_impls()  # before Dynamo traces for this backend: it looks the backend up first


def real_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """Inputs to measure on. Dynamo passes its backend the real values (parameters, the call's inputs):
    parameters are used as they are (real weights, where they live), other tensors as clones (a graph may
    update its inputs in place, and it runs many times here). For fakes, tensors of their shapes (symbolic
    sizes at their hints), dtypes and devices, with random floats, zero integers (valid indices) and true
    bools; SymInts as their hints."""

    def hint(d: Any) -> int:
        return d if isinstance(d, int) else int(d.node.hint)

    out: list[Any] = []
    with unset_fake_temporarily():
        for x in example_inputs:
            if isinstance(x, FakeTensor):
                shape = [hint(d) for d in x.shape]
                if x.is_floating_point():
                    out.append(torch.randn(shape, dtype=x.dtype, device=x.device))
                else:
                    fill = True if x.dtype == torch.bool else 0
                    out.append(torch.full(shape, fill, dtype=x.dtype, device=x.device))
            elif isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter):
                out.append(x.detach().clone())
            else:
                out.append(hint(x) if isinstance(x, torch.SymInt) else x)
    return out


def optimize_graph_module(
    gm: fx.GraphModule, disable: Iterable[str] = (), example_inputs: Sequence[Any] = (), select: str | None = None,
    cuda_graphs: bool = True, plain: fx.GraphModule | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """Optimize an aten-level GraphModule through tkopt.pipeline: (the optimized module, with the report in
    `.tkopt_report`; None, or `plain` where it measured faster as a whole). `plain` is what runs without
    tkopt, on the same inputs (default: `gm` itself).

    AOTAutograd may call its compilers inside its FakeTensorMode (inference graphs do); tkopt reads the
    graph's real constants and probes kernels on real tensors, so it leaves that mode while it works.
    """
    with unset_fake_temporarily():
        args = real_inputs(example_inputs)
        on_gpu = any(isinstance(x, torch.Tensor) and x.is_cuda for x in args)
        graphed = (lambda m: replay_as_cuda_graphs(m, m)) if cuda_graphs and on_gpu else (lambda m: m)
        alternative = gm if plain is None else plain
        target = TorchTarget(args, wrap=graphed, alternatives={"eager": lambda: alternative}, cuda_graphs=False)
        result = optimize(import_fx(gm), target, select=select, disable=disable, source="torch.compile graph")
    out = result.emitted
    out.tkopt_report = report = result.report
    log.info("tkopt: %d fusions %s, %d -> %d nodes", report.total_fused, report.fusions, report.passes.nodes_before,
             report.nodes_after)
    return out, None if result.winner == "tkopt" else result.artifact


def replay_as_cuda_graphs(gm: fx.GraphModule, owner: fx.GraphModule) -> Callable[..., Any]:
    """`gm`'s forward, replayed as a CUDA graph per input signature when its inputs are CUDA tensors.
    `owner` (the optimized graph `gm` was made from) gets the cache and why the latest call ran uncaptured."""
    cache = GraphCache()
    owner.tkopt_graphs = cache

    def run(*args: Any) -> Any:
        owner.tkopt_uncaptured_reason = capturable(args, gm)
        if owner.tkopt_uncaptured_reason is not None:
            return gm(*args)
        flat, spec = pytree.tree_flatten((args, {}))
        return cache(signature(flat), gm, flat, spec, in_place=lambda t: isinstance(t, nn.Parameter))

    return run


def aten_forward(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Dynamo's torch-level graph as a functional aten graph of its forward (no autograd recorded), torch's
    fused fast paths decomposed: the graph tkopt fuses. Traced on Dynamo's fake inputs (their symbolic
    shapes), in their fake mode; a graph without them is traced on fakes of `example_inputs`. Dead nodes
    (the detach make_fx records for each tensor autograd would save) are dropped: they read intermediates."""
    fakes = [node_val(p) for p in gm.graph.find_nodes(op="placeholder")]
    functional = torch.func.functionalize(gm)
    if any(v is None for v in fakes):
        traced = make_fx(functional, decomposition_table=TRACE_DECOMPOSITIONS, tracing_mode="fake")(
            *example_inputs)
    else:
        mode = next((v.fake_mode for v in fakes if isinstance(v, FakeTensor)), None)
        with mode if mode is not None else contextlib.nullcontext():
            traced = make_fx(functional, decomposition_table=TRACE_DECOMPOSITIONS)(*fakes)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def specialize_float_inputs(gm: fx.GraphModule) -> None:
    """Make Dynamo retrace with float attributes as constants, if it made them graph inputs or symbols.

    Dynamo passes floats such as a norm's epsilon or an attention scale as tensor inputs read with
    .item(), or as float symbols it then specializes by a guard (nn.TransformerEncoderLayer compares its
    norms' eps): the graph then adds a runtime scalar where the recognizers need a constant, and
    AOTAutograd's tensorify pass (inductor's too) asks Dynamo to restart for the specialized symbols.
    Here every such float is specialized up front, by the same restart (one per frame; a float argument
    that changes between calls recompiles, as with torch.compile's specialize_float=True).
    """
    fakes = [v for p in gm.graph.find_nodes(op="placeholder") if isinstance(v := node_val(p), FakeTensor)]
    names = {v.item_memo.node._expr.name for v in fakes
             if v.item_memo is not None and hasattr(v.item_memo.node._expr, "name")}
    shape_env = next((v.fake_mode.shape_env for v in fakes if v.fake_mode.shape_env is not None), None)
    if shape_env is not None:
        names |= {str(k) for k, v in shape_env.backed_var_to_val.items()
                  if symbol_is_type(k, SymT.FLOAT) and isinstance(v, sympy.Float)}
    fresh = {n for n in names if not TensorifyState.should_specialize(n)}
    if fresh:
        for n in fresh:
            TensorifyState.specialize(n)
        raise TensorifyScalarRestartAnalysis


def make_backend(disable: Iterable[str] = (), cuda_graphs: bool = True, select: str | None = None
                 ) -> Callable[..., Any]:
    """A torch.compile backend that skips the passes named in `disable`; `cuda_graphs` and `select` as in
    tkopt.compile."""
    disabled = tuple(disable)

    def backward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        specialize_float_inputs(gm)
        optimized, plain = optimize_graph_module(aten_forward(gm, example_inputs), disabled,
                                                 example_inputs, select, cuda_graphs, plain=gm)
        if plain is not None:  # Dynamo's graph without tkopt measured faster
            backend.graph_modules.append(optimized)
            return plain

        def forward_compiler(fw: fx.GraphModule, fw_inputs: Sequence[Any]) -> Callable[..., Any]:
            # Recorded here, not above: Dynamo may restart after AOTAutograd rejects a first graph (it
            # specializes a float it had made an input), calling this backend again for the same code.
            backend.graph_modules.append(optimized)
            on_gpu = any(isinstance(x, torch.Tensor) and x.is_cuda for x in fw_inputs)
            return make_boxed_func(replay_as_cuda_graphs(fw, optimized) if cuda_graphs and on_gpu else fw.forward)

        compiler = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
        return compiler(optimized, example_inputs, **kwargs)

    backend.graph_modules = []  # the optimized graphs, newest last (with .tkopt_report)
    return backend


tkopt_backend = make_backend()
