"""The metadata a model whose fused nodes run on a native op library carries: the library's file name
(beside the model) and its target. Written by the ONNX backend's `save`, read by `tkopt.ort.InferenceSession`."""

LIBRARY_KEY = "tkopt.op_library"
TARGET_KEY = "tkopt.target"
