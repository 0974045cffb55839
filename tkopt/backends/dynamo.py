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
real values Dynamo holds for the graph's inputs: the parameters themselves). In inference on CUDA (and
anywhere with inductor=True) the backend runs as tkopt.compile does: inductor compiles what tkopt left
unfused (tkopt.backends.inductor), the result replayed as CUDA graphs, and the whole-graph alternatives
are Dynamo's graph as torch runs it ("eager": torch's fused fast paths included, what the user's module
does eagerly) and inductor's compilation of it ("inductor": what backend="inductor" gives). Whichever
measures fastest is returned as is. Where AOTAutograd records a backward, the fused graph goes through
AOTAutograd instead and only "eager" is raced. torch.compile's mode="reduce-overhead" (CUDA-graph trees)
is never raced in-process: after tkopt's own CUDA graphs it faulted the H200 (unspecified launch failure,
2026-12-01, cause not found); tkopt's program, inductor under CUDA graphs, stands in for it.
`tkopt.last_report()` shows what happened.

On CUDA the optimized forward graph is replayed as a CUDA graph per input signature, as in
tkopt.compile (tkopt.cuda_graphs); parameters, which Dynamo passes as graph inputs, are captured
where they live instead of being copied in on every call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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

from tkopt.backends.inductor import InductorOrEager
from tkopt.cuda_graphs import GraphCache, capturable, signature
from tkopt.frontends.decompositions import TRACE_DECOMPOSITIONS, ensure_fake_impls
from tkopt.frontends.fx import import_fx, node_val
from tkopt.frontends.sdpa_op import keep_sdpa_whole
from tkopt.gc_pause import gc_paused
from tkopt.pipeline import optimize
from tkopt.targets.kernel_builds import workers_ahead
from tkopt.targets.torch_target import TorchTarget, first_device

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


@gc_paused()
def optimize_graph_module(
    gm: fx.GraphModule, disable: Iterable[str] = (), example_inputs: Sequence[Any] = (), select: str | None = None,
    cuda_graphs: bool = True, plain: fx.GraphModule | None = None, inductor: bool = False,
) -> tuple[fx.GraphModule, Callable[..., Any] | None]:
    """Optimize an aten-level GraphModule through tkopt.pipeline: (the optimized module, with the report in
    `.tkopt_report`; what to run, or None where the optimized module is left to AOTAutograd).

    `plain` is what runs without tkopt, on the same inputs (default: `gm` itself). With `inductor` (inference
    only: what is raced runs no autograd), inductor compiles what tkopt leaves unfused and is an alternative
    of its own; what to run is then tkopt's program as raced, or the alternative that beat it. Without, it is
    the alternative that beat tkopt, or None.

    AOTAutograd may call its compilers inside its FakeTensorMode (inference graphs do); tkopt reads the
    graph's real constants and probes kernels on real tensors, so it leaves that mode while it works.
    """
    alternative = gm if plain is None else plain
    fakes = [node_val(p) for p in gm.graph.find_nodes(op="placeholder")]  # the optimized graph's inputs, as traced
    with unset_fake_temporarily():
        args = real_inputs(example_inputs)
        graphed = cuda_graphs and first_device(args).type == "cuda"
        alternatives: dict[str, Callable[[], Callable[..., Any]]] = {"eager": lambda: alternative}
        if inductor:
            alternatives["inductor"] = lambda: InductorOrEager(alternative, example_inputs=example_inputs)

        def wrap(m: fx.GraphModule) -> Callable[..., Any]:
            run = InductorOrEager(m, example_inputs=fakes) if inductor else m
            return replay_as_cuda_graphs(run, m) if graphed else run

        target = TorchTarget(args, wrap=wrap, alternatives=alternatives, cuda_graphs=False, inductor=inductor)
        result = optimize(import_fx(gm), target, select=select, disable=disable, source="torch.compile graph")
    out = result.emitted
    out.tkopt_report = report = result.report
    log.info("tkopt: %d fusions %s, %d -> %d nodes", report.total_fused, report.fusions, report.passes.nodes_before,
             report.nodes_after)
    if result.winner != "tkopt":
        return out, result.artifact
    return out, target.runner(out) if inductor else None


def needs_autograd(example_inputs: Sequence[Any]) -> bool:
    """Whether AOTAutograd will record a backward for these inputs (its own rule)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def replay_as_cuda_graphs(fn: Callable[..., Any], owner: fx.GraphModule) -> Callable[..., Any]:
    """`fn` (a graph's forward, or inductor's code for it), replayed as a CUDA graph per input signature when
    its inputs are CUDA tensors. `owner` (the optimized graph `fn` runs) gets the cache and why the latest
    call ran uncaptured.

    Dynamo passes a model's parameters as arguments (BERT-base: about 200), each a pytree leaf at a fixed
    position. Dynamo's guards fix their layouts and the captured graph checks their addresses, so per call only
    the other arguments are checked and keyed (`_Layout`). Checking and keying all 200 cost 48 us a call on
    this repository's 2-core CPU, and on a slow host (H100, 2026-12-06) BERT-base 1x128's backend ran 0.18 ms
    a call behind reduce-overhead (`benchmarks/results/2026-12-06-h100-b/`)."""
    cache = GraphCache()
    owner.tkopt_graphs = cache
    layouts: dict[int, _Layout] = {}  # per argument count, where the arguments are pytree leaves

    def run(*args: Any) -> Any:
        layout = layouts.get(len(args))
        flat: Sequence[Any] = args
        if layout is None:
            flat, spec = pytree.tree_flatten((args, {}))
            layout = _Layout(spec, tuple(i for i, x in enumerate(flat) if not _parameter(x)))
            if len(flat) == len(args) and all(a is b for a, b in zip(flat, args, strict=True)):
                layouts[len(args)] = layout
        own = [flat[i] for i in layout.others]
        # with autograd on, capturable must see the parameters too (their requires_grad), and it needs a tensor
        every = torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) for x in own)
        owner.tkopt_uncaptured_reason = capturable(flat if every else own, owner)
        if owner.tkopt_uncaptured_reason is not None:
            return fn(*args)
        key = (len(flat), layout.others, signature(own))
        return cache(key, fn, flat, layout.spec, in_place=_parameter)

    return run


@dataclass(frozen=True)
class _Layout:
    """How Dynamo passes one compiled graph's arguments: their pytree spec, and the positions of those that
    are not parameters."""

    spec: pytree.TreeSpec
    others: tuple[int, ...]


def _parameter(x: Any) -> bool:
    return isinstance(x, nn.Parameter)


def aten_forward(gm: fx.GraphModule, example_inputs: Sequence[Any], inference: bool = False) -> fx.GraphModule:
    """Dynamo's torch-level graph as a functional aten graph of its forward (no autograd recorded), torch's
    fused fast paths decomposed: the graph tkopt fuses. With `inference` (no backward will be recorded) SDPA
    stays one op with its documented mask semantics (tkopt.frontends.sdpa_op), as in torch.export's graphs.
    Traced on Dynamo's fake inputs (their symbolic shapes), in their fake mode; a graph without them is traced
    on fakes of `example_inputs`. Dead nodes (the detach make_fx records for each tensor autograd would save)
    are dropped: they read intermediates."""
    fakes = [node_val(p) for p in gm.graph.find_nodes(op="placeholder")]
    functional = torch.func.functionalize(keep_sdpa_whole(gm) if inference else gm)
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


def make_backend(disable: Iterable[str] = (), cuda_graphs: bool = True, select: str | None = None,
                 inductor: bool | None = None) -> Callable[..., Any]:
    """A torch.compile backend that skips the passes named in `disable`; `cuda_graphs`, `select` and `inductor`
    (None: on CUDA; inference graphs only) as in tkopt.compile."""
    disabled = tuple(disable)

    def backward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        specialize_float_inputs(gm)
        on_gpu = first_device(example_inputs).type == "cuda"
        inference = not needs_autograd(example_inputs)
        use_inductor = (on_gpu if inductor is None else inductor) and inference
        with workers_ahead():
            optimized, run = optimize_graph_module(aten_forward(gm, example_inputs, inference), disabled,
                                                   example_inputs, select, cuda_graphs, plain=gm, inductor=use_inductor)
        if run is not None:  # inductor's program, or a plain alternative that measured faster
            backend.graph_modules.append(optimized)
            return run

        def forward_compiler(fw: fx.GraphModule, fw_inputs: Sequence[Any]) -> Callable[..., Any]:
            # Recorded here, not above: Dynamo may restart after AOTAutograd rejects a first graph (it
            # specializes a float it had made an input), calling this backend again for the same code.
            backend.graph_modules.append(optimized)
            graphed = cuda_graphs and first_device(fw_inputs).type == "cuda"
            return make_boxed_func(replay_as_cuda_graphs(fw, optimized) if graphed else fw.forward)

        compiler = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
        return compiler(optimized, example_inputs, **kwargs)

    backend.graph_modules = []  # the optimized graphs, newest last (with .tkopt_report)
    return backend


tkopt_backend = make_backend()
