"""tkopt's public Python API for ONNX models: optimize one, and check the fused model against the original."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx

from tkopt.accuracy import Accuracy
from tkopt.backends.onnx_model import check, save
from tkopt.differential import AccuracyError, onnx_dims, sweep, trial_sizes
from tkopt.frontends.onnx import import_onnx, load_model
from tkopt.onnx_runtime_ref import has_fused_nodes, native_library, run_model
from tkopt.ort.library import check_target
from tkopt.ort.run import make_inputs
from tkopt.ort.session import LIBRARY_KEY, TARGET_KEY
from tkopt.pipeline import Optimized, optimize
from tkopt.report import Report
from tkopt.targets.ort_target import OrtTarget

ModelLike = str | Path | onnx.ModelProto


def optimize_onnx(
    model: ModelLike,
    output: str | Path | None = None,
    disable: Iterable[str] = (),
    report: bool = True,
    check_accuracy: bool = False,
    verbose: bool = False,
    target: str | None = None,
    select: str | None = None,
) -> tuple[onnx.ModelProto, Report]:
    """Fuse `model` and return (optimized ModelProto, Report).

    With `target` ("cpu", "sm80", "sm90") the native ORT op library is built for it beside the
    output (`<stem>.tkopt-<target>.so`, named in the model's metadata), nodes no kernel serves
    are left unfused, and the accuracy check runs the fused model in ORT on that library.
    `select` (tkopt.pipeline): "measured" (the default where the target's library can run here) keeps
    only fusions, and a model, that measured faster than ORT's own kernels; "all" keeps every fusion.

    The result passes onnx.checker with full_check. With `check_accuracy`, fused and unfused
    outputs are compared on random inputs (AccuracyError if they differ; nothing is saved then).
    `output` is written atomically, with external data when the input had it or it is >= 2 GB.
    `report` prints the report (rich) to the console.
    """
    if target is not None:
        check_target(target)
    graph = import_onnx(model)
    with tempfile.TemporaryDirectory(prefix="tkopt-") as tmp:
        result = optimize(graph, OrtTarget(target, graph.meta["onnx_model"], Path(tmp)), select=select,
                          disable=disable)
        rep = _finish(result, output, check_accuracy, target)
    if report:
        rep.render(verbose=verbose)
    if rep.accuracy is not None and not rep.accuracy.ok:
        bad = [o.name for o in rep.accuracy.outputs if not o.ok]
        raise AccuracyError(f"{rep.source}: fused outputs {bad} differ from the original beyond tolerance")
    return result.artifact.model, rep


def library_path(model_path: str | Path, target: str) -> Path:
    """Where the op library for a model written at `model_path` goes: beside it, named for the target."""
    p = Path(model_path)
    return p.with_name(f"{p.stem.removesuffix('.tkopt')}.tkopt-{target}.so")


def _finish(result: Optimized, output: str | Path | None, check_accuracy: bool, target: str | None) -> Report:
    """Check, compare and save (model, then library, both atomically); nothing is saved on a mismatch."""
    graph, rep, art = result.graph, result.report, result.artifact
    source = graph.meta["source"]
    optimized = art.model
    if result.winner == "tkopt":
        try:
            check(optimized)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
            raise RuntimeError(f"{source}: the optimized model fails onnx.checker (a tkopt bug): {e}") from e
    final_lib = None
    if art.library is not None:
        final_lib = library_path(output if output is not None else Path(source), target)
        onnx.helper.set_model_props(optimized, {LIBRARY_KEY: final_lib.name, TARGET_KEY: target})
    if check_accuracy:
        built = str(art.library) if art.library is not None else None
        rep.accuracy = compare_onnx(graph.meta["onnx_model"], optimized, custom_ops_library=built)
    if output is not None and (rep.accuracy is None or rep.accuracy.ok):
        save(optimized, output, external_data=True if graph.meta["external_data"] else None)
        rep.output = str(output)
        if final_lib is not None:
            tmp = final_lib.with_name(f".{final_lib.name}.tmp")
            shutil.copyfile(art.library, tmp)
            os.replace(tmp, final_lib)
            rep.library = str(final_lib)
    return rep


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
