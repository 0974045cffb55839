"""Build the op library a fused ONNX model needs, for one target, and leave unfused what no kernel serves."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from tkopt.fused_ops import schema
from tkopt.ir import Graph, Node
from tkopt.passes.base import unfuse
from tkopt.passes.finalize import seal

from .bindings import Unservable, program_spec
from .native import KernelSource, NodeBinding, compile_library, lower_program

log = logging.getLogger("tkopt")
TARGETS = ("cpu", "sm80", "sm90")


@dataclass
class LibraryBuild:
    path: Path
    target: str
    kernels: int
    nodes: int
    unfused: list[tuple[str, str]] = field(default_factory=list)  # (node name, reason)
    seconds: float = 0.0


def check_target(target: str) -> None:
    """Refuse a target this machine cannot build for, before any work is done."""
    import shutil

    if target not in TARGETS:
        raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {target!r}")
    if target != "cpu" and shutil.which("nvcc") is None:
        raise ValueError(f"--target {target} needs nvcc (the CUDA toolkit) on PATH to build the op library")


def fill_static_dims(graph: Graph) -> int:
    """Measure the dims of fused nodes' inputs that shape inference left unknown.

    Exports with dynamic axes often lose static sizes after computed Reshapes (a head dim of
    `(batch, seq, 4, ?)`), and a kernel needs them at build time. The original model runs in ORT at
    two batch/sequence sizes; a dim equal in both runs is static and filled in; one that differs is
    dynamic and stays unknown. The generated C++ checks every static dim again at run time.
    Returns how many dims were filled.
    """
    import tempfile

    from tkopt.api import make_inputs
    from tkopt.bench_nodes import capture_onnx

    model = graph.meta.get("onnx_model")
    values = {id(v): v for n in graph.nodes if n.is_fused for v in n.inputs
              if v is not None and v.const is None and v.shape is not None and None in v.shape}
    if model is None or not values:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = [capture_onnx(model, list(values.values()), make_inputs(model, sizes=sizes), ["CPUExecutionProvider"],
                             Path(tmp)) for sizes in ((2, 8), (3, 13))]
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


def prepare(graph: Graph, target: str) -> tuple[list[NodeBinding], list[KernelSource], list[tuple[str, str]]]:
    """Lower a kernel for every fused node; a node no kernel serves is unfused in `graph`, with a warning."""
    kernels: dict[tuple, KernelSource] = {}
    bindings: list[NodeBinding] = []
    unfused: list[tuple[str, str]] = []
    for node in [n for n in graph.nodes if n.is_fused]:
        try:
            spec = program_spec(node, target)
            if spec.key not in kernels:
                kernels[spec.key] = lower_program(spec.build(), target, f"tk{len(kernels)}")
        except Exception as e:  # noqa: BLE001 - any kernel failure means: run this node unfused
            reason = str(e) if isinstance(e, Unservable) else f"kernel failed to build: {type(e).__name__}: {e}"
            log.warning("tkopt: leaving %s (%s) unfused for %s: %s", node.name, node.op, target, reason)
            unfuse(graph, node)
            unfused.append((node.name, reason))
            continue
        bindings.append(NodeBinding(node.name, node.op, node.inputs[0].dtype, kernels[spec.key], spec.buffers,
                                    spec.out_shapes, n_inputs=len(schema(node.op).inputs)))
    return bindings, list(kernels.values()), unfused


def op_signatures(nodes: list[Node]) -> dict[tuple[str, str], tuple[list[bool], list[bool]]]:
    sigs = {}
    for n in nodes:
        s = schema(n.op)
        sigs[(n.op, n.inputs[0].dtype)] = (
            [name in s.optional_inputs for name in s.inputs],
            [name in s.optional_outputs for name in s.outputs],
        )
    return sigs


def build_library(graph: Graph, target: str, path: Path) -> LibraryBuild:
    """Lower, bind and compile the kernels of every fused node in `graph` into the library at `path`.

    Mutates `graph`: nodes without a kernel are put back unfused, so the model written from it runs.
    """
    check_target(target)
    t0 = time.perf_counter()
    fill_static_dims(graph)
    bindings, kernels, unfused = prepare(graph, target)
    seal(graph)
    fused = [n for n in graph.nodes if n.is_fused]
    if bindings:
        compile_library(bindings, kernels, target, op_signatures(fused), Path(path))
    return LibraryBuild(Path(path), target, len(kernels), len(bindings), unfused, time.perf_counter() - t0)
