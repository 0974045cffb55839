"""`bench_module`: a torch module eager vs tkopt.compile (vs torch.compile/inductor as an anchor).

On CUDA every timed call is bracketed by CUDA events on the current stream and the device is
synchronized before reading them (launch-only timings would flatter asynchronous kernels); on
CPU time.perf_counter (tkopt.measure.Timer). Inductor runs only on CUDA by default (its CPU compile
is slow and not the comparison that matters). Per fused node: the custom op vs the exact fx nodes it
replaced (copied into a tiny GraphModule), on the node's real inputs, captured with torch.fx.Interpreter;
on CUDA both sides as CUDA-graph replays, so the ratio compares kernels, not dispatch paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from tkopt.accuracy import output_error
from tkopt.bench import BenchResult, NodeBench
from tkopt.ir import Graph
from tkopt.measure import Timer, Timing, per_call


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _leaves(out: Any) -> list[tuple[str, Any]]:
    leaves, _ = pytree.tree_flatten_with_path(out)
    return [(pytree.keystr(path) or "output", v) for path, v in leaves]


def bench_module(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    runs: int = 50,
    warmup: int = 5,
    disable: Iterable[str] = (),
    inductor: bool | None = None,
    nodes: bool = True,
    name: str | None = None,
    select: str | None = None,
) -> BenchResult:
    """Eager vs tkopt.compile (kernels on the inputs' device), per-output errors and latency.

    `inductor`: also time torch.compile(module) (default: on CUDA only). `nodes`: per fused node,
    the custom op vs the replaced fx nodes run as a tiny GraphModule, both on the node's captured
    inputs. `select` as in tkopt.compile. Runs under torch.no_grad(); the module should be in eval mode.
    """
    from tkopt.fused_ops import use_kernels
    from tkopt.targets.torch_target import first_device
    from tkopt.torch_compile import compile as tk_compile

    if runs < 1 or warmup < 0:
        raise ValueError(f"runs must be >= 1 and warmup >= 0 (got {runs}, {warmup})")
    inputs = tuple(example_inputs)
    device = first_device(inputs)
    timer = Timer(device, runs, warmup)
    inductor = device.type == "cuda" if inductor is None else inductor
    notes: list[str] = []
    with torch.no_grad():
        want = _leaves(module(*inputs))
        compiled = tk_compile(module, inputs, disable=disable, inductor=False, select=select)  # tkopt's graph alone
        got = _leaves(compiled(*inputs))
        timings = {"eager": timer(lambda: module(*inputs)), "tkopt": timer(lambda: compiled(*inputs))}
        if compiled.uncaptured_reason is None:  # also time it without CUDA graphs: what the graphs buy
            compiled.cuda_graphs = False
            timings["tkopt_no_graphs"] = timer(lambda: compiled(*inputs))
            compiled.cuda_graphs = True
        elif device.type == "cuda":
            notes.append(f"tkopt ran without CUDA graphs: {compiled.uncaptured_reason}")
        if inductor:  # tkopt's kernels for the fused nodes, inductor for the rest
            try:
                hybrid = tk_compile(module, inputs, disable=disable, inductor=True, select=select)
                worst = max((output_error(k, g, w).max_rel
                             for (k, g), (_, w) in zip(_leaves(hybrid(*inputs)), want, strict=True)), default=0.0)
                notes.append(f"tkopt_inductor vs eager max rel error {worst:.3g}")
                timings["tkopt_inductor"] = timer(lambda: hybrid(*inputs))
            except Exception as e:  # noqa: BLE001 - optional variant; say why it is missing
                notes.append(f"tkopt.compile(inductor=True) failed: {type(e).__name__}: {e}")
        # Anchors: inductor's default mode, and with its CUDA graphs (what tkopt's graphs compare to).
        for key, mode in (("inductor", "default"), ("inductor_cudagraphs", "reduce-overhead")) if inductor else ():
            try:
                torch._dynamo.reset()
                opt = torch.compile(module, mode=mode)
                ind = _leaves(opt(*inputs))
                # Before timing: with CUDA graphs, later calls overwrite these outputs.
                worst = max((output_error(k, g, w).max_rel for (k, g), (_, w) in zip(ind, want, strict=True)),
                            default=0.0)
                timings[key] = timer(lambda opt=opt: opt(*inputs))
                notes.append(f"{key} vs eager max rel error {worst:.3g}")
            except Exception as e:  # noqa: BLE001 - the anchor is optional; say why it is missing
                notes.append(f"torch.compile (mode={mode}) failed: {type(e).__name__}: {e}")
    spec = compiled.specializations[-1]
    report = spec.report
    for d in report.nodes:
        if d.decision != "kept":
            notes.append(f"{d.node} left unfused on {device}: {d.decision.replace('_', ' ')}: {d.reason}")
    rows = torch_node_rows(spec.graph, inputs, timer) if nodes and spec.graphed else []
    for ours in ("tkopt", "tkopt_inductor"):
        for key in ("inductor", "inductor_cudagraphs"):
            if key in timings and ours in timings:
                ratio = timings[key].median_ms / timings[ours].median_ms
                notes.append(f"{ours} vs {key}: {ratio:.2f}x (> 1: tkopt faster)")
    return BenchResult(
        kind="torch", source=name or type(module).__name__, device=_device_name(device),
        fused_runner=f"tkopt.compile ({'TileLang kernels' if use_kernels() else 'torch references'})",
        outputs=[output_error(k, g, w) for (k, g), (_, w) in zip(got, want, strict=True)],
        timings=timings, baseline="eager", fused="tkopt", claims_speedup=use_kernels(), nodes=rows,
        inputs={f"arg{i}": list(x.shape) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)},
        fusions=report.fusions, notes=notes, optimization=report.to_dict(),
    )


def torch_node_rows(graph: Graph, example_inputs: Sequence[Any], timer: Callable[[Callable[[], Any]], Timing]
                    ) -> list[NodeBench]:
    """A NodeBench per fused node of `graph` (a specialization's IR, after the pipeline): its custom op
    against the fx nodes it replaced, on their inputs captured from the original graph."""
    from tkopt.backends.torch_ops import CUSTOM_OPS, attr_args
    from tkopt.fused_ops import schema
    from tkopt.object_trees import Boxer
    from tkopt.targets.torch_target import capture_values, first_device, input_tensor, replaced_module, replayed

    fused = [n for n in graph.nodes if n.is_fused]
    if not fused:
        return []
    gm = graph.meta["fx_module"]
    device = first_device(example_inputs)
    rows = []
    with torch.no_grad():
        flat = pytree.tree_leaves((Boxer().box((tuple(example_inputs), {})), {}))  # as tkopt.compile exported it
        values = capture_values(gm, fused, flat)
        for n in fused:
            row = NodeBench(n.name, n.op, len(n.replaced))
            rows.append(row)
            try:
                ins = [None if v is None else input_tensor(v, values, device) for v in n.inputs]
                tiny, tiny_args = replaced_module(graph, n, values)
            except ValueError as e:
                row.note = f"inputs not captured ({e}); not measured"
                continue
            op, attrs = CUSTOM_OPS[n.op], attr_args(n.op, n.attrs)
            ins = schema(n.op).padded(ins)
            got = _as_list(op(*ins, *attrs))[: len(n.outputs)]
            want = _as_list(tiny(*tiny_args))
            (fused_fn, unfused_fn), calls = replayed([lambda op=op, ins=ins, attrs=attrs: op(*ins, *attrs),
                                                      lambda tiny=tiny, a=tiny_args: tiny(*a)], device)
            row.fused, row.unfused = per_call((timer(fused_fn), timer(unfused_fn)), calls)
            row.outputs = [output_error(v.name, g, w) for v, g, w in zip(n.outputs, got, want, strict=True)]
    return rows


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, tuple | list) else [x]
