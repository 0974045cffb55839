"""tkopt's public Python API for ONNX models: optimize one, and check the fused model against the original."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx

from tkopt.backends.onnx_model import check, export_onnx, save
from tkopt.differential import AccuracyError, onnx_dims, sweep, trial_sizes
from tkopt.frontends.onnx import import_onnx, load_model
from tkopt.onnx_runtime_ref import has_fused_nodes, native_library, run_model
from tkopt.ort.library import LibraryBuild, build_library, check_target
from tkopt.ort.session import LIBRARY_KEY, TARGET_KEY
from tkopt.passes.finalize import seal
from tkopt.passes.pipeline import run_passes
from tkopt.report import Accuracy, Report

ModelLike = str | Path | onnx.ModelProto


def optimize_onnx(
    model: ModelLike,
    output: str | Path | None = None,
    disable: Iterable[str] = (),
    report: bool = True,
    check_accuracy: bool = False,
    verbose: bool = False,
    target: str | None = None,
) -> tuple[onnx.ModelProto, Report]:
    """Fuse `model` and return (optimized ModelProto, Report).

    With `target` ("cpu", "sm80", "sm90") the native ORT op library is built for it beside the
    output (`<stem>.tkopt-<target>.so`, named in the model's metadata), nodes no kernel serves
    are left unfused, and the accuracy check runs the fused model in ORT on that library.

    The result passes onnx.checker with full_check. With `check_accuracy`, fused and unfused
    outputs are compared on random inputs (AccuracyError if they differ; nothing is saved then).
    `output` is written atomically, with external data when the input had it or it is >= 2 GB.
    `report` prints the report (rich) to the console.
    """
    if target is not None:
        check_target(target)
    graph = import_onnx(model)
    ops_before = graph.count_ops()
    passes = run_passes(graph, disable)
    with tempfile.TemporaryDirectory(prefix="tkopt-") as tmp:
        lib: LibraryBuild | None = None
        if target is not None:
            lib = build_library(graph, target, Path(tmp) / "ops.so")
        else:
            seal(graph)
        optimized = export_onnx(graph)
        final_lib = None
        if lib is not None and lib.nodes:
            final_lib = library_path(output if output is not None else Path(graph.meta["source"]), target)
            onnx.helper.set_model_props(optimized, {LIBRARY_KEY: final_lib.name, TARGET_KEY: target})
        rep = _finish(graph, optimized, passes, ops_before, output, check_accuracy, lib, final_lib)
    if report:
        rep.render(verbose=verbose)
    if rep.accuracy is not None and not rep.accuracy.ok:
        bad = [o.name for o in rep.accuracy.outputs if not o.ok]
        raise AccuracyError(f"{rep.source}: fused outputs {bad} differ from the original beyond tolerance")
    return optimized, rep


def library_path(model_path: str | Path, target: str) -> Path:
    """Where the op library for a model written at `model_path` goes: beside it, named for the target."""
    p = Path(model_path)
    return p.with_name(f"{p.stem.removesuffix('.tkopt')}.tkopt-{target}.so")


def _finish(graph, optimized, passes, ops_before, output, check_accuracy, lib, final_lib) -> Report:
    """Check, compare and save (model, then library, both atomically); nothing is saved on a mismatch."""
    try:
        check(optimized)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise RuntimeError(f"{graph.meta['source']}: the optimized model fails onnx.checker (a tkopt bug): {e}") from e
    rep = Report(source=graph.meta["source"], passes=passes, ops_before=ops_before, ops_after=graph.count_ops())
    if lib is not None:
        rep.target, rep.unfused = lib.target, lib.unfused
    built = str(lib.path) if lib is not None and lib.nodes else None
    if check_accuracy:
        rep.accuracy = compare_onnx(graph.meta["onnx_model"], optimized, custom_ops_library=built)
    if output is not None and (rep.accuracy is None or rep.accuracy.ok):
        save(optimized, output, external_data=True if graph.meta["external_data"] else None)
        rep.output = str(output)
        if built is not None:
            tmp = final_lib.with_name(f".{final_lib.name}.tmp")
            shutil.copyfile(built, tmp)
            os.replace(tmp, final_lib)
            rep.library = str(final_lib)
    return rep


def _dim_size(dim: int | str | None, sizes: tuple[int, int], dims: Mapping[str, int]) -> int:
    if isinstance(dim, int) and dim > 0:
        return dim
    if isinstance(dim, str) and dim in dims:
        return dims[dim]
    return sizes[0] if isinstance(dim, str) and "batch" in dim.lower() else sizes[1]


def make_inputs(model: onnx.ModelProto, seed: int = 0, sizes: tuple[int, int] = (2, 8),
                dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random inputs matching the model's input types; symbolic dims get small sizes (same name, same size):
    `dims` by name, else `sizes` = (for dims named like a batch, for the others).

    Integer inputs are token ids in [0, 10), `*mask*` inputs are all ones with the last quarter of
    each row zeroed (padding), `*position*` inputs count along the last axis.
    """
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [_dim_size(d.dim_value if d.HasField("dim_value") else d.dim_param or None, sizes, dims or {})
                 for d in tt.shape.dim]
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        name = vi.name.lower()
        if "mask" in name:
            arr = np.ones(shape, dtype=np_dtype)
            if arr.ndim and shape[-1] > 1:
                arr[..., shape[-1] - max(1, shape[-1] // 4):] = 0
        elif "position" in name and np.issubdtype(np_dtype, np.integer):
            arr = np.broadcast_to(np.arange(shape[-1] if shape else 1), shape).astype(np_dtype)
        elif np.issubdtype(np_dtype, np.integer):
            arr = rng.integers(0, 10, size=shape).astype(np_dtype)
        elif np_dtype == np.bool_:
            arr = rng.random(shape) > 0.2
        else:
            arr = rng.standard_normal(shape).astype(np_dtype)
        out[vi.name] = arr
    return out


def compare_onnx(
    original: ModelLike,
    optimized: ModelLike,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    custom_ops_library: str | None = None,
) -> Accuracy:
    """Per-output max abs/rel error of the optimized (fused) model against the original run in ORT.

    Without `inputs`, both run at several sizes of the symbolic dims (tkopt.differential.trial_sizes:
    the default sizes, 1, odd, longer); per output the worst error counts, and `runs` lists the sizes.
    The fused model runs in ORT with the native tkopt op library when one is configured, else
    "hybrid": its standard ops in ORT and the fused ops with tkopt's torch references.
    """
    orig = original if isinstance(original, onnx.ModelProto) else load_model(original)[0]
    opt = optimized if isinstance(optimized, onnx.ModelProto) else load_model(optimized)[0]
    if inputs is not None:
        feeds = [dict(inputs)]
    else:
        feeds = [make_inputs(orig, seed, dims=sizes) for sizes in trial_sizes(onnx_dims(orig))]
    lib = custom_ops_library or native_library()
    fused_runner = "ort" if not has_fused_nodes(opt) or lib else "hybrid"
    return sweep(feeds, lambda f: run_model(orig, f, provider="ort"),
                 lambda f: run_model(opt, f, provider=fused_runner, custom_ops_library=lib), fused_runner)
