"""ONNX Runtime targets: fused nodes run as domain "tkopt" nodes on the native op library (tkopt.ort).

"ort-cpu" (and "ort-sm80"/"ort-sm90" where onnxruntime has its CUDA provider): a fused node is timed
as a one-node model on the op library against a model of the nodes it replaced, which ORT runs with
its own kernels and graph optimizations (MLAS on CPU), both fed the values the original model computes
at a few representative sizes of its dynamic dims. The final model is timed against the original in
plain ORT. "onnx" (no target): fused nodes stay as references for the hybrid runner; nothing to measure.

On "ort-cpu" a fused node that ONNX Runtime's own ops compute with the same arithmetic (FusedOp.ort_ops: an
add + RMSNorm as com.microsoft's SkipSimplifiedLayerNormalization) runs as those ops instead of the library's
kernel: ORT's CPU kernels run on its thread pool, TileLang's C backend emits serial scalar loops. It is
measured, kept or declined like any fused node; what tkopt adds is the proof that the subgraph is that op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tkopt.backends.onnx_model import export_onnx
from tkopt.fused_ops import Unservable, schema
from tkopt.ir import FUSED_DOMAIN, Graph, Node, Value
from tkopt.measure import Timer, Timing, compare, race
from tkopt.ort import run
from tkopt.ort.library import KernelLibrary

from . import Measured, Target, Wins, cpu_model, replaced_signature

# (batch, other dynamic dims) a model's symbolic dims are measured at: a latency and a throughput shape.
# A size the model cannot run (e.g. beyond its position embeddings) is skipped.
REPRESENTATIVE_SIZES = ((1, 128), (8, 128))
_PROBE_SIZES = ((2, 8), (3, 13))  # two small runs that tell static dims from dynamic ones


@dataclass
class OnnxArtifact:
    """An ONNX model and, when it has fused nodes for a target, the op library they run on."""

    model: onnx.ModelProto
    library: Path | None = None


def outer_inputs(nodes: Sequence[Node]) -> list[Value]:
    """Non-constant values the nodes read but do not produce, in first-read order."""
    produced = {id(v) for n in nodes for v in n.outputs}
    seen: set[int] = set()
    out = []
    for n in nodes:
        for v in n.inputs:
            if v is not None and v.const is None and id(v) not in produced and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def nodes_model(graph: Graph, nodes: Sequence[Node], outputs: Sequence[Value], name: str,
                lowered: Mapping[str, list[onnx.NodeProto]] | None = None) -> onnx.ModelProto:
    """An ONNX model of `nodes` alone: their outer non-constant inputs as graph inputs, constants as
    initializers, `outputs` as graph outputs (written by the ONNX backend from a sub-Graph; `lowered`: fused
    nodes that run as ORT's own ops, OrtTarget.lowered)."""
    sub = Graph(name)
    sub.nodes = list(nodes)
    sub.inputs = outer_inputs(nodes)
    sub.outputs = list(outputs)
    sub.meta = {k: graph.meta[k] for k in ("onnx_model", "onnx_initializers", "onnx_import_consts") if k in graph.meta}
    return export_onnx(sub, lowered)


class OrtTarget(Target):
    """An ORT target for `arch` ("cpu", "sm80", "sm90"), or None for "onnx" (see the module docstring).

    Libraries are written into `workdir`; the caller keeps the final one."""

    def __init__(self, arch: str | None, original: onnx.ModelProto, workdir: Path,
                 sizes: Sequence[tuple[int, int]] = REPRESENTATIVE_SIZES) -> None:
        self.arch = arch
        self.name = "onnx" if arch is None else f"ort-{arch}"
        self.original = original
        self.workdir = Path(workdir)
        self.sizes = tuple(sizes)
        self.library = KernelLibrary(arch) if arch is not None else None
        self.small: list[dict[str, np.ndarray]] | None = None  # fused nodes' inputs at _PROBE_SIZES
        self.runnable: list[tuple[str, dict[str, np.ndarray]]] | None = None  # (label, feeds) per size
        # ORT returns host arrays, so perf_counter times its calls; on the CPU with its workers awake, as in a model
        self.node_timer = Timer("cpu", runs=20, warmup=1, max_seconds=1.0, burst=8 if arch == "cpu" else 1)

    @property
    def where(self) -> str:
        return f"ORT {self.arch}"

    def measurable(self) -> str | None:
        if self.arch is None:
            return "without a target the fused nodes run their torch references: there is nothing to measure"
        if self.arch == "cpu":
            return None
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return f"this onnxruntime has no CUDAExecutionProvider to run the {self.arch} op library on"
        return None

    def fingerprint(self) -> dict[str, Any]:
        import os

        import onnxruntime as ort

        return {"device": f"{cpu_model()} x{os.cpu_count()}", "onnxruntime": ort.__version__,
                "providers": run.providers(self.arch), "sizes": self.sizes,
                "timing": "node bursts with workers awake; whole models raced without spinning"}

    # ---- kernels ----------------------------------------------------------------------------------
    def probe(self, graph: Graph, nodes: list[Node], meanwhile: Callable[[], None] | None = None) -> dict[str, str]:
        """Lower and compile each node's kernel (KernelLibrary.prepare); dims the export left unknown are
        measured first, since kernels need static dims at build time. `meanwhile` runs first: the library
        builds here, in this process."""
        if meanwhile is not None:
            meanwhile()
        if self.library is None:
            return {}
        small = self._small(graph)
        if len(small) == len(_PROBE_SIZES):  # else dims stay unknown: a kernel that needs one says so
            fill_static_dims(graph, small)
        lowered = self.lowered(nodes)
        failed = self.library.prepare([n for n in nodes if n.name not in lowered])
        for n in nodes:
            if n.name in lowered:  # ORT's own ops: one run at a probe size checks that ORT takes them so
                try:
                    model = nodes_model(graph, [n], n.outputs, n.name, lowered)
                    for values in small[:1]:
                        _Run(model, None, run.providers(self.arch)).on(values)()
                except Exception as e:  # noqa: BLE001 - ORT refusing its own op: the node runs unfused
                    failed[n.name] = f"ONNX Runtime's {lowered[n.name][-1].op_type} failed: {type(e).__name__}: {e}"
        return failed

    def lowered(self, nodes: Sequence[Node]) -> dict[str, list[onnx.NodeProto]]:
        """Those of `nodes` (fused) that run as ONNX Runtime's own ops here, by name: their ops
        (FusedOp.ort_ops, the CPU only; the module docstring says why)."""
        out: dict[str, list[onnx.NodeProto]] = {}
        for n in nodes if self.arch == "cpu" else ():
            lower = schema(n.op).ort_ops
            try:
                if lower is not None:
                    out[n.name] = lower(n, self.arch)
            except Unservable:
                continue
        return out

    def runs_as(self, node: Node) -> str | None:
        ops = self.lowered([node]).get(node.name)
        return None if ops is None else f"ONNX Runtime's {ops[-1].op_type}"

    def _small(self, graph: Graph) -> list[dict[str, np.ndarray]]:
        """The fused nodes' inputs as the original model computes them at two small sizes (cheap runs): what
        tells static dims from dynamic ones, and identifies a node's shapes in its decision key."""
        if self.small is None:
            names = [v.name for n in graph.nodes if n.is_fused for v in outer_inputs([n])]
            self.small = []
            for s in _PROBE_SIZES:
                try:
                    self.small.append(run.capture(self.original, names, run.make_inputs(self.original, sizes=s)))
                except Exception:  # noqa: BLE001 - a model that runs at fixed sizes only: no probe there
                    continue
        return self.small

    # ---- measurement ------------------------------------------------------------------------------
    def _sized(self, names: list[str]) -> list[tuple[str, dict[str, np.ndarray]]]:
        """Per representative size: a label, and the feeds with the named values as the original model
        computes them. A size the model cannot run (positions beyond its embeddings, a fixed mask) is
        halved along the sequence until it runs; the sizes that ran are kept for later calls."""
        providers = run.providers(self.arch)
        if self.runnable is not None:
            return [(label, run.capture(self.original, names, feeds, providers)) for label, feeds in self.runnable]
        self.runnable, out, seen = [], [], set()
        for batch, seq in self.sizes:
            while seq >= _PROBE_SIZES[0][1]:
                feeds = run.make_inputs(self.original, sizes=(batch, seq))
                shapes = tuple((k, a.shape) for k, a in feeds.items())
                if shapes in seen:  # static inputs: every size is the same
                    break
                try:
                    values = run.capture(self.original, [*names, self.original.graph.output[0].name], feeds,
                                         providers)
                except Exception:  # noqa: BLE001 - too big for this model: try a shorter sequence
                    seq //= 2
                    continue
                seen.add(shapes)
                label = f"batch {batch}, seq {seq}"
                self.runnable.append((label, feeds))
                out.append((label, values))
                break
        return out

    def node_key(self, graph: Graph, node: Node) -> Any:
        """Input shapes at the two small probe sizes stand for the shapes at the representative sizes (in
        the fingerprint): they fix the static dims and how the dynamic ones grow, without a big run."""
        shapes = []
        for v in node.inputs:
            if v is None:
                shapes.append(None)
            elif v.const is not None:
                shapes.append([v.dtype, list(np.shape(v.const))])
            else:
                shapes.append([v.dtype, [list(vals[v.name].shape) if v.name in vals else v.shape
                                         for vals in self._small(graph)]])
        how = "ort ops" if self.lowered([node]) else "library"
        return [node.op, schema(node.op).full_attrs(node.attrs), replaced_signature(node), shapes, how]

    def measure(self, graph: Graph, nodes: list[Node], wins: Wins) -> Iterator[Measured]:
        sized = self._sized([v.name for n in nodes for v in (*outer_inputs([n]), *outer_inputs(n.replaced))])
        assert self.library is not None
        lowered = self.lowered(nodes)
        kernels = [n for n in nodes if n.name not in lowered]
        library = self.library.link(kernels, self.workdir / "candidates.so") if kernels else None
        providers = run.providers(self.arch)
        for n in nodes:
            m = Measured(n)
            try:
                on = None if n.name in lowered else library
                fused = _Run(nodes_model(graph, [n], n.outputs, n.name, lowered), on, providers)
                unfused = _Run(nodes_model(graph, n.replaced, n.outputs, f"{n.name}_unfused"), None, providers)
                for label, values in sized:
                    pair = compare(fused.on(values), unfused.on(values), self.node_timer)
                    m.sizes.append(pair)
                    m.labels.append(label)
                    if not wins(*pair):
                        break
            except Exception as e:  # noqa: BLE001 - a node whose kernel fails at real shapes is not kept
                m.error = f"{type(e).__name__}: {e}"
            yield m

    # ---- emit and the whole graph -----------------------------------------------------------------
    def emit(self, graph: Graph) -> OnnxArtifact:
        fused = [n for n in graph.nodes if n.is_fused]
        lowered = self.lowered(fused)
        kernels = [n for n in fused if n.name not in lowered]
        library = None
        if kernels and self.library is not None:
            library = self.library.link(kernels, self.workdir / "ops.so")
        return OnnxArtifact(export_onnx(graph, lowered), library)

    def alternatives(self) -> list[str]:
        return ["ort"]

    def alternative(self, name: str) -> OnnxArtifact:
        return OnnxArtifact(self.original)

    def _whole_feeds(self) -> dict[str, np.ndarray]:
        """The original model's inputs at the first representative size it runs at."""
        self._sized([])
        if not self.runnable:
            raise ValueError("the model ran at none of the representative sizes")
        return self.runnable[0][1]

    def whole_key(self, graph: Graph, programs: dict[str, OnnxArtifact]) -> Any:
        from tkopt.cache import digest

        def model_key(artifact: OnnxArtifact) -> str:
            g = artifact.model.graph
            nodes = [[n.op_type, n.domain, list(n.input), list(n.output),
                      [str(a) for a in n.attribute  # a fused op's float attributes are 0-d tensors
                       if a.type != onnx.AttributeProto.TENSOR or n.domain == FUSED_DOMAIN]] for n in g.node]
            inits = [[t.name, t.data_type, list(t.dims)] for t in g.initializer]
            return digest(nodes, inits)

        return ["whole", {name: model_key(a) for name, a in sorted(programs.items())}]

    def compare_whole(self, graph: Graph, programs: dict[str, OnnxArtifact]) -> dict[str, Timing]:
        """The optimized model on its library against the original in plain ORT, at the first size."""
        feeds = self._whole_feeds()
        providers = run.providers(self.arch)
        calls = {}
        for name, art in (*programs.items(), ("ort", self.alternative("ort"))):
            sess = run.session(art.model, art.library, providers, spinning=False)  # raced in turns: run.session
            calls[name] = run.Bound(sess, feeds, [o.name for o in art.model.graph.output], providers)
        return race(calls)  # ORT returns host arrays: each call is synchronous, perf_counter times it


class _Run:
    """A session of a small model, called on the model's inputs picked from a dict of captured values."""

    def __init__(self, model: onnx.ModelProto, library: Path | None, providers: list[str]) -> None:
        self.session = run.session(model, library, providers)
        self.providers = providers
        self.inputs = [i.name for i in model.graph.input]
        self.outputs = [o.name for o in model.graph.output]

    def on(self, values: dict[str, np.ndarray]) -> Callable[[], Any]:
        return run.Bound(self.session, {k: values[k] for k in self.inputs}, self.outputs, self.providers)


def fill_static_dims(graph: Graph, runs: Sequence[dict[str, np.ndarray]]) -> int:
    """Fill in the dims of fused nodes' inputs that shape inference left unknown, from two runs.

    Exports with dynamic axes often lose static sizes after computed Reshapes (a head dim of
    `(batch, seq, 4, ?)`), and a kernel needs them at build time. `runs` holds the values the original
    model computes at two batch/sequence sizes; a dim equal in both runs is static and filled in; one
    that differs is dynamic and stays unknown. The generated C++ checks every static dim again at run
    time. Returns how many dims were filled.
    """
    values = {id(v): v for n in graph.nodes if n.is_fused for v in n.inputs
              if v is not None and v.const is None and v.shape is not None and None in v.shape}
    filled = 0
    for v in values.values():
        if v.name not in runs[0] or v.name not in runs[1]:
            continue
        a, b = runs[0][v.name].shape, runs[1][v.name].shape
        if len(a) != len(v.shape) or len(b) != len(v.shape):
            continue
        dims = list(v.shape)
        for i, d in enumerate(dims):
            if d is None and a[i] == b[i]:
                dims[i] = int(a[i])
                filled += 1
        v.shape = tuple(dims)
    return filled
