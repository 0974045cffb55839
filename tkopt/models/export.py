"""Export the reference models the ways users do: torch.export, and both ONNX exporters.

Every tensor input has a dynamic batch dim (0, named "batch") and, from rank 2 on, a dynamic
sequence dim (1, named "seq"), unless the model's `dynamic_axes` says otherwise; outputs get the
same names. Input names are the forward()'s
parameter names, so ONNX inputs read "hidden_states", "attention_mask", ...
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn
from torch.export import Dim

# The TorchScript exporter's well-trodden opset; the dynamo exporter emits 18 at the lowest
# (its onnxscript torchlib is written against opset 18).
TORCHSCRIPT_OPSET = 17
DYNAMO_OPSET = 18


def input_names(model: nn.Module, inputs: tuple) -> list[str]:
    """forward()'s positional parameter names (or the model's own `input_names`), one per example input."""
    params = getattr(model, "input_names", None) or [
        p.name for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) < len(inputs):
        raise ValueError(f"{type(model).__name__}.forward takes {len(params)} positional inputs, got {len(inputs)}")
    return params[: len(inputs)]


def _output_names(model: nn.Module, inputs: tuple) -> list[str]:
    with torch.no_grad():
        out = model(*inputs)
    n = len(out) if isinstance(out, (tuple, list)) else 1
    return ["output"] if n == 1 else [f"output_{i}" for i in range(n)]


def _axes(model: nn.Module, name: str, x: torch.Tensor) -> dict[int, str]:
    """Which dims of input `name` are dynamic, and their names: dim 0 "batch", dim 1 "seq" (from rank 2),
    unless the model says otherwise in `dynamic_axes` (an image's dim 1 is channels, not a sequence)."""
    own = getattr(model, "dynamic_axes", {}).get(name)
    if own is not None:
        return own
    return {0: "batch", 1: "seq"} if x.dim() >= 2 else {0: "batch"}


def dynamic_shapes(model: nn.Module, inputs: tuple) -> tuple[Any, ...]:
    """torch.export dynamic_shapes, one entry per input in order: dim 0 -> Dim("batch"), dim 1 ->
    Dim("seq") (or the model's `dynamic_axes`; each new name gets its own Dim).

    A model with `max_seq` or `cfg.max_seq` (a mask buffer or position table sliced to the sequence
    length) gets seq < max_seq: torch.export specializes the full-length slice (guard seq != max_seq).
    """
    max_seq = getattr(model, "max_seq", None) or getattr(getattr(model, "cfg", None), "max_seq", None)
    dims = {"batch": Dim("batch", min=1, max=1024), "seq": Dim("seq", min=1, max=max_seq - 1 if max_seq else 4096)}
    shapes = tuple(
        {axis: dims.setdefault(dim, Dim(dim, min=1, max=4096)) for axis, dim in _axes(model, name, x).items()}
        for name, x in zip(input_names(model, inputs), inputs, strict=True)
    )
    params = inspect.signature(model.forward).parameters.values()
    return (shapes,) if any(p.kind == p.VAR_POSITIONAL for p in params) else shapes  # forward(*tensors)


def export_fx(model: nn.Module, inputs: tuple, dynamic: bool = True) -> torch.export.ExportedProgram:
    """torch.export with dynamic batch/seq dims (as far as the model allows)."""
    ds = dynamic_shapes(model, inputs) if dynamic else None
    return torch.export.export(model, tuple(inputs), dynamic_shapes=ds)


def _atomic_save(proto: onnx.ModelProto, path: Path, external_data: bool) -> None:
    """Write into a temp dir next to `path`, then rename into place: no half-written model on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = path.name + ".data"
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tkopt-export-") as td:
        tmp = Path(td) / path.name
        onnx.save_model(
            proto, tmp, save_as_external_data=external_data, all_tensors_to_one_file=True,
            location=data_name, size_threshold=0,
        )
        if external_data:
            shutil.copymode(tmp, Path(td) / data_name)  # onnx creates the data 0600; the model has the umask's mode
            os.replace(Path(td) / data_name, path.parent / data_name)
        os.replace(tmp, path)


def _torchscript_axes(
    model: nn.Module, names: list[str], inputs: tuple, out_names: list[str]
) -> dict[str, dict[int, str]]:
    """TorchScript exporter dynamic_axes: the same naming as `dynamic_shapes`."""
    axes = {n: _axes(model, n, x) for n, x in zip(names, inputs, strict=True)}
    return axes | {n: {0: "batch", 1: "seq"} for n in out_names}


def export_onnx(
    model: nn.Module,
    inputs: tuple,
    path: str | os.PathLike,
    dynamo: bool,
    opset: int | None = None,
    dynamic_batch_seq: bool = True,
    external_data: bool = False,
) -> Path:
    """Export with torch.onnx.export (dynamo=True: torch.export + onnxscript; False: TorchScript).

    Inputs are named after forward()'s parameters, the output "output" ("output_<i>" for several).
    With `external_data` every weight goes to "<path>.data" next to the model.
    """
    path = Path(path)
    inputs = tuple(inputs)
    names = input_names(model, inputs)
    out_names = _output_names(model, inputs)
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td) / "model.onnx"
        if dynamo:
            prog = torch.onnx.export(
                model, inputs, dynamo=True, opset_version=opset or DYNAMO_OPSET, input_names=names,
                output_names=out_names, dynamic_shapes=dynamic_shapes(model, inputs) if dynamic_batch_seq else None,
                external_data=False, verbose=False,
            )
            proto = prog.model_proto
        else:
            axes = _torchscript_axes(model, names, inputs, out_names) if dynamic_batch_seq else None
            torch.onnx.export(
                model, inputs, str(tmp), dynamo=False, opset_version=opset or TORCHSCRIPT_OPSET,
                input_names=names, output_names=out_names, dynamic_axes=axes,
            )
            proto = onnx.load_model(str(tmp))
    onnx.checker.check_model(proto, full_check=True)
    _atomic_save(proto, path, external_data)
    return path


def example_model() -> tuple[nn.Module, tuple]:
    """The model the demo uses: the GPT-2-style block (attention, norms, GEMMs with epilogues)."""
    from tkopt.models.blocks import REFERENCE_MODELS

    return REFERENCE_MODELS["gpt2_block"]()


def export_example(path: str | os.PathLike, dynamo: bool = True) -> Path:
    """Export the demo's example model to ONNX at `path`."""
    model, inputs = example_model()
    return export_onnx(model, inputs, path, dynamo=dynamo)
