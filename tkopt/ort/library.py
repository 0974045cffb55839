"""The kernels of one graph's fused nodes for one ORT target, and op libraries linked from them.

`KernelLibrary.prepare(nodes)` finds each node's program (its op's `program`, tkopt.fused_ops), lowers
each distinct program once (nodes with the same signature share one kernel) and compiles its object;
a node that no program serves, or whose kernel fails to lower or compile, is returned with the reason
so the pipeline leaves it unfused. `link(nodes, path)` then links a library for any subset of the
prepared nodes: the candidates while measuring, the kept ones at the end. Lowered kernels and objects
are cached on disk (tkopt.cache), so a warm build only lowers and compiles what is new; the C/CUDA
compilers run in parallel.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tkopt import progress
from tkopt.fused_ops import ProgramSpec, Unservable, schema
from tkopt.ir import Node

from .native import KernelSource, LibraryBuildError, NodeBinding, compile_objects, link_library, lower_program

TARGETS = ("cpu", "sm80", "sm90")
CHOICES = ("auto", *TARGETS, "none")  # what --target takes


def check_target(target: str) -> None:
    """Refuse a target this machine cannot build for, before any work is done."""
    import shutil

    if target not in TARGETS:
        raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {target!r}")
    if target != "cpu" and shutil.which("nvcc") is None:
        raise ValueError(f"--target {target} needs nvcc (the CUDA toolkit) on PATH to build the op library")


def resolve_target(target: str | None) -> tuple[str | None, str | None]:
    """(the target to build for, or None for no op library; a line saying how "auto" chose).

    "auto": this machine's GPU arch (sm90 on Hopper, sm80 on other GPUs from Ampere on) where nvcc and an
    onnxruntime with the CUDA provider are present, so the library it builds runs here; else "cpu".
    """
    if target in (None, "none"):
        return None, None
    if target != "auto":
        check_target(target)
        return target, None
    why = cuda_missing()
    if why is not None:
        return "cpu", f"--target auto chose cpu: {why}"
    from tkopt.kernels.arch import device_sm

    sm = device_sm()
    arch = "sm90" if sm == "sm_90" else "sm80" if sm is not None and int(sm[3:]) >= 80 else None
    if arch is None:
        return "cpu", f"--target auto chose cpu: GPU {sm} is older than sm_80, which tkopt's kernels need"
    return arch, f"--target auto chose {arch} (GPU {sm}, nvcc and onnxruntime's CUDA provider present)"


def cuda_missing() -> str | None:
    """Why an op library for a GPU target cannot run here (None if it can): a GPU, nvcc, a CUDA onnxruntime."""
    import shutil

    import onnxruntime as ort

    from tkopt.kernels.arch import device_sm

    if device_sm() is None:
        return "no CUDA GPU here"
    if shutil.which("nvcc") is None:
        return "nvcc (the CUDA toolkit) is not on PATH"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu in its place)"
    return None


def check_prerequisites(target: str) -> None:
    """What building `target`'s library needs, checked before any work (one line each when missing): a C++
    compiler (nvcc's host compiler too), nvcc for GPU targets, and ONNX Runtime's C API headers (fetched once
    with npm, which needs the network the first time, or TKOPT_ORT_INCLUDE)."""
    import os
    import shutil

    from . import headers

    check_target(target)
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise ValueError(f"--target {target} builds a native op library and needs a C++ compiler: {cxx} is not "
                         "on PATH (install g++, or set CXX); --target none skips the library")
    headers.include_dir()


def _lowered(spec: ProgramSpec, target: str) -> KernelSource:
    """The kernel for a program, lowered once per (program key, its pass configs, target, versions) and kept on
    disk."""
    from tkopt.cache import cache_path, digest, versions
    from tkopt.files import write_atomic

    name = digest(repr(spec.key), repr(sorted(spec.pass_configs.items())), target, versions())
    path = cache_path("ort-kernels", f"{name}.json")
    try:
        return KernelSource(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    kernel = lower_program(spec.build(), target, f"tk_{name[:16]}", spec.pass_configs)
    write_atomic(path, json.dumps(asdict(kernel)).encode())
    return kernel


class KernelLibrary:
    """Programs, kernels and objects for fused nodes on one target (see the module docstring)."""

    def __init__(self, target: str) -> None:
        check_target(target)
        self.target = target
        self.specs: dict[str, ProgramSpec] = {}  # node name -> its program
        self.kernels: dict[tuple, KernelSource] = {}  # program key -> lowered kernel
        self.objects: dict[tuple, Path] = {}  # program key -> compiled object

    def prepare(self, nodes: list[Node]) -> dict[str, str]:
        """Lower and compile the kernels of `nodes`; {node name: why it has no kernel} for those that fail."""
        failed: dict[str, str] = {}
        for node in nodes:
            try:
                self.specs[node.name] = schema(node.op).program(node, self.target)
            except Unservable as e:
                failed[node.name] = str(e)
        todo = {spec.key: spec for name, spec in self.specs.items() if name not in failed
                and spec.key not in self.objects}
        errors: dict[tuple, str] = {}
        with progress.step(f"lowering kernels with TileLang for {self.target}", total=len(todo)) as advance:
            for key, spec in todo.items():  # one at a time: lowering in threads measured slower here (the GIL)
                try:
                    self.kernels[key] = _lowered(spec, self.target)
                except Exception as e:  # noqa: BLE001 - any lowering failure: this kernel is unusable
                    errors[key] = f"kernel failed to lower: {type(e).__name__}: {e}"
                advance()
        lowered = [k for k in todo if k in self.kernels]
        with progress.step(f"compiling {len(lowered)} kernels ({'g++' if self.target == 'cpu' else 'nvcc'}; "
                           "cached on disk)"):
            built = compile_objects([self.kernels[k] for k in lowered], self.target)
        for key in lowered:
            obj = built[self.kernels[key].symbol]
            if isinstance(obj, LibraryBuildError):
                errors[key] = str(obj)
            else:
                self.objects[key] = obj
        for node in nodes:
            spec = self.specs.get(node.name)
            if spec is not None and spec.key in errors:
                failed[node.name] = errors[spec.key]
        return failed

    def link(self, nodes: list[Node], path: Path) -> Path:
        """A library serving `nodes` (all prepared without failure), written atomically to `path`."""
        keys = list(dict.fromkeys(self.specs[n.name].key for n in nodes))
        bindings = [
            NodeBinding(n.name, n.op, n.inputs[0].dtype, self.kernels[self.specs[n.name].key],
                        self.specs[n.name].buffers, self.specs[n.name].out_shapes, n_inputs=len(schema(n.op).inputs))
            for n in nodes
        ]
        return link_library(bindings, [self.kernels[k] for k in keys], [self.objects[k] for k in keys], self.target,
                            op_signatures(nodes), Path(path))


def op_signatures(nodes: list[Node]) -> dict[tuple[str, str], tuple[list[bool], list[bool]]]:
    sigs = {}
    for n in nodes:
        s = schema(n.op)
        sigs[(n.op, n.inputs[0].dtype)] = (
            [name in s.optional_inputs for name in s.inputs],
            [name in s.optional_outputs for name in s.outputs],
        )
    return sigs
