"""tkopt.ort: the native ONNX Runtime op library for fused models, and a session helper that loads it."""

from .session import InferenceSession, OpLibraryError

__all__ = ["InferenceSession", "OpLibraryError"]
