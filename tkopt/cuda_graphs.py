"""Replay a module's GPU work as CUDA graphs, one per exact input signature.

Why: a fused layer is a dozen kernel launches, each behind Python dispatch (custom op, wrapper,
TileLang adapter). On an H200 that host time exceeds the kernels' own time for batch-8 layers, so
`tkopt.compile` captures each new input signature (shapes, strides, dtypes, devices, non-tensor
values, grad mode) once and afterwards only copies inputs in, replays and copies outputs out.

Outputs are returned as fresh tensors (a clone of the graph's static outputs): a result held by the
caller is never overwritten by a later call. Parameters and buffers are captured by address, so
in-place weight updates are seen. Parameters passed as inputs (the torch.compile backend) are
checked by address on every call and recaptured if rebound; those held by the module (tkopt.compile)
are not: after `param.data = new`, compile again.
A signature whose capture fails runs uncaptured from then on, after one warning naming the reason.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


def signature(flat: Sequence[Any]) -> Hashable:
    """What a captured graph depends on: every tensor's layout and device, every other value, grad modes."""
    parts: list[Hashable] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad))
        else:
            parts.append(("value", type(x).__name__, repr(x)))
    return tuple(parts)


def capturable(flat: Sequence[Any], module: torch.nn.Module) -> str | None:
    """None if calls with these inputs can be graphed, else why not (CUDA graphs replay no autograd)."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors or any(x.device.type != "cuda" for x in tensors):
        return "inputs are not all CUDA tensors"
    if torch.is_grad_enabled() and (
        any(x.requires_grad for x in tensors) or any(p.requires_grad for p in module.parameters())
    ):
        return "autograd is enabled (call under torch.no_grad() or torch.inference_mode() to use CUDA graphs)"
    return None


def capture(fn: Callable[[], Any], device: torch.device) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of `fn()` and the output of the captured call. `fn` runs once first on a side
    stream, outside the capture: kernel builds, autotuning and cuBLAS handles happen there."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class CapturedCall:
    """One CUDA graph of `fn` on static copies of one call's inputs."""

    def __init__(self, fn: Callable[..., Any], flat: Sequence[Any], spec: pytree.TreeSpec,
                 in_place: Callable[[torch.Tensor], bool] = lambda t: False) -> None:
        # Inputs that `in_place` accepts (parameters passed as inputs) are captured where they are, their
        # address kept to check later calls against; the others are copied into static clones. clone()
        # keeps each input's strides (dense ones; expanded inputs become dense, which the copy_ in
        # __call__ handles), so the captured kernels see the caller's layout.
        self.kept = {i: x.data_ptr() for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and in_place(x)}
        self.static = [x.clone() if isinstance(x, torch.Tensor) and i not in self.kept else x
                       for i, x in enumerate(flat)]
        # what each call copies in: (index, static copy), the in-place inputs left out (a model passes hundreds)
        self.copied = [(i, x) for i, x in enumerate(self.static) if isinstance(x, torch.Tensor) and i not in self.kept]
        args, kwargs = pytree.tree_unflatten(self.static, spec)
        device = next(x.device for x in flat if isinstance(x, torch.Tensor))
        self.graph, out = capture(lambda: fn(*args, **kwargs), device)
        self.outputs, self.out_spec = pytree.tree_flatten(out)

    def current(self, flat: Sequence[Any]) -> bool:
        """Whether every in-place input still lives where the graph reads it (not rebound via `.data = `)."""
        return all(flat[i].data_ptr() == ptr for i, ptr in self.kept.items())

    def __call__(self, flat: Sequence[Any]) -> Any:
        for i, dst in self.copied:
            dst.copy_(flat[i])
        self.graph.replay()
        fresh = [o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs]
        return pytree.tree_unflatten(fresh, self.out_spec)


class GraphCache:
    """Captured graphs per input signature, least recently used dropped beyond `limit` (each holds
    its own activation memory)."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self.graphs: OrderedDict[Hashable, CapturedCall | str] = OrderedDict()

    def drop(self, stale: Callable[[Hashable], bool]) -> None:
        """Forget the graphs whose keys are `stale` (their memory goes with them)."""
        for key in [k for k in self.graphs if stale(k)]:
            del self.graphs[key]

    def __call__(self, key: Hashable, fn: Callable[..., Any], flat: Sequence[Any], spec: pytree.TreeSpec,
                 in_place: Callable[[torch.Tensor], bool] = lambda t: False) -> Any:
        entry = self.graphs.get(key)
        if isinstance(entry, CapturedCall) and not entry.current(flat):
            entry = None  # a parameter moved: capture again rather than read the old address
        if entry is None:
            try:
                entry = CapturedCall(fn, flat, spec, in_place)
            except Exception as e:  # noqa: BLE001 - any capture failure means: run this signature uncaptured
                entry = f"{type(e).__name__}: {e}"
                warnings.warn(f"tkopt: CUDA graph capture failed, running uncaptured for this input signature: "
                              f"{entry}", stacklevel=3)
            self.graphs[key] = entry
            while len(self.graphs) > self.limit:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        if isinstance(entry, str):
            args, kwargs = pytree.tree_unflatten(list(flat), spec)
            return fn(*args, **kwargs)
        return entry(flat)
