"""The accuracy check: fused against unfused at several admitted input sizes, not only the example's.

A fusion right at the example's sizes can be wrong at others (a mask that is causal at two lengths
but banded at a third, a broadcast that holds for batch 1 only). So each symbolic dim is tried at
the example's size, the smallest it admits (1 where allowed), an odd size and a longer one, all
within its admitted range; the result names every size tried. tkopt.compile knows each dim's range
from torch.export; an ONNX model does not declare one, so a size the original model itself cannot
run at is skipped and named, and if it runs at none the check is skipped with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tkopt.accuracy import Accuracy, OutputError, output_error
from tkopt.input_sizes import DimRange, gathers_refuse, guards_refuse, resize_inputs, resized, torch_dims

if TYPE_CHECKING:
    from torch import fx

Feeds = Mapping[str, Any]


class AccuracyError(RuntimeError):
    """The fused model's outputs do not match the original's within tolerance."""


def trial_sizes(dims: Mapping[Hashable, DimRange]) -> list[dict[Hashable, int]]:
    """Size assignments to check: the k-th candidate of every dim together, k = example, smallest,
    odd, longer (so dims tied by name move together); duplicates dropped, the example's first."""
    cands = {d: r.candidates() for d, r in dims.items()}
    out: list[dict[Hashable, int]] = []
    for k in range(4):
        a = {d: c[k] for d, c in cands.items()}
        if a not in out:
            out.append(a)
    return out


def sweep(
    feeds: Sequence[Feeds],
    run_original: Callable[[Feeds], Mapping[str, np.ndarray]],
    run_fused: Callable[[Feeds], Mapping[str, np.ndarray]],
    fused_runner: str,
    unfused_runner: str = "ort",
    dtypes: Mapping[str, str] | None = None,
) -> Accuracy:
    """Run both sides on every feed; per output the worst error over all of them.

    A feed the original cannot run is skipped (its reason kept); a fused failure is raised (a bug).
    """
    worst: dict[str, OutputError] = {}
    runs: list[dict[str, list[int]]] = []
    refused: list[tuple[str, str]] = []  # (sizes, why the original does not run at them)
    for f in feeds:
        shapes = {k: list(np.shape(v)) for k, v in f.items()}
        try:
            want = run_original(f)
        except Exception as e:  # noqa: BLE001 - the original not running here is a fact to report
            refused.append((describe(shapes), first_line(e)))
            continue
        got = run_fused(f)
        missing = set(want) - set(got)
        if missing:
            raise ValueError(f"optimized model lacks outputs {sorted(missing)}")
        runs.append(shapes)
        for name in want:
            err = output_error(name, np.asarray(got[name]), np.asarray(want[name]), (dtypes or {}).get(name))
            if name not in worst or not err.max_rel <= worst[name].max_rel:
                worst[name] = err
    if runs or not refused:
        skipped = [f"{sizes}: the original model does not run there ({why})" for sizes, why in refused]
    else:  # e.g. an op from a domain ORT does not know: nothing to compare against
        skipped = [f"the original model does not run in {unfused_runner} at any size tried: {refused[0][1]}"]
    return Accuracy(outputs=list(worst.values()), fused_runner=fused_runner, unfused_runner=unfused_runner,
                    inputs=runs[0] if runs else {}, runs=runs, skipped=skipped)


def describe(shapes: Mapping[str, Sequence[int]]) -> str:
    return ", ".join(f"{k} {list(v)}" for k, v in shapes.items())


def first_line(e: BaseException) -> str:
    """The error's first line, without ONNX Runtime's "[ONNXRuntimeError] : 1 : FAIL : " prefix."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", lines[0])[:300] if lines else type(e).__name__
    return text


# ---- ONNX ---------------------------------------------------------------------------------------
def onnx_dims(model: Any) -> dict[str, DimRange]:
    """The named symbolic dims of an ONNX model's inputs; examples: 2 for batch-like names, else 8
    (ONNX declares no range, so every size from 1 up is tried)."""
    inits = {t.name for t in model.graph.initializer}
    dims: dict[str, DimRange] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param:
                dims.setdefault(d.dim_param, DimRange(2 if "batch" in d.dim_param.lower() else 8))
    return dims


# ---- torch (tkopt.compile) ----------------------------------------------------------------------
def check_module(
    eager: Callable[..., Any],
    fused: Callable[..., Any],
    examples: Sequence[Any],
    ranges: Mapping[Any, Any],
    args: tuple,
    kwargs: dict,
    seed: int = 0,
    guarded: fx.GraphModule | None = None,
) -> Accuracy:
    """`fused` (one tkopt.compile specialization) against `eager` at the sizes its symbolic dims admit.

    `examples` are the specialization's per-input example values (FakeTensors with symbolic dims).
    `guarded`: its fx.GraphModule, whose input guards may refuse a size the ranges admit; such a size is
    skipped and named (the specialization never runs there: tkopt.compile re-exports for it). On CUDA a size is
    first run through it with its gathers checked (input_sizes.gathers_refuse): eager's gather past its table
    (GPT-2 past 1024 positions) would end in a device-side assert, not in an error the sweep can skip.
    """
    import torch
    import torch.utils._pytree as pytree

    from tkopt.frontends.fx import dtype_name

    with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
    flat = [x for _, x in with_paths]
    names = [("args" if p[0].idx == 0 else "kwargs") + pytree.keystr(p[1:]) for p, _ in with_paths]
    gen = torch.Generator().manual_seed(seed)
    feeds: list[dict[str, Any]] = []
    refused: list[str] = []
    for sizes in trial_sizes(torch_dims(examples, flat, ranges)):
        new = resize_inputs(examples, flat, sizes, lambda x, shape: resized(x, shape, gen))
        shapes = describe({k: list(np.shape(v)) for k, v in zip(names, new, strict=True)})
        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in new)
        if guarded is not None and (why := guards_refuse(guarded, new)) is not None:
            refused.append(f"{shapes}: the program's guards refuse it ({why})")
        elif guarded is not None and cuda and (why := gathers_refuse(guarded, new)) is not None:
            refused.append(f"{shapes}: the original model does not run there ({why})")
        else:
            feeds.append(dict(zip(names, new, strict=True)))
    dtypes: dict[str, str] = {}

    def call(fn: Callable[..., Any]) -> Callable[[Feeds], dict[str, np.ndarray]]:
        def run(f: Feeds) -> dict[str, np.ndarray]:
            a, kw = pytree.tree_unflatten(list(f.values()), spec)
            with torch.no_grad():
                leaves = [t for t in pytree.tree_leaves(fn(*a, **kw)) if isinstance(t, torch.Tensor)]
            out = {}
            for i, t in enumerate(leaves):
                dtypes[f"output_{i}"] = dtype_name(t.dtype)
                t = t.detach().cpu()
                out[f"output_{i}"] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
            return out

        return run

    accuracy = sweep(feeds, call(eager), call(fused), fused_runner="tkopt.compile", unfused_runner="eager",
                     dtypes=dtypes)
    accuracy.skipped.extend(refused)
    return accuracy
