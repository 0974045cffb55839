"""`bench_module`: a torch module eager vs tkopt.compile (vs torch.compile/inductor as an anchor).

On CUDA every timed call is bracketed by CUDA events on the current stream and the device is
synchronized before reading them (launch-only timings would flatter asynchronous kernels); on
CPU time.perf_counter. Inductor runs only on CUDA by default (its CPU compile is slow and not the
comparison that matters). Per fused node: the custom op vs the exact fx nodes it replaced, on the
node's real inputs (tkopt.bench_nodes.torch_node_rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from tkopt.bench import BenchResult, Timing, time_calls
from tkopt.report import DEFAULT_TOLERANCE, TOLERANCES, OutputError


def tensor_errors(name: str, got: Any, want: Any) -> OutputError:
    """max abs / max rel (relative to max |want|) of `got` against `want`, in float64, NaN-aware."""
    if not isinstance(want, torch.Tensor):
        same = got == want
        return OutputError(name, type(want).__name__, [], 0.0 if same else float("inf"),
                           0.0 if same else float("inf"), 0.0)
    dtype = str(want.dtype).removeprefix("torch.")
    tol = TOLERANCES.get(dtype, DEFAULT_TOLERANCE)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return OutputError(name, dtype, list(want.shape), float("inf"), float("inf"), tol)
    g = got.detach().to("cpu", torch.float64).numpy()
    w = want.detach().to("cpu", torch.float64).numpy()
    diff = np.where(np.isnan(g) & np.isnan(w), 0.0, np.abs(g - w))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_abs = float(diff.max()) if diff.size else 0.0
    finite = np.abs(w[~np.isnan(w)])
    scale = float(finite.max()) if finite.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return OutputError(name, dtype, list(want.shape), max_abs, max_rel, tol)


def make_timer(device: torch.device, runs: int, warmup: int) -> Callable[[Callable[[], Any]], Timing]:
    """A timer for `device`: CUDA events per call (synchronized) on CUDA, perf_counter elsewhere."""
    if device.type != "cuda":
        return lambda fn: time_calls(fn, runs, warmup)

    def cuda_time(fn: Callable[[], Any]) -> Timing:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return Timing.of([s.elapsed_time(e) for s, e in events], warmup, "cuda_events")

    return cuda_time


def replayed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """`fn` as a CUDA-graph replay on CUDA (its GPU time without the Python launch cost), else `fn`.

    For per-node rows: both a fused op and the nodes it replaced are timed this way, so the ratio
    compares kernels, not dispatch paths. Falls back to `fn` if it cannot be captured."""
    from tkopt.cuda_graphs import capture

    if device.type != "cuda":
        return fn
    try:
        graph, _ = capture(fn, device)
    except Exception:  # noqa: BLE001 - uncapturable: time it as is
        return fn
    return graph.replay


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
) -> BenchResult:
    """Eager vs tkopt.compile (kernels on the inputs' device), per-output errors and latency.

    `inductor`: also time torch.compile(module) (default: on CUDA only). `nodes`: per fused node,
    the custom op vs the replaced fx nodes run as a tiny GraphModule, both on the node's captured
    inputs. Runs under torch.no_grad(); the module should be in eval mode.
    """
    from tkopt.bench_nodes import torch_node_rows
    from tkopt.frontends.fx import import_fx
    from tkopt.kernel_dispatch import first_device, prepare_kernels
    from tkopt.passes.pipeline import run_passes
    from tkopt.torch_compile import compile as tk_compile

    if runs < 1 or warmup < 0:
        raise ValueError(f"runs must be >= 1 and warmup >= 0 (got {runs}, {warmup})")
    inputs = tuple(example_inputs)
    device = first_device(inputs)
    timer = make_timer(device, runs, warmup)
    inductor = device.type == "cuda" if inductor is None else inductor
    notes: list[str] = []
    with torch.no_grad():
        want = _leaves(module(*inputs))
        compiled = tk_compile(module, inputs, disable=disable, inductor=False)  # tkopt's graph alone
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
                hybrid = tk_compile(module, inputs, disable=disable, inductor=True)
                worst = max((tensor_errors(k, g, w).max_rel
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
                worst = max((tensor_errors(k, g, w).max_rel for (k, g), (_, w) in zip(ind, want, strict=True)),
                            default=0.0)
                timings[key] = timer(lambda opt=opt: opt(*inputs))
                notes.append(f"{key} vs eager max rel error {worst:.3g}")
            except Exception as e:  # noqa: BLE001 - the anchor is optional; say why it is missing
                notes.append(f"torch.compile (mode={mode}) failed: {type(e).__name__}: {e}")
    report = compiled.tkopt_report
    for node, why in report.kernel_fallbacks:
        notes.append(f"{node} runs unfused on {device}: {why}")
    for node, why in report.declined:
        notes.append(f"{node} left unfused on {device}: {why}")
    rows = []
    if nodes:
        # The same pipeline tkopt.compile ran, kept at hand: the IR says which fx nodes each fused node replaced.
        graph = import_fx(torch.export.export(module, inputs))
        run_passes(graph, disable)
        prepare_kernels(graph, device)
        rows = torch_node_rows(graph, inputs, timer)
    for ours in ("tkopt", "tkopt_inductor"):
        for key in ("inductor", "inductor_cudagraphs"):
            if key in timings and ours in timings:
                ratio = timings[key].median_ms / timings[ours].median_ms
                notes.append(f"{ours} vs {key}: {ratio:.2f}x (> 1: tkopt faster)")
    return BenchResult(
        kind="torch", source=name or type(module).__name__, device=_device_name(device),
        fused_runner=f"tkopt.compile ({'torch references' if _reference_mode() else 'TileLang kernels'})",
        outputs=[tensor_errors(k, g, w) for (k, g), (_, w) in zip(got, want, strict=True)],
        timings=timings, baseline="eager", fused="tkopt", claims_speedup=not _reference_mode(), nodes=rows,
        inputs={f"arg{i}": list(x.shape) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)},
        fusions=dict(report.fusions), notes=notes,
    )


def _reference_mode() -> bool:
    from tkopt.kernel_dispatch import use_kernels

    return not use_kernels()
