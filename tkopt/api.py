"""tkopt's public Python API for ONNX models: optimize one, and check the fused model against the original."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from tkopt import progress
from tkopt.accuracy import Accuracy
from tkopt.backends.onnx_model import check, save
from tkopt.differential import AccuracyError, onnx_dims, sweep, trial_sizes
from tkopt.files import check_output
from tkopt.frontends.onnx import import_onnx, load_model
from tkopt.onnx_runtime_ref import has_fused_nodes, native_library, run_model
from tkopt.ort.library import check_prerequisites, cuda_missing, resolve_target
from tkopt.ort.metadata import TARGET_KEY
from tkopt.ort.run import CPU_PROVIDERS, check_loads, make_inputs
from tkopt.ort.run import providers as providers_for
from tkopt.ort.session import library_for
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
    force: bool = False,
) -> tuple[onnx.ModelProto, Report]:
    """Fuse `model` and return (optimized ModelProto, Report).

    `target` "cpu", "sm80" or "sm90" builds the native ORT op library for it beside the output (named in the
    model's metadata; tkopt.ort.InferenceSession finds it), leaving unfused the nodes no kernel serves; "auto"
    picks this machine's (tkopt.ort.library.resolve_target). Without one (None, "none") the fused nodes run
    only through tkopt (tkopt.run_model), and the report says so. What the target needs (a C++ compiler, nvcc,
    ONNX Runtime's headers, the original model loading in ONNX Runtime) and a bad `output` (a directory, an
    unwritable folder, the input itself unless `force`) are refused before any work.
    `select` (tkopt.pipeline): "measured" (the default where the target's library can run here) keeps
    only fusions, and a model, that measured faster than ORT's own kernels; "all" keeps every fusion.

    The result passes onnx.checker with full_check. With `check_accuracy`, fused and unfused
    outputs are compared on random inputs (AccuracyError if they differ; nothing is saved then), on the
    op library where it runs here, else with the fused ops' torch references.
    `output` is written as one transaction (tkopt.backends.onnx_model.save), with external data when the
    input had it or it is >= 2 GB. `report` prints the report (rich) to the console.
    """
    arch, chose = resolve_target(target)
    if output is not None:
        check_output(output, source=model if isinstance(model, str | Path) else None, force=force)
    if arch is not None:
        check_prerequisites(arch)
    with progress.step("reading the model"):
        graph = import_onnx(model)
    original = graph.meta["onnx_model"]
    notes = [chose] if chose else []
    unrunnable = None if arch in (None, "cpu") else cuda_missing()
    if unrunnable is not None:
        notes.append(f"the {arch} op library is built, not run: {unrunnable}; so fusions are kept unmeasured"
                     + (" and the accuracy check runs the fused ops' torch references" if check_accuracy else ""))
    if arch is not None:
        check_loads(original, graph.meta["source"])
    with tempfile.TemporaryDirectory(prefix="tkopt-") as tmp:
        result = optimize(graph, OrtTarget(arch, original, Path(tmp)), select=select, disable=disable)
        rep = result.report
        rep.notes[:0] = notes
        _finish(result, output, check_accuracy, arch, runs_here=unrunnable is None)
    if report:
        rep.render(verbose=verbose)
    if rep.accuracy is not None and not rep.accuracy.ok:
        bad = [o.name for o in rep.accuracy.outputs if not o.ok]
        raise AccuracyError(f"{rep.source}: fused outputs {bad} differ from the original beyond tolerance")
    return result.artifact.model, rep


def _finish(result: Optimized, output: str | Path | None, check_accuracy: bool, arch: str | None,
            runs_here: bool) -> None:
    """Check, compare and save (model and library as one transaction); nothing is saved on a mismatch."""
    graph, rep, art = result.graph, result.report, result.artifact
    source = graph.meta["source"]
    optimized = art.model
    if result.winner == "tkopt":
        try:
            check(optimized)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
            raise RuntimeError(f"{source}: the optimized model fails onnx.checker (a tkopt bug): {e}") from e
    if art.library is not None:
        onnx.helper.set_model_props(optimized, {**{p.key: p.value for p in optimized.metadata_props},
                                                TARGET_KEY: arch})
    if check_accuracy:
        built = str(art.library) if art.library is not None and runs_here else None
        rep.accuracy = compare_onnx(graph.meta["onnx_model"], optimized, custom_ops_library=built,
                                    providers=providers_for(arch) if built else CPU_PROVIDERS)
    if has_fused_nodes(optimized) and art.library is None:
        rep.notes.append("the model has tkopt fused nodes and no op library: ONNX Runtime cannot load it; "
                         "tkopt.run_model runs it (fused ops through their torch references), and --target "
                         "auto, cpu, sm80 or sm90 builds the library it needs")
    if output is not None and (rep.accuracy is None or rep.accuracy.ok):
        with progress.step(f"writing {output}"):
            save(optimized, output, external_data=True if graph.meta["external_data"] else None,
                 library=art.library)
        rep.output = str(output)
        if art.library is not None:
            rep.library = str(library_for(output))


def compare_onnx(
    original: ModelLike,
    optimized: ModelLike,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    custom_ops_library: str | None = None,
    providers: Sequence[str] = CPU_PROVIDERS,
) -> Accuracy:
    """Per-output max abs/rel error of the optimized (fused) model against the original run in ORT.

    Without `inputs`, both run at several sizes of the symbolic dims (tkopt.differential.trial_sizes:
    the default sizes, 1, odd, longer); per output the worst error counts, and `runs` lists the sizes.
    The fused model runs in ORT with the native tkopt op library when one is configured (on `providers`:
    CUDA's for a GPU target's library), else "hybrid": its standard ops in ORT and the fused ops with tkopt's
    torch references. The original runs in ORT on the CPU, the reference.
    """
    orig = original if isinstance(original, onnx.ModelProto) else load_model(original)[0]
    opt = optimized if isinstance(optimized, onnx.ModelProto) else load_model(optimized)[0]
    if inputs is not None:
        feeds = [dict(inputs)]
    else:
        feeds = [make_inputs(orig, seed, dims=sizes) for sizes in trial_sizes(onnx_dims(orig))]
    lib = custom_ops_library or native_library()
    fused_runner = "ort" if not has_fused_nodes(opt) or lib else "hybrid"
    with progress.step("checking accuracy", total=len(feeds)) as advance:
        def fused(f: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            advance()
            return run_model(opt, f, provider=fused_runner, custom_ops_library=lib, ort_providers=providers)

        return sweep(feeds, lambda f: run_model(orig, f, provider="ort"), fused, fused_runner)
