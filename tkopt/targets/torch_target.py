"""Torch targets: fused nodes run as tkopt:: custom ops in an fx.GraphModule, on CPU or CUDA.

A fused node is timed against its replaced fx nodes run eagerly (ATen); where the entry point runs the
unfused rest through inductor (tkopt.compile's default on CUDA, inductor=True anywhere) and the node beat
eager, it is then timed against inductor's code for those nodes, which decides. On CUDA both sides are
CUDA-graph replays. The final module is timed against the entry point's alternatives (the user's module or
Dynamo's graph eager, and on CUDA in inference inductor's compilation of it), on CUDA even with no fusion
kept: the program then still adds what the entry point runs around the fused nodes (inductor, CUDA graphs),
and with fusions kept, the same program unfused is raced too (tkopt.pipeline). Nodes are measured on
their real inputs: the original graph runs once on the example inputs (torch.fx.Interpreter) to capture
them. The whole graph is timed through the same call path the user's calls take, alternating with the
alternatives (measure.race).

Sizes: a dynamic export (tkopt.compile's second specialization, or its first with dynamic=True, and the
backend's graphs with dynamic dims) serves every size its symbolic dims admit, and a fusion that wins at a
small example can lose at the sizes the user then runs (a kernel tuned for few rows against cuBLAS or
inductor at many). Where the graph's inputs have symbolic dims,
a node that wins at the example inputs is measured again at one larger size (`larger_sizes`): every
symbolic dim scaled by one factor, so that the inputs hold about GROWTH times the example's elements (16x:
batch and sequence 4x each, a lone batch dim 16x), each within the range torch.export admits for it and none
past LARGE_DIM unless its example is: a dim that long already gives every GEMM over it rows for waves of tiles,
and growing a sequence multiplies the attention over it by the square (a Llama-style model served at 1x8192 and
grown 16x would have been measured and probed at 131072 keys, where the attention reference alone needs 1 TiB).
It is kept only if it wins at both. One size, not several: the example already stands for small sizes, where
a fused node, fewer launches, is at its best; a larger one is where it loses. Its inputs are the example
inputs resized along the symbolic dims (tkopt.input_sizes), and the original graph runs there to capture
the node's inputs, once, and only when some node won at the example. A size the export's guards refuse
is shrunk toward the example (`larger_sizes`); one the model cannot run at (a bound the export did not
see, memory) is skipped with a warning naming it. Per node that won at the example
this costs one more comparison (node_timer: at most about a second a side) and, with inductor, one more
compile of what it replaces; a node that lost costs nothing more, and static graphs are measured once, as
before. The whole graph is raced at the example inputs only: at a second size every variant would compile
(inductor, automatic dynamic shapes: a recompile) and capture its CUDA graphs again, the largest part of
compile time, to recheck what each node already won at both sizes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx

from tkopt.accuracy import OutputError, output_error
from tkopt.backends import inductor
from tkopt.backends.inductor_ahead import AheadCompile
from tkopt.backends.torch_module import to_torch_module
from tkopt.backends.torch_ops import CUSTOM_OPS, attr_args
from tkopt.frontends.fx import node_val, slot_values
from tkopt.fused_ops import run_kernel, run_reference, schema, use_kernels
from tkopt.input_sizes import (
    CheckedRun,
    guards_refuse,
    resize_inputs,
    resized,
    shape_ranges,
    size_at,
    stand_in,
    torch_dims,
)
from tkopt.ir import Graph, Node, Value
from tkopt.kernels import tuning
from tkopt.kernels.tuning import shape_bucket
from tkopt.kernels.workers import Cancel, Compile
from tkopt.measure import Timer, Timing, compare, per_call, race

from . import Measured, Target, Wins, cpu_model, replaced_signature
from .kernel_builds import (
    DTYPES,
    load,
    prebuild,
    probe_inputs,
    probe_record,
    probe_specs,
    probes_passed,
    record_built,
    record_probes,
)


def probe_error(name: str, got: torch.Tensor, want: torch.Tensor) -> OutputError:
    """A probe's output against the reference's (tkopt.accuracy.output_error), leaving out the elements whose
    reference is within a factor 2 of the dtype's largest value: random inputs of unit scale put a large GEMM's
    products there (a gated MLP's in float16), where the kernel and the reference may round to inf apart."""
    if got.is_floating_point() and want.is_floating_point() and got.shape == want.shape and want.numel():
        edge = torch.finfo(want.dtype).max / 2
        near = want.abs() > edge
        if bool(near.any()):
            got, want = got.masked_fill(near, 0), want.masked_fill(near, 0)
    return output_error(name, got, want)


GROWTH = 16  # the larger size's inputs hold about this many times the example's elements (module docstring)
LARGE_DIM = 4096  # no symbolic dim grows past this size, nor past its example where that is larger (module docstring)


@dataclass
class Size:
    """Inputs a fused node is measured at: how labels name them, the symbols' sizes there (empty: the example
    inputs of a static graph), and the flat inputs, made when first read: decision keys need only the sizes,
    and with every decision cached the larger inputs would be made for nothing."""

    label: str
    dims: dict[Any, int]
    make: Callable[[], list[Any]]

    @functools.cached_property
    def flat(self) -> list[Any]:
        return self.make()


def first_device(values: Sequence[Any]) -> torch.device:
    """The device of the first tensor among `values` (example inputs), cpu if none."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def replayed(fns: Sequence[Callable[[], Any]], device: torch.device, calls: int | None = None,
             least_ms: float = 0.1, most: int = 16) -> tuple[list[Callable[[], Any]], int]:
    """`fns` as CUDA-graph replays on CUDA, each replay `calls` back-to-back calls of its function, and `calls`:
    as given, or enough that the fastest of them lasts `least_ms` (up to `most`), the same for all so that
    their raw times compare. A node's time is then what it costs inside a program's CUDA graph, not one graph
    launch's latency, which a busy CPU stretches: timed one call a replay, BERT-base 1x128's attention node
    read 0.0146 ms against 0.0170 unfused in one run and 0.0187 against 0.0185 in the next, a win turned into
    a loss. Elsewhere, or where one cannot be captured: `fns` as they are, one call each."""
    from tkopt.cuda_graphs import capture

    if device.type != "cuda":
        return list(fns), 1
    try:
        if calls is None:
            ones = [capture(fn, device)[0] for fn in fns]
            calls = min(most, max(1, math.ceil(least_ms / max(min(map(_replay_ms, ones)), 1e-3))))
            if calls == 1:
                return [g.replay for g in ones], 1
        n = calls
        graphs = [capture(lambda fn=fn: [fn() for _ in range(n)], device)[0] for fn in fns]
    except Exception:  # noqa: BLE001 - uncapturable: time them as they are
        return list(fns), 1
    return [g.replay for g in graphs], calls


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """The fastest of three replays of `graph` (ms, CUDA events; its launch latency included)."""
    timer = Timer("cuda", runs=3, warmup=1)
    return timer(graph.replay).min_ms


class TorchTarget(Target):
    """tkopt.compile's and the torch.compile backend's target (see the module docstring).

    `args`/`kwargs`: real example inputs, as the emitted module is called. `wrap(gm)` is how the entry
    point will run an emitted module (e.g. inductor for the unfused rest). `alternatives` maps a name to
    a factory of the plain callable the user already has (built only when timed or chosen). The whole
    graph is timed as the user will call it: `as_user(runner(gm))` is the entry point's call path around
    its runner (default: the runner), and `call(fn)` calls such a callable, or an alternative, once as
    the user does (default: `fn(*args, **kwargs)`).
    `cuda_graphs`: the entry point replays CUDA calls as CUDA graphs. `inductor`: the entry point runs the
    unfused rest through inductor (on any device), so a node that beats eager ATen is then timed against
    inductor's code for what it replaces.
    """

    def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *,
                 wrap: Callable[[fx.GraphModule], Callable[..., Any]] | None = None,
                 alternatives: Mapping[str, Callable[[], Callable[..., Any]]] | None = None,
                 cuda_graphs: bool = True, inductor: bool = False,
                 as_user: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
                 call: Callable[[Callable[..., Any]], Any] | None = None, build_workers: int | None = None) -> None:
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        self.flat = pytree.tree_leaves((self.args, self.kwargs))
        self.device = first_device(self.flat)
        self.name = "torch-cuda" if self.device.type == "cuda" else "torch-cpu"
        self.wrap = wrap or (lambda gm: gm)
        self.factories = dict(alternatives or {})
        self.built: dict[str, Callable[..., Any]] = {}
        self.wrapped: dict[int, tuple[fx.GraphModule, Callable[..., Any]]] = {}
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.inductor = inductor
        self.node_timer = Timer(self.device, runs=20, warmup=1, max_seconds=1.0)
        self.build_workers = build_workers  # worker interpreters building kernels (None: one per core but one)
        self.as_user = as_user or (lambda run: run)
        self.call = call or (lambda fn: fn(*self.args, **self.kwargs))
        self.sized: dict[int, tuple[fx.GraphModule, list[Size]]] = {}  # per graph module: its sizes (`sizes`)
        self.seconds: dict[str, float] = {}
        self.called: set[int] = set()  # ids of the callables `prepare_whole` called (held: programs, alternatives)
        self.likely: dict[str, AheadCompile] = {}  # likely programs' code -> their compile in a child

    @contextlib.contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        """Add the wall time of the block (its device work done) to `part` of `stage_seconds()`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0

    def stage_seconds(self) -> dict[str, float]:
        return dict(self.seconds)

    @property
    def where(self) -> str:
        return str(self.device)

    def measurable(self) -> str | None:
        return None if use_kernels() else "TKOPT_KERNELS=reference: fused ops run their torch references"

    def runner(self, gm: fx.GraphModule) -> Callable[..., Any]:
        """`wrap(gm)`, made once per module (inductor compiles it at the first call). A module with the code of a
        likely program `prepare_whole` started compiling takes that compile over: the same code on the same
        attributes is the same graph for inductor's cache (where they differ, the key does, and it compiles here)."""
        if id(gm) not in self.wrapped:
            run = self.wrap(gm)
            ahead = self.likely.pop(gm.code, None)
            if isinstance(run, inductor.InductorOrEager) and ahead is not None:
                run.ahead = ahead
            self.wrapped[id(gm)] = (gm, run)  # the module is held, so its id is not reused
        return self.wrapped[id(gm)][1]

    def _compile_ahead(self, run: Callable[..., Any]) -> bool:
        """Start inductor's compile of `run`'s program in a child (inductor_ahead), for the example inputs."""
        return isinstance(run, inductor.InductorOrEager) and run.compile_ahead(self.flat)

    def fingerprint(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            device = torch.cuda.get_device_name(self.device)
        else:
            device = f"{cpu_model()} x{torch.get_num_threads()} threads"
        return {"device": device, "torch": torch.__version__, "kernels": "tilelang" if use_kernels() else "reference",
                "unfused": "inductor" if self.inductor else "eager", "cuda_graphs": self.cuda_graphs}

    # ---- kernels ----------------------------------------------------------------------------------
    def probe(self, graph: Graph, nodes: list[Node], meanwhile: Callable[[], None] | None = None) -> dict[str, str]:
        """Run each distinct kernel once on random inputs of its example shapes; nodes with the same signature
        share one probe (and one compiled kernel: the kernels cache them by compile-time key). The kernels
        their calls use, tuning candidates included, are built in one parallel wave first and loaded here
        (kernel_builds.prebuild), `meanwhile` running here as they do (a thread waits on the workers); the
        probes then only check them, with tuning off: tuning belongs at the real shapes."""
        if not use_kernels():
            if meanwhile is not None:
                meanwhile()
            return {}
        groups: dict[str, list[Node]] = {}
        for n in nodes:
            groups.setdefault(repr(_probe_key(n)), []).append(n)
        # Every node, not one per group: one signature's nodes may differ in M, and a GEMM's default tile with it.
        # At each size selection measures them at, where it measures (its node keys sized the graph): a GEMM of
        # few rows at the example tunes at the larger size.
        sized = self.sized.get(id(graph.meta.get("fx_module")))
        sizes = [size.dims for size in sized[1][1:]] if sized is not None else []
        with self._timed("kernels: parallel builds"), ThreadPoolExecutor(1) as builder:
            cancel = Cancel()
            built = builder.submit(self._wave, nodes, sizes, cancel, meanwhile is not None)
            try:
                if meanwhile is not None:
                    meanwhile()
            except BaseException:  # an interrupt (Ctrl-C) leaves now, not when the wave ends
                cancel.cancel()
                raise
            compiles = built.result()
        with self._timed("kernels: loads here (compiles where no worker built)"):
            load(compiles)
        with self._timed("kernels: probes"):
            reasons = self._probes(groups)
        record_built([n for k, group in groups.items() if reasons[k] is None for n in group], self.device,
                     self.fingerprint(), sizes)
        return {n.name: reasons[k] for k, group in groups.items() for n in group if reasons[k] is not None}

    def check_kept(self, graph: Graph, nodes: list[Node]) -> dict[str, str]:
        """Selection's first calls tuned the kept nodes' kernels at their real shapes, at each size it measured:
        where the kernel a node runs there (a tuning winner; at a larger size, a GEMM's tile for more rows) is not
        one a probe checked, it is probed now, at that size, before the node is kept (measurement times outputs,
        it does not check them)."""
        if not use_kernels():
            return {}
        groups: dict[str, list[Node]] = {}
        for n in nodes:
            groups.setdefault(repr(_probe_key(n)), []).append(n)
        sized = self.sized.get(id(graph.meta.get("fx_module")))
        failed: dict[str, str] = {}
        with self._timed("selection: probes of tuned kernels"):
            for i, size in enumerate(sized[1] if sized is not None else [None]):
                at = size.dims if i else None
                where = f" at {size.label}" if i else ""
                reasons = self._probes({k: g for k, g in groups.items() if k not in failed}, at)
                failed |= {k: f"its tuned kernel{where}: {why}" for k, why in reasons.items() if why is not None}
        return {n.name: failed[k] for k, group in groups.items() if k in failed for n in group}

    def _probes(self, groups: dict[str, list[Node]], at: Mapping[Any, int] | None = None) -> dict[str, str | None]:
        """`_probe` of each group's first node (at the example, or at the symbols' sizes `at`), except where that
        very kernel passed on those inputs before on this machine (`probe_record`): a warm compile runs no probe."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            records = {k: probe_record(group[0], self.device, self.fingerprint(), at) for k, group in groups.items()}
        passed = probes_passed()
        reasons = {k: None if records[k] in passed else self._probe(group[0], at) for k, group in groups.items()}
        record_probes([records[k] for k in groups if reasons[k] is None])
        return reasons

    def _wave(self, nodes: list[Node], sizes: list[Mapping[Any, int]], cancel: Cancel, beside: bool) -> list[Compile]:
        """prebuild, its own duration kept apart: what runs beside it may take longer."""
        t0 = time.perf_counter()
        try:
            return prebuild(nodes, self.device, self.fingerprint(), sizes, self.build_workers, cancel, beside)
        finally:
            self.seconds["kernels: the build wave itself"] = time.perf_counter() - t0

    def _probe(self, node: Node, at: Mapping[Any, int] | None = None) -> str | None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # A torch.compile backend runs under Dynamo's fake mode. No tuning: it belongs at the real shapes (the
        # first calls in selection), and the wave built what those time. The outputs are checked against the op's
        # reference: a kernel that computes wrong on this device is declined, as one that fails is.
        with unset_fake_temporarily(), tuning.suspended():
            try:
                inputs = probe_inputs(probe_specs(node, at), self.device)
                got = run_kernel(node.op, inputs, node.attrs)
                want = run_reference(node.op, inputs, node.attrs)
            except Exception as e:  # noqa: BLE001 - any failure means this node's kernel is unusable
                return f"{type(e).__name__}: {e}"
        for name, g, w in zip(schema(node.op).outputs, got, want, strict=False):
            err = probe_error(name, g, w)
            if not err.ok:
                return (f"output {err.name} differs from the op's reference on random inputs: max relative error "
                        f"{err.max_rel:.2e} > {err.tolerance:.0e} ({err.dtype})")
        return None

    # ---- measurement ------------------------------------------------------------------------------
    def sizes(self, gm: fx.GraphModule) -> list[Size]:
        """The example inputs, and where the graph has symbolic input dims, the larger size (module docstring)."""
        if id(gm) not in self.sized:
            self.sized[id(gm)] = (gm, larger_sizes(gm, self.flat, self.where))  # held: its id stays its own
        return self.sized[id(gm)][1]

    def node_key(self, graph: Graph, node: Node) -> Any:
        """Static dims as they are; a dynamic dim as its shape bucket at each size measured (`sizes`)."""
        dims = [size.dims for size in self.sizes(graph.meta["fx_module"])[1:]]
        return [node.op, schema(node.op).full_attrs(node.attrs), replaced_signature(node),
                [None if v is None else [v.dtype, _shape_key(v, dims)] for v in node.inputs]]

    def measure(self, graph: Graph, nodes: list[Node], wins: Wins) -> Iterator[Measured]:
        """Each node at each size (`sizes`) until it loses at one; a size's inputs are captured when first needed."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        gm: fx.GraphModule = graph.meta["fx_module"]
        sizes = self.sizes(gm)
        captured: dict[int, dict[fx.Node, Any] | None] = {}  # per size; None: the model does not run there

        def values(i: int) -> dict[fx.Node, Any] | None:
            if i not in captured:
                timed = self._timed("selection: the original graph's run at the larger size") if i else None
                try:
                    with timed or contextlib.nullcontext():
                        captured[i] = capture_values(gm, nodes, sizes[i].flat)
                except Exception as e:  # noqa: BLE001 - the example inputs run (they were exported); others may not
                    if i == 0:
                        raise
                    captured[i] = None
                    warnings.warn(f"tkopt: fusions on {self.where} are not measured at {sizes[i].label}: the model "
                                  f"does not run there ({type(e).__name__}: {next(iter(str(e).splitlines()), '')})",
                                  stacklevel=3)
            return captured[i]

        with unset_fake_temporarily(), torch.no_grad():
            for n in nodes:
                m = Measured(n)
                for i, size in enumerate(sizes):
                    at = values(i)
                    if at is not None and not self._measure(graph, n, at, wins, size.label, m):
                        break
                yield m

    def _measure(self, graph: Graph, n: Node, values: Mapping[fx.Node, Any], wins: Wins, label: str,
                 m: Measured) -> bool:
        """`n` at one size (`values`: what the graph computes there; `label`: how it is named) against its
        replaced nodes run eagerly; with inductor, then against inductor's code for them, but only if the
        fused op beat eager: inductor's code for a subgraph is in practice no slower than ATen's, so a node
        that loses to eager would lose to inductor too, and its compile (seconds each) buys nothing. Adds
        the timings to `m` (or the error); returns whether `n` won at this size."""
        try:
            ins = [None if v is None else input_tensor(v, values, self.device) for v in n.inputs]
            tiny, tiny_args = replaced_module(graph, n, values)
            d = schema(n.op)
            attrs = attr_args(n.op, n.attrs)
            op = CUSTOM_OPS[n.op]

            def fused_call() -> Any:
                return op(*d.padded(ins), *attrs)

            with self._timed("selection: fused ops' first calls (tuning at real shapes)"):
                fused_call()
            (fused, unfused), calls = replayed([fused_call, lambda: tiny(*tiny_args)], self.device)
            pair = per_call(compare(fused, unfused, self.node_timer), calls)
        except Exception as e:  # noqa: BLE001 - a kernel that fails at the real shapes is not kept
            at = "" if not m.sizes else f"at {label}: "
            m.error = f"{at}{type(e).__name__}: {e}"
            return False
        m.sizes.append(pair)
        m.labels.append(f"{label}, against eager")
        if not self.inductor or not wins(*pair):
            return wins(*pair)
        try:
            # static code for these shapes, apart from a compile in progress
            with torch._guards.tracing(None), self._timed("selection: inductor compiles"):
                compiled = inductor.compile_graph(tiny, tiny_args)
            # captured together, so both are replays of `calls` calls or both run as they are
            (fused, unfused), calls = replayed([fused_call, lambda: compiled(*tiny_args)], self.device, calls)
            pair = per_call(compare(fused, unfused, self.node_timer), calls)
        except Exception as e:  # noqa: BLE001 - the entry point runs eager code where inductor fails
            warnings.warn(f"tkopt: inductor failed on what {n.name} ({n.op}) replaces at {label} "
                          f"({type(e).__name__}: {next(iter(str(e).splitlines()), '')}); "
                          "it is decided against eager", stacklevel=3)
            return True
        m.sizes.append(pair)
        m.labels.append(f"{label}, against inductor")
        return wins(*pair)

    # ---- emit and the whole graph -----------------------------------------------------------------
    def emit(self, graph: Graph) -> fx.GraphModule:
        return to_torch_module(graph)

    def alternatives(self) -> list[str]:
        return list(self.factories)

    def races_unfused(self) -> bool:
        return self.device.type == "cuda"  # there both entry points run it their own way (CUDA graphs, inductor)

    def alternative(self, name: str) -> Callable[..., Any]:
        if name not in self.built:
            self.built[name] = self.factories[name]()
        return self.built[name]

    def prepare_whole(self, programs: list[fx.GraphModule], likely: Callable[[], list[fx.GraphModule]]) -> None:
        """The first calls of `programs` (as the user calls them) and of the alternatives: inductor compiles,
        CUDA-graph captures. One that fails here is left to the race, which says why. A program inductor compiles
        at its first call with static shapes is compiled in a child process instead (inductor_ahead), beside
        selection and the fused program's compile here, all of which it used to hold up; its first call is the
        race's, which finds inductor's code cached. So is each `likely` program where `programs` did (not inside
        Dynamo's context), and a program emitted later with the same code takes its compile over (`runner`)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.no_grad(), self._timed("whole graph: first calls, while kernels build"):
            runs = [run for run in map(self.runner, programs) if not self._compile_ahead(run)]
            if len(runs) < len(programs):
                for gm in likely():
                    run = self.runner(gm)
                    if self._compile_ahead(run):
                        self.likely[gm.code] = run.ahead
            firsts = [("tkopt's programs", self.as_user(run), run) for run in runs]
            firsts += [(name, alt, alt) for name, alt in ((n, self.alternative(n)) for n in self.factories)]
            for name, fn, inner in firsts:
                with self._timed(f"whole graph: first calls, while kernels build: {name}"), \
                        contextlib.suppress(Exception):
                    self.call(fn)
                    self.called.add(id(inner))

    def whole_key(self, graph: Graph, programs: dict[str, fx.GraphModule]) -> Any:
        inputs = [[str(x.dtype), list(x.shape)] if isinstance(x, torch.Tensor) else repr(x) for x in self.flat]
        return ["whole", {name: gm.code for name, gm in sorted(programs.items())}, inputs, sorted(self.factories)]

    def compare_whole(self, graph: Graph, programs: dict[str, fx.GraphModule]) -> dict[str, Timing]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        inner = {name: self.runner(gm) for name, gm in programs.items()}
        for ahead in self.likely.values():  # a likely program no program took over (selection declined more)
            ahead.stop()
        self.likely.clear()
        variants = {name: self.as_user(run) for name, run in inner.items()}
        with unset_fake_temporarily(), torch.no_grad():
            inner.update((name, self.alternative(name)) for name in self.factories)
            variants.update((name, inner[name]) for name in self.factories)
            calls = {name: (lambda fn=fn: self.call(fn)) for name, fn in variants.items()}
            for name, call in calls.items():  # compiles (inductor) and captures (CUDA graphs), timed apart
                if id(inner[name]) not in self.called:  # else `prepare_whole` made its first call
                    with self._timed("whole graph: first calls"):
                        call()
                ahead = getattr(inner[name], "ahead", None)
                if ahead is not None and ahead.here_seconds is not None:
                    found = "found" if ahead.found else "did not find"
                    self.seconds[f"whole graph: a child's compile ahead ({name})"] = ahead.seconds or 0.0
                    self.seconds[f"whole graph: the compile here, which {found} the child's code ({name})"] = \
                        ahead.here_seconds
            return race(calls, self.device)


def input_tensor(v: Value, values: Mapping[fx.Node, Any], device: torch.device) -> torch.Tensor:
    """A fused node's input: its captured value, or a constant a pass made."""
    if isinstance(v.origin, fx.Node) and v.origin in values:
        return values[v.origin]
    if v.const is not None:
        t = torch.from_numpy(np.array(v.const))
        return t.to(device=device, dtype=DTYPES.get(v.dtype or "", t.dtype))
    raise ValueError(f"input {v.name} was not captured")


def _hint(d: Any) -> int | None:
    if isinstance(d, int):
        return d
    try:
        return int(d.node.hint)
    except (AttributeError, TypeError, ValueError):
        return None


def _shape_key(v: Value, larger: Sequence[Mapping[Any, int]] = ()) -> list[Any] | None:
    """The value's shape: static dims as they are; a dynamic dim as its shape bucket at the example inputs
    ("?" where unknown), and where `larger` sizes of the symbols are measured too, [that, its bucket at each]."""
    if v.shape is None:
        return None
    val = node_val(v.origin) if isinstance(v.origin, fx.Node) else None
    real = list(val.shape) if isinstance(val, torch.Tensor) and val.dim() == len(v.shape) else list(v.shape)
    out: list[Any] = []
    for ir_dim, d in zip(v.shape, real, strict=True):
        if isinstance(ir_dim, int):
            out.append(ir_dim)
            continue
        size = _hint(d)
        bucket = "?" if size is None else shape_bucket(size)
        out.append([bucket, *(_bucket_at(d, dims) for dims in larger)] if larger else bucket)
    return out


def _bucket_at(d: Any, dims: Mapping[Any, int]) -> Any:
    """The shape bucket of dim `d` where the symbols have the sizes `dims` ("?" where it reads others)."""
    size = size_at(d, dims)
    return "?" if size is None else shape_bucket(size)


def larger_sizes(gm: fx.GraphModule, flat: Sequence[Any], where: str = "cpu") -> list[Size]:
    """The sizes to measure `gm`'s nodes at: the example inputs (`flat`, one per placeholder), and where the
    placeholders' values have symbolic dims, the larger size (module docstring). Labels name the inputs that
    hold those dims, with their shapes there. An export's range can admit a size its guards refuse (GPT-2's
    causal mask sliced from a 128-row buffer: seq in [2, 128], and seq != 128): a refused size is halved in
    growth until the guards take it; if none is taken, a warning names the first refused."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    examples = [node_val(p) for p in placeholders]
    dims = torch_dims(examples, flat, shape_ranges(examples)) if len(examples) == len(flat) else {}
    if not dims:
        return [Size("example inputs", {}, lambda: list(flat))]
    example = {s: r.example for s, r in dims.items()}
    out = [Size(f"example inputs ({_shapes(placeholders, examples, flat)})", example, lambda: list(flat))]
    refused = ""
    growth = GROWTH
    while (larger := {s: min(r.scaled(growth ** (1 / len(dims))), max(r.example, LARGE_DIM))
                      for s, r in dims.items()}) != example:
        shaped = resize_inputs(examples, flat, larger, stand_in)
        label = f"larger inputs ({_shapes(placeholders, examples, shaped)})"
        why = guards_refuse(gm, shaped)
        if why is None:
            out.append(Size(label, larger, _inputs_at(examples, flat, larger)))
            break
        refused = refused or f"{label} ({why})"
        growth /= 2
    if len(out) == 1 and refused:  # else the label of the size measured says where it was
        warnings.warn(f"tkopt: the export's guards refuse {refused}; fusions on {where} are measured at the "
                      "example inputs only", stacklevel=4)
    return out


def _inputs_at(examples: Sequence[Any], flat: Sequence[Any], sizes: Mapping[Any, int]) -> Callable[[], list[Any]]:
    """What makes `flat` at `sizes`: seeded normal floats, ids and masks tiled (input_sizes.resized)."""

    def make() -> list[Any]:
        gen = torch.Generator().manual_seed(0)
        return resize_inputs(examples, flat, sizes, lambda x, shape: resized(x, shape, gen))

    return make


def _shapes(placeholders: Sequence[fx.Node], examples: Sequence[Any], flat: Sequence[Any]) -> str:
    """'x 8x64, mask 8x64': the shapes in `flat` of the first inputs that hold each input symbol."""
    named: list[str] = []
    seen: set[Any] = set()
    for p, ex, x in zip(placeholders, examples, flat, strict=True):
        if not isinstance(ex, torch.Tensor) or not isinstance(x, torch.Tensor):
            continue
        syms = {d.node.expr for d in ex.shape if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol)}
        if syms - seen:
            seen |= syms
            named.append(f"{p.name} {'x'.join(map(str, x.shape))}")
    return ", ".join(named)


def _probe_key(n: Node) -> tuple:
    """What a kernel's compile depends on: op, attributes, input dtypes and static dims."""
    ins = tuple(None if v is None else (v.dtype, tuple(d if isinstance(d, int) else "?" for d in v.shape or ()))
                for v in n.inputs)
    return n.op, tuple(sorted((k, repr(v)) for k, v in n.attrs.items())), ins


class _Capture(CheckedRun):
    """Runs a GraphModule, keeping the values of `wanted` nodes only (the rest is freed as usual), every
    gather's indices checked first (CheckedRun): the graph runs at sizes the model may not take."""

    def __init__(self, gm: fx.GraphModule, wanted: set[fx.Node]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.wanted = wanted
        self.got: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.wanted:
            self.got[n] = out
        return out


def capture_values(gm: fx.GraphModule, nodes: list[Node], flat_inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    """The values the fused nodes and their replaced nodes read, as the original graph computes them."""
    wanted: set[fx.Node] = set()
    for n in nodes:
        inner = {r.origin for r in n.replaced} | {v.origin for r in n.replaced for v in r.outputs}
        wanted |= {v.origin for v in n.inputs if v is not None and isinstance(v.origin, fx.Node)}
        wanted |= {a for r in n.replaced if isinstance(r.origin, fx.Node) for a in r.origin.all_input_nodes
                   if a not in inner}
    interp = _Capture(gm, wanted)
    interp.run(*flat_inputs)
    return interp.got


def replaced_module(graph: Graph, n: Node, env: Mapping[fx.Node, Any]) -> tuple[fx.GraphModule, list[Any]]:
    """The fx nodes fused node `n` of `graph` replaced, copied into a GraphModule returning `n`'s outputs, each
    reading what its IR node reads (an input a pass left out as None: `slot_values`); and its arguments (the
    captured values of the outer nodes they read). Raises ValueError if a node has no fx origin."""
    gm: fx.GraphModule = graph.meta["fx_module"]
    g = fx.Graph()
    new: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    args: list[Any] = []

    def arg(a: fx.Node) -> fx.Node:
        if a not in new:
            if a.op == "get_attr":
                root[a.target] = operator.attrgetter(a.target)(gm)
                new[a] = g.get_attr(a.target)
            else:
                new[a] = g.placeholder(a.name)
                args.append(env[a])
        return new[a]

    for r in n.replaced:
        if not isinstance(r.origin, fx.Node):
            raise ValueError(f"{n.name}: replaced node {r.name} has no fx origin")
        gone = {f for f, v in slot_values(r, graph.meta["fx_slots"]).items() if v is None}
        new[r.origin] = g.node_copy(r.origin, lambda a, gone=gone: None if a in gone else arg(a))
        for v in r.outputs:  # multi-output nodes: each output is an operator.getitem of the original
            if isinstance(v.origin, fx.Node) and v.origin is not r.origin:
                new[v.origin] = g.node_copy(v.origin, arg)
    outs = [new.get(v.origin) if isinstance(v.origin, fx.Node) else None for v in n.outputs]
    if any(o is None for o in outs):
        raise ValueError(f"{n.name}: an output has no fx origin among the replaced nodes")
    g.output(tuple(outs))
    return fx.GraphModule(root, g), args
