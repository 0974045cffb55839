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

LIBRARY_KEY = "tkopt.op_library"
TARGET_KEY = "tkopt.target"


class OpLibraryError(RuntimeError):
    """The model's tkopt op library is missing or cannot be loaded; the message names it."""


def library_for(model_path: str | Path) -> Path | None:
    """The op library a tkopt model names in its metadata, resolved beside the model; None if it names none."""
    model_path = Path(model_path)
    model = onnx.load(str(model_path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    if LIBRARY_KEY not in meta:
        return None
    return model_path.parent / meta[LIBRARY_KEY]


def InferenceSession(  # noqa: N802 - named after the onnxruntime class it stands in for
    model_path: str | Path,
    library: str | Path | None = None,
    sess_options: Any = None,
    providers: list[str] | None = None,
) -> Any:
    """An onnxruntime.InferenceSession with the tkopt op library registered.

    `library` defaults to the one the model names. A missing library, or one ORT refuses, raises
    OpLibraryError with ORT's message and a hint naming the library.
    """
    import onnxruntime as ort

    lib = Path(library) if library is not None else library_for(model_path)
    so = sess_options or ort.SessionOptions()
    if lib is not None:
        if not lib.is_file():
            raise OpLibraryError(
                f"{model_path}: its tkopt op library {lib} is missing; rebuild it with "
                f"`tkopt optimize <original model> --target <cpu|sm80|sm90>` or pass library=..."
            )
        try:
            so.register_custom_ops_library(str(lib))
        except Exception as e:  # ORT raises its own types; keep its message
            raise OpLibraryError(f"onnxruntime could not load tkopt op library {lib}: {e}") from e
    try:
        return ort.InferenceSession(str(model_path), so, providers=providers or ["CPUExecutionProvider"])
    except Exception as e:
        if "tkopt" in str(e) and lib is None:
            raise OpLibraryError(
                f"{e}\nhint: {model_path} has tkopt fused nodes; register the op library built beside it by "
                "`tkopt optimize --target ...` (tkopt.ort.InferenceSession(path, library=...))"
            ) from e
        raise
