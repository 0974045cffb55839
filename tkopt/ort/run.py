"""Running ONNX models in ONNX Runtime: sessions, random inputs, and capturing intermediate values.

Shared by the ORT target (measuring fused nodes on their real inputs), the accuracy check and the
benchmarks, so all of them feed models the same way.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

CPU_PROVIDERS = ["CPUExecutionProvider"]
CUDA_PROVIDERS = ["CUDAExecutionProvider", "CPUExecutionProvider"]
TWO_GB = 2**31


def providers(arch: str | None) -> list[str]:
    """ORT providers that run a model whose fused nodes are built for `arch` (None/"cpu": the CPU)."""
    if arch in (None, "cpu"):
        return CPU_PROVIDERS
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(f"--target {arch}: this onnxruntime has no CUDAExecutionProvider (install "
                           "onnxruntime-gpu) to run the CUDA op library (`tkopt optimize --target` builds it "
                           "without running it)")
    return CUDA_PROVIDERS


def session(model: onnx.ModelProto | str | Path, library: str | Path | None = None,
            provider_list: Sequence[str] = CPU_PROVIDERS, spinning: bool = True) -> Any:
    """An ORT session, with the tkopt op library registered when given. A ModelProto of 2 GB or more
    goes through a temporary file with external data (ORT reads it while creating the session). Without
    `spinning` its CPU workers sleep as soon as they are idle: sessions timed in turns in one process then leave
    each other the cores. With it (ORT's default, what a process running one model has) each session's workers
    spin after every run and slowed the next session's: a 4-layer Llama raced against two other models took
    42.6 ms (median) where it takes 18.0 alone and 19.8 raced without spinning (2 cores, 2026-12-05)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4  # errors reach the caller as exceptions; ORT's logger would print them again
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if library is not None:
        so.register_custom_ops_library(str(Path(library).resolve()))
    if not isinstance(model, onnx.ModelProto):
        return ort.InferenceSession(str(model), so, providers=list(provider_list))
    if model.ByteSize() < TWO_GB:
        return ort.InferenceSession(model.SerializeToString(), so, providers=list(provider_list))
    from tkopt.backends.onnx_model import save

    with tempfile.TemporaryDirectory() as d:
        path = save(model, Path(d) / "model.onnx", external_data=True)
        return ort.InferenceSession(str(path), so, providers=list(provider_list))


def check_loads(model: onnx.ModelProto, source: str) -> None:
    """Refuse, in one line, a model ONNX Runtime cannot load (an op or domain it does not know, a broken
    graph): a target runs the original model to build and measure its kernels, and bench runs it too."""
    import onnxruntime as ort

    from tkopt.differential import first_line

    try:
        session(model)
    except Exception as e:  # noqa: BLE001 - ORT raises its own types; the message is what matters
        raise ValueError(f"{source} does not load in ONNX Runtime {ort.__version__} ({first_line(e)}); tkopt runs "
                         "the original model to build, measure and check kernels (--target none fuses it "
                         "without running it)") from e


class Bound:
    """A session called again and again on fixed feeds: on CUDA the inputs stay on the GPU and the outputs
    are left there (IO binding), so a timed call is the session's work, not host-device copies (ORT's Run
    synchronizes its stream before returning, so a wall-clock timer holds)."""

    def __init__(self, sess: Any, feeds: Mapping[str, np.ndarray], outputs: Sequence[str],
                 provider_list: Sequence[str] = CPU_PROVIDERS) -> None:
        self.session, self.outputs, self.feeds = sess, list(outputs), dict(feeds)
        self.binding = None
        if provider_list[0] == "CUDAExecutionProvider":
            import onnxruntime as ort

            self.binding = sess.io_binding()
            self._device_inputs = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", 0)
                                   for v in self.feeds.values()]
            for name, value in zip(self.feeds, self._device_inputs, strict=True):
                self.binding.bind_ortvalue_input(name, value)
            for name in self.outputs:
                self.binding.bind_output(name, "cuda", 0)

    def __call__(self) -> None:
        if self.binding is None:
            self.session.run(self.outputs, self.feeds)
        else:
            self.session.run_with_iobinding(self.binding)

    def results(self) -> dict[str, np.ndarray]:
        """One call, its outputs on the host by name."""
        if self.binding is None:
            return dict(zip(self.outputs, self.session.run(self.outputs, self.feeds), strict=True))
        self.session.run_with_iobinding(self.binding)
        return dict(zip(self.outputs, self.binding.copy_outputs_to_cpu(), strict=True))


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


def capture(model: onnx.ModelProto, names: Sequence[str], feeds: Mapping[str, np.ndarray],
            provider_list: Sequence[str] = CPU_PROVIDERS) -> dict[str, np.ndarray]:
    """`feeds` and the named values as `model` computes them on `feeds` (one ORT run of a copy with those
    values as extra outputs). Names the model does not compute are absent from the result."""
    produced = {o for n in model.graph.node for o in n.output if o}
    have = {o.name for o in model.graph.output}
    wanted = [n for n in dict.fromkeys(names) if n in produced and n not in feeds]
    if not wanted:
        return dict(feeds)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in wanted:
        if name not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = 4  # as in `session`
    got = session(m, provider_list=provider_list).run(wanted, dict(feeds), options)
    return {**feeds, **dict(zip(wanted, got, strict=True))}
