"""`tkopt.compile`: export a module, fuse its graph, and hand back a module that runs the result.

Shapes, as torch.compile's `dynamic`: by default (dynamic=None) the first export is static, at the example's
sizes, and a call the programs so far do not cover is exported with every input dim `Dim.AUTO`, so that
torch.export makes each dim symbolic unless the model pins it (torch.compile's automatic dynamic shapes:
static code first, dynamic on a recompile). A static export costs less (GPT-2 8x1024: 0.5 s against 1.2 s,
CPU, 2026-12-06) and gives selection one size to measure. dynamic=True exports every specialization with
symbolic dims, dynamic=False every one static. Each specialization is kept, and later calls pick the first
one whose shape constraints they satisfy and whose constant state (non-persistent buffers, which the passes
fold and prove masks from) is unchanged (tkopt.state_guard). If a dynamic export fails, tkopt warns and
exports statically.

Each specialization goes through tkopt.pipeline with a torch target (tkopt.targets.torch_target): by
default (select="measured") each fusion is kept only where it measured faster than what it replaces on
the device, and the whole result only where it measured faster than what the user already has: the
module itself, eager, called as the user would call it, alternating with tkopt's result called through
this module (measure.race). On CUDA tkopt's result is inductor's code under CUDA graphs around the fused
nodes, and it is raced with every fusion put back too (and with no fusion kept): that program is what
torch.compile with CUDA graphs gives, so it stands in for both torch.compile modes, and torch.compile(module)
itself, one more whole cold compile, is not raced. In the H200 races of the benchmark models that timed
both (2026-12-01 to 03), torch.compile(module) took 0.96-8.1x that program's time; its best, on GPT-2, is
within the few percent a race flatters uncaptured code by (pipeline._whole). mode="reduce-overhead" itself
is not raced in this process: after tkopt's own CUDA graphs, its CUDA-graph trees faulted the device on the
H200 (nn.TransformerEncoderLayer, torch 2.11: "unspecified launch failure"). Where eager wins, calls go
straight to the module with the user's arguments, so they cost what it costs; where it wins the first
comparison (the one tkopt.compile makes), every later call does, and no input signature is optimized
again.

On CUDA inputs (and with autograd off) each exact input signature is captured once as a CUDA graph
and replayed afterwards (tkopt.cuda_graphs): the per-op Python dispatch would otherwise cost more
than the kernels. cuda_graphs=False runs every call through Python. On CUDA the ops tkopt left
unfused also go through inductor by default (inductor=None): the first input signature compiled directly
(tkopt.backends.inductor), later ones through torch.compile's automatic dynamic shapes (static first, dynamic on
a recompile), as the user's own torch.compile would.

A module torch.export cannot export (data-dependent control flow, as Longformer's padding to its attention
window) is compiled with torch.compile and the tkopt backend instead, with a warning naming the export's error:
Dynamo breaks the graph where export gave up and each piece goes through the same pipeline. With
check_accuracy=True the export's error is raised instead: the backend checks no accuracy.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import Dim
from torch.fx import config as fx_config

from tkopt.accuracy import Accuracy
from tkopt.backends.inductor import InductorOrEager
from tkopt.cuda_graphs import GraphCache, capturable, signature
from tkopt.differential import AccuracyError, check_module
from tkopt.frontends.fx import import_fx, node_val
from tkopt.gc_pause import gc_paused
from tkopt.input_sizes import guards_refuse
from tkopt.ir import Graph
from tkopt.object_trees import Boxed, Boxer, unbox
from tkopt.pipeline import optimize
from tkopt.report import Report
from tkopt.state_guard import StateGuard
from tkopt.targets.kernel_builds import workers_ahead
from tkopt.targets.torch_target import TorchTarget, first_device

log = logging.getLogger(__name__)


@dataclass
class Specialization:
    """One exported-and-optimized program and the inputs it accepts."""

    module: fx.GraphModule
    graph: Graph  # the IR it was emitted from (fused nodes know what they replaced)
    run: Any  # what calls go to: `module` or inductor's compilation of it, called on boxed inputs; or the
    # plain alternative that won, called with the user's own arguments
    graphed: bool  # tkopt's program won: calls are boxed and may be replayed as CUDA graphs
    report: Report
    in_spec: pytree.TreeSpec
    inputs: list[Any]  # per flat input: its placeholder's example value (FakeTensor) or the constant
    ranges: dict[sympy.Symbol, Any]
    state: StateGuard  # the buffers it folded: a write to one after compiling makes it stale
    accuracy: Accuracy | None = None  # with check_accuracy: fused against eager at several admitted sizes
    guarded: dict[tuple, bool] = field(default_factory=dict)  # the export's guards' verdict per symbol sizes
    verdicts: dict[Hashable, bool] = field(default_factory=dict)  # `accepts`' verdict per call key (_call_key)

    def accepts(self, spec: pytree.TreeSpec, flat: Sequence[Any]) -> bool:
        """Whether this program serves inputs `flat` (of structure `spec`). Decided once per call key: binding
        the sizes to the export's symbols and ranges took most of a call's host time (~100 us)."""
        if spec != self.in_spec or len(flat) != len(self.inputs) or self.state.changed() is not None:
            return False
        key = _call_key(flat)
        if key is None:
            return self._accepts(flat)
        verdict = self.verdicts.get(key)
        if verdict is None:
            if len(self.verdicts) >= VERDICTS:
                self.verdicts.clear()
            verdict = self.verdicts[key] = self._accepts(flat)
        return verdict

    def _accepts(self, flat: Sequence[Any]) -> bool:
        bound: dict[sympy.Symbol, int] = {}
        derived: list[tuple[sympy.Expr, int]] = []

        def bind(want: Any, got: int) -> bool:
            if isinstance(want, int):
                return got == want
            expr = want.node.expr
            if isinstance(expr, sympy.Symbol):
                return bound.setdefault(expr, got) == got
            derived.append((expr, got))
            return True

        for x, ex in zip(flat, self.inputs, strict=True):
            if isinstance(ex, torch.SymInt):  # an int input traced as a symbol
                if type(x) is not int or not bind(ex, x):
                    return False
                continue
            if not isinstance(ex, torch.Tensor):
                if isinstance(x, torch.Tensor) or type(x) is not type(ex) or x != ex:
                    return False
                continue
            if not isinstance(x, torch.Tensor) or x.dtype != ex.dtype or x.dim() != ex.dim():
                return False
            if x.device.type != ex.device.type:
                return False
            if not all(bind(want, got) for got, want in zip(x.shape, ex.shape, strict=True)):
                return False
        if any(int(expr.subs(bound)) != got for expr, got in derived):
            return False
        for sym, got in bound.items():
            vr = self.ranges.get(sym)
            if vr is not None and not (vr.lower <= got <= vr.upper):
                return False
        # The range can admit sizes the export's own guards refuse (a causal mask sliced from a 128-row buffer:
        # seq in [2, 128] and seq != 128); they are asked once per set of sizes, not on every call.
        sizes = tuple(bound.items())
        if sizes not in self.guarded:
            self.guarded[sizes] = guards_refuse(self.module, flat) is None
        return self.guarded[sizes]


VERDICTS = 256  # call keys a specialization remembers its verdict for (a model called at every length)


def _call_key(flat: Sequence[Any]) -> Hashable | None:
    """What `accepts` reads of `flat`: each tensor's shape, dtype and device type, every other value; None where
    a value cannot be a dict key."""
    key = tuple((x.shape, x.dtype, x.device.type) if isinstance(x, torch.Tensor) else (type(x), x) for x in flat)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class Exported(nn.Module):
    """What tkopt.compile exports: `module` on unboxed inputs, returning its boxed outputs and the final
    state of every object passed in (tkopt.object_trees), so caches and other objects holding tensors
    pass through torch.export, and objects the model updates in place are updated in place."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, args: tuple, kwargs: dict) -> tuple[Any, list[Boxed]]:
        (args, kwargs), objects = unbox((args, kwargs))
        out = self.module(*args, **kwargs)
        boxer = Boxer({id(o): i for i, o in enumerate(objects)})
        return boxer.box(out), [boxer.box_object(o) for o in objects]


def _dynamic_shapes(tree: Any) -> Any:
    """Every dim of a tensor and every int (not bool) Dim.AUTO: symbolic unless the model pins it.
    torch.export takes a pytree node of a registered class (Boxed) as the list of its children."""

    def leaf(x: Any) -> Any:
        if isinstance(x, Boxed):
            return [_dynamic_shapes(x.dynamic)]
        if isinstance(x, torch.Tensor):
            return dict.fromkeys(range(x.dim()), Dim.AUTO)
        return Dim.AUTO if type(x) is int else None

    return pytree.tree_map(leaf, tree, is_leaf=lambda x: isinstance(x, Boxed))


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Trace without recording each node's Python stack (torch.fx.config.do_not_emit_stack_traces, where torch
    has it): tkopt reads none, the program's code and inductor's cache keys hold none, and collecting them
    was ~10% of exporting BERT-base (CPU: 1.14 -> 1.03 s). Inductor's errors on the program lose the model's
    source lines."""
    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    if before is None:
        yield
        return
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _caller_level() -> int:
    """The warnings stacklevel of the first frame outside tkopt, torch.nn's call machinery and contextlib, from
    the caller of this function: tkopt.compile and a module call reach the export through different depths."""
    internal = (str(Path(__file__).parent), str(Path(nn.modules.__file__).parent), contextlib.__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def _export(module: nn.Module, args: tuple, kwargs: dict, dynamic: bool) -> torch.export.ExportedProgram:
    """Export `Exported(module)` on boxed (args, kwargs)."""
    wrapped = Exported(module)
    with _no_stack_traces():
        if dynamic:
            try:
                shapes = _dynamic_shapes((args, kwargs))
                return torch.export.export(wrapped, (args, kwargs), dynamic_shapes=shapes)
            except Exception as e:  # noqa: BLE001 - any export failure falls back to a static export
                warnings.warn(f"tkopt.compile: dynamic export failed ({type(e).__name__}: {e}); exporting with "
                              "static shapes (each new input shape will be re-exported)", stacklevel=3)
        return torch.export.export(wrapped, (args, kwargs))


class CompiledModule(nn.Module):
    """Calls the optimized program matching the inputs; exports and optimizes a new one if none does."""

    def __init__(self, module: nn.Module, disable: Iterable[str], dynamic: bool | None, cuda_graphs: bool,
                 inductor: bool | None, select: str | None, check_accuracy: bool = False) -> None:
        super().__init__()
        self.check_accuracy = check_accuracy
        self.module = module  # the eager original: what every new specialization is exported from
        self.disable = tuple(disable)
        self.select = select
        self.dynamic = dynamic
        self.cuda_graphs = cuda_graphs
        self.inductor = inductor
        self.graphs = GraphCache()
        self.uncaptured_reason: str | None = None  # why the latest call ran without a CUDA graph
        self.specializations: list[Specialization] = []
        self.plain: Any = None  # the alternative that won the first comparison: every call goes to it
        self.backend: Any = None  # where the module cannot be exported: the tkopt backend that `plain` calls
        self.export_error: str | None = None  # then why: torch.export's error, as one line
        self.plain_specs: dict[tuple[int, tuple[str, ...]], pytree.TreeSpec] = {}  # `_flatten`'s, per call form
        self.boxes_outputs: dict[int, bool] = {}  # per specialization: whether its outputs hold objects to rebuild

    @property
    def tkopt_report(self) -> Report:
        """The report of the latest specialization (`print` it for the table); where the module could not be
        exported, of the tkopt backend's latest graph (every graph's: `backend_reports`)."""
        reports = self.backend_reports
        return reports[-1] if reports else self._latest().report

    @property
    def tkopt_accuracy(self) -> Accuracy | None:
        """The latest program's accuracy check (check_accuracy=True), with the input sizes it ran."""
        return self._latest().accuracy

    @property
    def graph_module(self) -> fx.GraphModule:
        """The latest optimized program (re-exportable with torch.export)."""
        return self._latest().module

    def _latest(self) -> Specialization:
        if not self.specializations:
            raise RuntimeError("tkopt.compile: nothing is compiled yet: the module exports at its first call "
                               "(or pass example_inputs to tkopt.compile)")
        return self.specializations[-1]

    @property
    def backend_reports(self) -> list[Report]:
        """Where the module could not be exported: the tkopt backend's report per Dynamo graph, oldest first."""
        return [] if self.backend is None else [gm.tkopt_report for gm in self.backend.graph_modules]

    def _through_the_backend(self, error: Exception) -> None:
        """Route every call through torch.compile with the tkopt backend: `error` kept torch.export from
        exporting the module."""
        from tkopt.backends.dynamo import make_backend

        cause = self.export_error = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        name = type(self.module).__name__
        if self.check_accuracy:
            raise RuntimeError(f"tkopt.compile: torch.export cannot export {name} ({cause}); check_accuracy needs "
                               "an exported program") from error
        warnings.warn(f"tkopt.compile: torch.export cannot export {name} ({cause}); compiling it with "
                      "torch.compile(backend=\"tkopt\") instead, which fuses each graph between Dynamo's graph "
                      "breaks (see .backend_reports)", stacklevel=_caller_level())
        self.backend = make_backend(self.disable, self.cuda_graphs, self.select, self.inductor)
        optimized = torch.compile(self.module, backend=self.backend, dynamic=self.dynamic)
        self.plain = lambda *a, **kw: optimized(*a, **kw)  # not a submodule: its parameters are the module's
        self.uncaptured_reason = "torch.compile with the tkopt backend runs (the module cannot be exported)"

    @gc_paused()
    def specialize(self, args: tuple, kwargs: dict) -> Specialization | None:
        """Export and optimize for boxed (args, kwargs) (see `forward`); None where the module cannot be
        exported (every call then goes through the tkopt backend)."""
        with workers_ahead():
            return self._specialize(args, kwargs)

    def _specialize(self, args: tuple, kwargs: dict) -> Specialization | None:
        t0 = time.perf_counter()
        dynamic = bool(self.specializations) if self.dynamic is None else self.dynamic
        try:
            ep = _export(self.module, args, kwargs, dynamic)
        except Exception as e:  # noqa: BLE001 - whatever stops torch.export, Dynamo may trace around
            self._through_the_backend(e)
            return None
        graph = import_fx(ep)
        exported = time.perf_counter() - t0
        _, _, flat, spec = self._flatten(args, kwargs)  # plain tensors: the very spec later calls compare with
        device = first_device(flat)
        # Inductor on the rest: it fuses the elementwise ops tkopt leaves (RoPE, casts, masks) and calls
        # the tkopt:: ops as extern kernels, through their fake impls while tracing.
        use_inductor = device.type == "cuda" if self.inductor is None else self.inductor
        wrap = (lambda gm: InductorOrEager(gm, dynamic)) if use_inductor else None
        index = len(self.specializations)

        def as_user(run: Any) -> Any:  # tkopt's program behind this module's own call path
            def user_call(*a: Any, **kw: Any) -> Any:
                return self._call(index, run, *self._flatten(a, kw))

            return user_call

        def call(fn: Any) -> Any:  # fresh objects per call: a model may update a cache passed in
            a, kw = unbox((args, kwargs))[0]
            return fn(*a, **kw)

        target = TorchTarget((args, kwargs), wrap=wrap, alternatives=self._alternatives(),
                             cuda_graphs=self.cuda_graphs, inductor=use_inductor, as_user=as_user, call=call)
        result = optimize(graph, target, select=self.select, disable=self.disable, source=type(self.module).__name__)
        result.report.seconds = {"export": exported, **result.report.seconds}
        gm = result.emitted
        won = result.winner == "tkopt"
        run = target.runner(gm) if won else result.artifact
        placeholders = gm.graph.find_nodes(op="placeholder")
        examples = [node_val(p) if isinstance(x, (torch.Tensor, int)) and not isinstance(x, bool) else x
                    for p, x in zip(placeholders, flat, strict=True)]
        ranges = ep.range_constraints if dynamic else {}
        mutated = [n.removeprefix("module.") for n in ep.graph_signature.buffers_to_mutate.values()]
        state = StateGuard.record(self.module, mutated)
        entry = Specialization(gm, result.graph, run, won, result.report, spec, examples, ranges, state)
        if self.check_accuracy:
            def eager(*a: Any, **kw: Any) -> Any:
                a, kw = unbox((a, kw))[0]
                return self.module(*a, **kw)

            def fused(*a: Any, **kw: Any) -> Any:
                if not won:
                    a, kw = unbox((a, kw))[0]
                    return run(*a, **kw)
                return unbox(run(a, kw)[0])[0]

            entry.accuracy = check_module(eager, fused, examples, ranges, args, kwargs, guarded=gm)
            if not entry.accuracy.ok:
                bad = [o.name for o in entry.accuracy.outputs if not o.ok]
                raise AccuracyError(f"tkopt.compile: fused outputs {bad} differ from eager beyond tolerance: "
                                    f"{entry.accuracy.outputs}")
        self.specializations.append(entry)
        self.graphs.drop(lambda key: key[0] == index and key[1] is not run)  # the race's losing program
        if not won and index == 0:
            self.plain = run
            self.uncaptured_reason = f"the plain alternative runs ({result.winner})"
        if len(self.specializations) > 1:
            log.info("tkopt.compile: optimized specialization %d for a new input signature", len(self.specializations))
        return entry

    def _alternatives(self) -> dict[str, Any]:
        """What a user of this module already has, exactly as they would have it: the module itself. On CUDA
        torch.compile(module) is not raced: see the module docstring."""
        return {"eager": lambda: self.module}

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[list[Any], tuple[tuple, dict], list[Any], pytree.TreeSpec]:
        """A call's arguments as the programs take them: (the objects boxed, in box order; the boxed (args,
        kwargs); `(boxed, {})` flattened and its spec). Arguments that are all plain tensors, the common call, skip
        pytree's walks (boxing them changes nothing): those walks took more host time than a small model's
        CUDA-graph replay."""
        if all(type(x) is torch.Tensor for x in args) and all(type(x) is torch.Tensor for x in kwargs.values()):
            form = (len(args), tuple(kwargs))
            spec = self.plain_specs.get(form)
            if spec is None:
                spec = self.plain_specs[form] = pytree.tree_flatten(((args, kwargs), {}))[1]
            return [], (args, kwargs), [*args, *kwargs.values()], spec
        boxer = Boxer()
        boxed = boxer.box((args, kwargs))
        return boxer.objects, boxed, *pytree.tree_flatten((boxed, {}))

    def _call(self, index: int, run: Any, objects: list[Any], boxed: tuple[tuple, dict],
              flat: list[Any], spec: pytree.TreeSpec) -> Any:
        """A call of tkopt's program `run` (specialization `index`) on the user's arguments (`_flatten`):
        replayed as a CUDA graph where it can be, the objects passed in updated to the state the model left."""
        self.uncaptured_reason = "cuda_graphs=False" if not self.cuda_graphs else capturable(flat, self.module)
        if self.uncaptured_reason is not None:
            out, finals = run(*boxed)
        else:
            # `run` in the key: the whole-graph race calls two of tkopt's programs for one specialization
            out, finals = self.graphs((index, run, signature(flat)), run, flat, spec)
        if objects:
            unbox(finals, objects)
        boxes = self.boxes_outputs.get(index)
        if boxes is None:  # one program's outputs have one structure: looked at once
            leaves = pytree.tree_leaves(out, is_leaf=lambda x: isinstance(x, Boxed))
            boxes = self.boxes_outputs[index] = any(isinstance(x, Boxed) for x in leaves)
        return unbox(out, objects)[0] if boxes else out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.plain is not None:
            return self.plain(*args, **kwargs)
        objects, boxed, flat, spec = self._flatten(args, kwargs)
        index = next((i for i, e in enumerate(self.specializations) if e.accepts(spec, flat)), None)
        if index is None:
            if self.specialize(*boxed) is None:
                return self.plain(*args, **kwargs)
            index = len(self.specializations) - 1
        entry = self.specializations[index]
        if not entry.graphed:
            self.uncaptured_reason = f"the plain alternative runs ({entry.report.whole_graph.winner})"
            return entry.run(*args, **kwargs)
        return self._call(index, entry.run, objects, boxed, flat, spec)


def compile(  # noqa: A001 - the public name mirrors torch.compile
    module: nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    disable: Iterable[str] = (),
    dynamic: bool | None = None,
    cuda_graphs: bool = True,
    inductor: bool | None = None,
    select: str | None = None,
    check_accuracy: bool = False,
) -> CompiledModule:
    """Export `module` with `example_inputs` (its positional arguments; a lone tensor is the one argument)
    and keyword inputs `example_kwargs`, fuse, and return a module with the same call signature and the
    same outputs, as torch.export takes them. Without either, the export waits for the first call, as
    torch.compile's does (`tkopt.compile(module)` then `module(x)`); `()` is an example for a module that
    takes no arguments.

    Inputs and outputs may hold objects torch's pytree does not know, such as transformers' KV caches:
    they are flattened by their attributes (tkopt.object_trees), and a cache the model updates in place is
    updated in place. `disable` names passes to skip (tkopt.passes.pipeline.pass_names()). The result has
    `.tkopt_report` (tkopt.report.Report: print it) and `.graph_module` (the optimized fx.GraphModule,
    called as `graph_module(args, kwargs)` on boxed inputs).
    `dynamic`: None (default) exports static first and with symbolic dims for a call no program so far covers,
    as torch.compile does; True: symbolic dims from the first export; False: static exports only.
    `cuda_graphs` replays CUDA calls without autograd as CUDA graphs (see the module docstring).
    `inductor` compiles what tkopt left unfused with torch.compile's inductor (the fused nodes stay
    tkopt's kernels); it costs inductor's compile time per specialization. None (default): on for
    CUDA inputs, where it measured 1.2-1.6x faster than running the leftovers eagerly (H200).
    `select`: "measured" (the default wherever kernels run) keeps only fusions, and a result, that
    measured faster on the device (tkopt.pipeline); "all" keeps every fusion that has a kernel.
    `check_accuracy` runs each optimized program against eager at several sizes its dims admit
    (tkopt.differential; `.tkopt_accuracy` lists them) and raises AccuracyError on a mismatch.
    """
    compiled = CompiledModule(module, disable, dynamic, cuda_graphs, inductor, select, check_accuracy)
    if example_inputs is None and example_kwargs is None:
        return compiled
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ())
    compiled.specialize(*Boxer().box((args, dict(example_kwargs or {}))))
    return compiled
