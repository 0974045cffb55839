"""Open an ORT session on a tkopt-optimized model with its native op library registered.

The optimized model names its library in metadata (`tkopt.op_library`, relative to the model
file), so `InferenceSession("model.tkopt.onnx")` finds it. Without tkopt the same is:

    so = onnxruntime.SessionOptions()
    so.register_custom_ops_library("model.tkopt.cpu.so")
    onnxruntime.InferenceSession("model.tkopt.onnx", so)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from .metadata import LIBRARY_KEY, TARGET_KEY


class OpLibraryError(RuntimeError):
    """The model's tkopt op library is missing or cannot be loaded; the message names it."""


def _meta(model_path: str | Path) -> dict[str, str]:
    model = onnx.load(str(model_path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}


def library_for(model_path: str | Path) -> Path | None:
    """The op library a tkopt model names in its metadata, resolved beside the model; None if it names none."""
    meta = _meta(model_path)
    if LIBRARY_KEY not in meta:
        return None
    return Path(model_path).parent / meta[LIBRARY_KEY]


def InferenceSession(  # noqa: N802 - named after the onnxruntime class it stands in for
    model_path: str | Path,
    library: str | Path | None = None,
    sess_options: Any = None,
    providers: list[str] | None = None,
) -> Any:
    """An onnxruntime.InferenceSession with the tkopt op library registered.

    `library` defaults to the one the model names. `providers` default to the CUDA provider (then the CPU's)
    for a model built for a GPU target, else the CPU's. A missing library, or one ORT refuses, raises
    OpLibraryError with ORT's message and a hint naming the library.
    """
    import onnxruntime as ort

    from .run import CPU_PROVIDERS, CUDA_PROVIDERS

    meta = _meta(model_path)
    lib = Path(library) if library is not None else library_for(model_path)
    so = sess_options or ort.SessionOptions()
    if lib is not None:
        if not lib.is_file():
            raise OpLibraryError(
                f"{model_path}: its tkopt op library {lib} is missing; rebuild it with "
                f"`tkopt optimize <original model> --target <cpu|sm80|sm90>` or pass library=..."
            )
        try:
            so.register_custom_ops_library(str(lib.resolve()))  # a bare name would be looked up on the loader's path
        except Exception as e:  # ORT raises its own types; keep its message
            raise OpLibraryError(f"onnxruntime could not load tkopt op library {lib}: {e}") from e
    target = meta.get(TARGET_KEY, "cpu")
    if target != "cpu" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise OpLibraryError(f"{model_path}: its op library is built for {target}, which runs on ONNX Runtime's CUDA "
                             "provider: this onnxruntime has none (install onnxruntime-gpu in its place)")
    if providers is None:
        providers = CUDA_PROVIDERS if target != "cpu" else CPU_PROVIDERS
    try:
        return ort.InferenceSession(str(model_path), so, providers=providers)
    except Exception as e:
        if "tkopt" in str(e) and lib is None:
            raise OpLibraryError(
                f"{e}\nhint: {model_path} has tkopt fused nodes; register the op library built beside it by "
                "`tkopt optimize --target ...` (tkopt.ort.InferenceSession(path, library=...))"
            ) from e
        raise
