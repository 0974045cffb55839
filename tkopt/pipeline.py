"""The one optimization pipeline: passes -> kernels -> select -> seal -> emit -> whole graph.

Every entry point (tkopt.compile, torch.compile(backend="tkopt"), optimize_onnx and the CLI, bench_onnx,
bench_module) imports its model into the IR and calls `optimize` with a target (tkopt.targets), which
answers every device question. Here, and only here, fused nodes are put back unfused and the graph is
sealed; here the report is made.

1. passes (tkopt.passes): canonicalize, recognize, fuse. Every fused node is a candidate.
2. kernels: the target builds each candidate's kernel (not those the decision cache already declines, on this
   machine or in the declines shipped with tkopt); a node whose kernel fails runs unfused, with a warning.
3. select: "all" keeps every candidate with a kernel. "measured" times each against what it replaces on the
   target, at its real shapes (for dynamic dims, also at a larger size the target picks), and keeps it only
   if it is at least MARGIN faster at every size measured; decisions are cached on
   disk (tkopt.decisions), the time spent is bounded (TKOPT_SELECT_SECONDS) and shown (tkopt.progress).
   Measuring tuned the kept nodes' kernels at their real shapes, at each size; the target checks the kernels
   they run there as it probed the candidates (`Target.check_kept`), and a node whose kernel fails there runs
   unfused, with a warning.
4. seal: drop what only the unfused fallbacks read.
5. emit: the target's artifact (an fx.GraphModule; an ONNX model and its op library).
6. whole graph ("measured"): the artifact against the plain alternatives the user already has (eager;
   for the torch.compile backend, inductor's compile of Dynamo's graph; the original model in ORT), at the
   example inputs. Nodes
   interact (layouts, the optimizations a fused node blocks), so a set of winning nodes can still lose as
   a whole: the faster one is returned, so tkopt is never slower than what it replaces, by construction.
   With no fusion kept, only the alternatives are compared (and with one, none is timed), unless the
   target's program adds something of its own (`Target.races_unfused`: CUDA graphs and inductor on
   torch-cuda); there, with fusions kept, the same program with every fusion put back ("tkopt unfused")
   is raced too, and runs if it wins. That program and the alternatives need no kernel: they are readied
   (compiled, captured) while the kernels build (`Target.prepare_whole`; on torch-cuda inductor compiles the
   unfused program, and the fused program as it will be if selection keeps every node built, in child
   processes), and with no fusion kept the unfused program is the one returned.
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tkopt import progress
from tkopt.decisions import DecisionCache
from tkopt.ir import Graph, Node
from tkopt.measure import Timing
from tkopt.passes.base import unfuse
from tkopt.passes.finalize import seal
from tkopt.passes.pipeline import run_passes
from tkopt.report import NodeDecision, Report, WholeGraph, remember
from tkopt.targets import Measured, Target

# A fused node is kept only if what it replaces takes at least 10% longer. Per-node timings on a busy
# machine vary by a few percent, and a node timed alone misses what it costs the graph around it (a
# layout copy, an ORT or inductor fusion it blocks); a smaller win is not worth that risk.
MARGIN = 1.10
# A fused program stays tkopt's only if it is at least 2% faster than the best plain alternative: whole-
# model times are steadier than a node's, and on a tie the user's own model is the safer answer. A tie
# between tkopt's unfused program and an alternative goes the other way (see _whole).
WHOLE_MARGIN = 1.02
# A call whose CPU time comes near its GPU time runs at the CPU's pace, and a user's loop gives the CPU less
# than a race does (Dynamo's guards, the loop's own Python, other load on the machine), while a CUDA-graph
# program's pace is the GPU's. So in the whole-graph decision a variant's time is the slower of its timed call
# and this much of its CPU time: an encoder layer's Dynamo graph, run eagerly, raced at 0.231 ms, beat tkopt's
# CUDA-graph program (0.242) and then ran at 0.25-0.60 ms in a benchmark loop (the encoder's eager module and
# torch.compile read 2x slower in some rounds of the same run than in others). It counts only for a variant
# whose CPU time is over 80% of its call: the CPU time includes any wait for the GPU inside a call (a model
# that synchronizes early to check its mask), which HF decoders' eager calls show as about half (Llama-style,
# 9.7 of 18.6 ms).
HOST_HEADROOM = 1.25
SELECT_SECONDS = 600.0  # default bound on measuring one graph's candidates (TKOPT_SELECT_SECONDS)
SELECT_MODES = ("measured", "all")
UNFUSED = "tkopt unfused"  # tkopt's program with every fusion put back, where the target races it


@dataclass
class Optimized:
    """The pipeline's result: the (sealed) graph, what the target emitted for it, the report, and what to
    run: `artifact` is `emitted`, or the plain alternative that beat it (`winner` names which)."""

    graph: Graph
    emitted: Any
    artifact: Any
    report: Report
    winner: str = "tkopt"


def resolve_select(select: str | None, target: Target) -> str:
    """"measured" wherever the target can measure, else "all"; an explicit "measured" it cannot is an error."""
    if select is not None and select not in SELECT_MODES:
        raise ValueError(f"select must be one of {', '.join(SELECT_MODES)}, got {select!r}")
    why = target.measurable()
    if select == "measured" and why is not None:
        raise ValueError(f"select='measured' needs a device to measure on ({target.name}): {why}")
    return select or ("all" if why is not None else "measured")


def select_seconds() -> float:
    value = os.environ.get("TKOPT_SELECT_SECONDS")
    try:
        return float(value) if value else SELECT_SECONDS
    except ValueError:
        raise ValueError(f"TKOPT_SELECT_SECONDS must be a number of seconds, got {value!r}") from None


def optimize(graph: Graph, target: Target, *, select: str | None = None, disable: Iterable[str] = (),
             source: str | None = None) -> Optimized:
    """Optimize `graph` (in place) for `target`; see the module docstring for the stages."""
    select = resolve_select(select, target)
    laps: dict[str, float] = {}
    t = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal t
        now = time.perf_counter()
        laps[stage] = now - t
        t = now

    ops_before = graph.count_ops()
    with progress.step("passes (canonicalize, recognize, fuse)"):
        passes = run_passes(graph, disable)
    lap("passes")
    candidates = [n for n in graph.nodes if n.is_fused]
    decisions = {n.name: NodeDecision(n.name, n.op, passes.fused_by.get(n.name, "?"), len(n.replaced))
                 for n in candidates}
    cache = DecisionCache(target.name, target.fingerprint()) if select == "measured" else None
    keys = {n.name: target.node_key(graph, n) for n in candidates} if cache is not None else {}
    known = {name: entry for name, key in keys.items() if (entry := cache.get(key)) is not None}
    # A node the cache already declines is unfused whatever its kernel does: building the kernel only costs.
    declined = {name for name, entry in known.items() if not entry["kept"]}
    build = [n for n in candidates if n.name not in declined]
    racing = cache is not None and bool(target.alternatives())
    # Where the target's program adds something of its own, that program with no fusion is raced too: nodes
    # that each won alone can still lose together (and on CUDA it stands in for torch.compile, with CUDA graphs).
    # It and the alternatives need no kernel, so they are readied (compiled, captured) while kernels build,
    # where selection will measure: with every node's decision cached, so is the whole graph's, most likely
    # (one compile stores both), and kept nodes' kernels then load while nothing needs readying.
    unfused = unfused_view(graph) if racing and candidates and target.races_unfused() else None
    unfused_program = None if unfused is None else target.emit(unfused)
    failed: dict[str, str] = {}
    if build:
        measuring = len(known) < len(candidates)
        ready = unfused_program is not None and measuring
        # The fused program as it will be if selection keeps every node built (the usual outcome where the
        # declines are cached or shipped): the target may start compiling it too (a child process), which the
        # program emitted after selection then uses wherever it is that very program. Emitted only where the
        # target asks for it, while the kernels build.
        def likely() -> list[Any]:
            return [target.emit(sealed_view(graph, [n for n in candidates if n.name in declined]))]

        meanwhile = (lambda: target.prepare_whole([unfused_program], likely)) if ready else None
        with progress.step(f"building kernels for {len(build)} fused nodes on {target.where}"):
            failed = target.probe(graph, build, meanwhile)
    _kernels_failed(candidates, failed, decisions, target)
    lap("kernels")
    if cache is not None:
        _select(graph, target, [n for n in candidates if n.name not in failed], decisions, cache, keys)
        kept = [n for n in candidates if decisions[n.name].decision == "kept"]
        _kernels_failed(kept, target.check_kept(graph, kept), decisions, target)
        lap("selection")
    kept = [n for n in candidates if decisions[n.name].decision == "kept"]
    unfuse(graph, [n for n in candidates if decisions[n.name].decision != "kept"])
    as_unfused = unfused is not None and not kept  # the program is the unfused one, already emitted (and readied)
    if as_unfused:  # its nodes, not `graph` unfused now: sealing dropped what only the fallbacks read
        graph.nodes = unfused.nodes
    seal(graph)
    artifact = emitted = unfused_program if as_unfused else target.emit(graph)
    lap("emit")
    whole, winner = None, "tkopt"
    if racing:
        programs = {"tkopt": artifact} if kept or target.races_unfused() else {}
        if unfused_program is not None and kept:
            programs[UNFUSED] = unfused_program
        with progress.step("timing the whole graph against the plain alternatives"):
            whole = _whole(graph, target, programs, cache)
        winner = whole.winner
        if winner != "tkopt":
            for d in decisions.values():
                if d.decision == "kept":
                    _decide(d, "declined", f"the whole graph ran faster as {winner}")
        if winner == UNFUSED:  # tkopt's own program still runs, with every fusion put back
            graph.nodes = unfused.nodes  # as above
            artifact = emitted = programs[UNFUSED]
            winner = "tkopt"
        elif winner != "tkopt":
            artifact = target.alternative(winner)
        lap("whole graph")
    plain = winner != "tkopt"
    for n in candidates:
        if decisions[n.name].decision == "kept":
            decisions[n.name].runs_as = target.runs_as(n) or ""
    laps.update(target.stage_seconds())
    report = Report(
        source=source or graph.meta.get("source") or graph.name, target=target.name, select=select, passes=passes,
        ops_before=ops_before, ops_after=ops_before if plain else graph.count_ops(),
        nodes_after=passes.nodes_before if plain else len(graph.nodes), nodes=list(decisions.values()),
        whole_graph=whole, seconds=laps,
    )
    remember(report)
    return Optimized(graph, emitted, artifact, report, winner)


def _kernels_failed(nodes: list[Node], failed: dict[str, str], decisions: dict[str, NodeDecision],
                    target: Target) -> None:
    """Decide the `nodes` named in `failed` (node name -> why its kernel failed) unfused, with a warning."""
    for n in nodes:
        if n.name in failed:
            _decide(decisions[n.name], "kernel_failed", failed[n.name])
            warnings.warn(f"tkopt: {n.name} ({n.op}) runs unfused on {target.where}: its kernel failed: "
                          f"{failed[n.name]}", stacklevel=3)


def _decide(d: NodeDecision, decision: str, reason: str = "") -> None:
    d.decision, d.reason = decision, reason


def _wins(fused: Timing, unfused: Timing) -> bool:
    return unfused.min_ms >= MARGIN * fused.min_ms


def _entry(m: Measured) -> dict[str, Any]:
    sizes = [{"label": label, "fused_ms": f.min_ms, "unfused_ms": u.min_ms}
             for label, (f, u) in zip(m.labels, m.sizes, strict=True)]
    kept = m.error is None and bool(m.sizes) and all(_wins(f, u) for f, u in m.sizes)
    return {"kept": kept, "sizes": sizes, "error": m.error, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _apply(d: NodeDecision, entry: dict[str, Any], cached: bool) -> None:
    d.cached = cached
    if entry["error"] is not None:
        _decide(d, "kernel_failed", f"its kernel failed on the real inputs: {entry['error']}")
        return
    if not entry["sizes"]:
        _decide(d, "declined", "not measured: the model ran at none of the representative sizes")
        return
    last = entry["sizes"][-1]
    d.fused_ms, d.unfused_ms = last["fused_ms"], last["unfused_ms"]
    if entry["kept"]:
        _decide(d, "kept")
    elif "shipped" in entry:
        _decide(d, "slower", f"under {MARGIN:.2f}x at {last['label']}, as measured on {entry['shipped']} (a shipped "
                "decision: TKOPT_SHIPPED_DECISIONS=0 measures it here)")
    else:
        _decide(d, "slower", f"under {MARGIN:.2f}x at {last['label']}")


def _select(graph: Graph, target: Target, alive: list[Node], decisions: dict[str, NodeDecision],
            cache: DecisionCache, keys: dict[str, Any]) -> None:
    """Decide every candidate from the cache or by measuring one node per distinct key (`keys`: each node's
    target.node_key), in a time budget."""
    groups: dict[str, list[Node]] = {}
    for n in alive:
        entry = cache.get(keys[n.name])
        if entry is not None:
            _apply(decisions[n.name], entry, cached=True)
        else:
            groups.setdefault(repr(keys[n.name]), []).append(n)
    if not groups:
        return
    budget = select_seconds()
    deadline = time.perf_counter() + budget
    reps = [group[0] for group in groups.values()]
    with progress.step(f"timing fusions on {target.where}", total=len(reps)) as advance:
        measured = target.measure(graph, reps, _wins)
        try:
            for m in measured:
                entry = _entry(m)
                if m.error is None:
                    cache.put(keys[m.node.name], entry)
                for n in groups.pop(repr(keys[m.node.name])):
                    _apply(decisions[n.name], entry, cached=False)
                advance()
                if time.perf_counter() > deadline:
                    break
        finally:
            close = getattr(measured, "close", None)
            if close is not None:
                close()
    for group in groups.values():
        for n in group:
            _decide(decisions[n.name], "declined", f"not measured: selection ran past its {budget:.0f} s budget "
                    "(TKOPT_SELECT_SECONDS)")


def unfused_view(graph: Graph) -> Graph:
    """`graph` with every fused node as the nodes it replaced, sealed (`sealed_view`)."""
    return sealed_view(graph, [n for n in graph.nodes if n.is_fused])


def sealed_view(graph: Graph, unfused: list[Node]) -> Graph:
    """`graph` with the fused nodes `unfused` as the nodes they replaced, sealed; `graph` itself is left as it is
    (the copy shares its nodes and values, which sealing and unfusing never change, only node lists)."""
    view = copy.copy(graph)
    view.nodes = list(graph.nodes)
    unfuse(view, unfused)
    seal(view)
    return view


def loop_times(times_ms: dict[str, float], host_ms: dict[str, float]) -> dict[str, float]:
    """What the whole-graph decision compares: each variant's median call, or HOST_HEADROOM times its CPU time
    per call where that is more (see HOST_HEADROOM)."""
    return {k: max(ms, HOST_HEADROOM * host_ms.get(k, 0.0)) for k, ms in times_ms.items()}


def _whole(graph: Graph, target: Target, programs: dict[str, Any], cache: DecisionCache) -> WholeGraph:
    """tkopt's programs ("tkopt", and UNFUSED where raced) against the target's plain alternatives (cached like
    node decisions). No program (no fusion kept, and the target's program adds nothing of its own): tkopt's
    graph is the user's model re-exported, so it is not timed; the best alternative runs (the only one without
    timing anything, as on the CPU, where it is the module itself). The fused program must beat the unfused
    one, and then the best alternative, by WHOLE_MARGIN. A program with no fusion (the target races one only
    where it adds something of its own: on CUDA, inductor's code under CUDA graphs) need only come within
    WHOLE_MARGIN of the best alternative: its fusions are no risk, and a race flatters what runs uncaptured,
    whose host time hides behind the work its lead calls queued (GPT-2 8x1024 on the H200: inductor raced
    at 4.74 ms against 4.74 for tkopt's unfused program, ran at 5.02 ms in a loop, and that program at 4.62).
    Each variant's time is the slower of its median call and HOST_HEADROOM times its CPU time per call."""
    names = target.alternatives()
    if not programs and len(names) == 1:
        return WholeGraph(names[0], {}, note="no fusion kept, so the model runs as it was")
    key = [target.whole_key(graph, programs), WHOLE_MARGIN, HOST_HEADROOM]
    entry = cache.get(key)
    if entry is not None:
        return WholeGraph(entry["winner"], entry["times_ms"], entry["host_ms"], cached=True)
    try:
        # Medians: the whole graph is timed as the user runs it, variants in rotating turns (measure.race), and
        # the median is what their loop gets; a node's decision compares fastest calls instead (`_wins`).
        timed = target.compare_whole(graph, programs)
    except Exception as e:  # noqa: BLE001 - an alternative that fails is no alternative: keep tkopt's
        return WholeGraph("tkopt", {}, note=f"not compared: {type(e).__name__}: {e}")
    times = {k: t.median_ms for k, t in timed.items()}
    hosts = {k: t.host_ms for k, t in timed.items() if not math.isnan(t.host_ms)}
    loop = loop_times(times, hosts)
    best = min((k for k in loop if k not in programs), key=loop.__getitem__)
    ours = "tkopt"
    if UNFUSED in loop and loop[UNFUSED] < loop["tkopt"] * WHOLE_MARGIN:
        ours = UNFUSED
    fused = ours == "tkopt" and any(n.is_fused for n in graph.nodes)
    wins = ours in loop and (loop[ours] * WHOLE_MARGIN <= loop[best] if fused
                             else loop[ours] <= loop[best] * WHOLE_MARGIN)
    winner = ours if wins else best
    cache.put(key, {"winner": winner, "times_ms": times, "host_ms": hosts,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return WholeGraph(winner, times, hosts)
