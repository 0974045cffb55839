"""Building fused nodes' kernels for the torch targets: the small inputs a build runs on, and builds spread
over worker interpreters.

A kernel is built by running it once on small random inputs (a probe): only dtypes and static dims reach
the kernels' compile-time keys, so the kernel a probe builds is the one every call will use. TileLang's
lowering holds the GIL, so threads do not overlap builds; fresh interpreters do (tkopt.kernels.workers),
and TileLang's disk cache hands what they built to this process. Workers only build: they run with
autotuning off, since timings taken side by side on one device would be wrong; tuning, where a kernel
tunes, happens in this process when it probes the kernel afterwards. Kernels this machine has built
before (recorded in the tkopt cache, `built-kernels.json`) are left to TileLang's disk cache: starting
workers for them would cost a warm compile seconds for nothing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from tkopt.cache import JsonFile, cache_path, digest, versions
from tkopt.fused_ops import run_kernel
from tkopt.ir import Node, Value
from tkopt.kernels.workers import default_workers, map_in_workers

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "bool": torch.bool, "int64": torch.int64, "int32": torch.int32}

InputSpec = tuple[str, tuple[int, ...]] | None  # dtype name and shape of one input; None: an absent input


def input_specs(node: Node) -> list[InputSpec]:
    """A node's inputs as (dtype, shape): its static dims, and its symbolic dims small but in the relation their
    example sizes have (equal where equal, ordered as ordered). A graph may name equal dims by different symbols
    (an export that never learnt K's and V's lengths are one): sizes drawn per symbol would hand the kernel
    shapes no call has, and it would refuse them. Raises ValueError for an input no kernel can be built for."""
    keys: list[list[Any] | None] = []  # per input: each dim's size or what tells its size apart
    for v in node.inputs:
        if v is None:
            keys.append(None)
            continue
        if v.dtype not in DTYPES:
            raise ValueError(f"input {v.name} has dtype {v.dtype}, which no kernel takes")
        if v.shape is None:
            raise ValueError(f"input {v.name} has unknown rank")
        if any(d is None for d in v.shape):
            raise ValueError(f"input {v.name} has a dim of unknown size")
        keys.append([d if isinstance(d, int) else _size_key(v, axis) for axis, d in enumerate(v.shape)])
    symbolic = {k for shape in keys if shape is not None for k in shape if not isinstance(k, int)}
    small = {k: 3 + i for i, k in enumerate(sorted(symbolic))}
    return [None if v is None or shape is None
            else (v.dtype, tuple(k if isinstance(k, int) else small[k] for k in shape))
            for v, shape in zip(node.inputs, keys, strict=True)]


def _size_key(v: Value, axis: int) -> tuple[int, int | str]:
    """What tells a symbolic dim's size apart: its example size where the FX node has one (sorted first, by
    size), else its symbol's name."""
    val = getattr(v.origin, "meta", {}).get("val")
    if isinstance(val, torch.Tensor) and val.dim() == len(v.shape):  # type: ignore[arg-type]
        size = val.shape[axis]
        hint = size.node.hint if isinstance(size, torch.SymInt) else size
        if hint is not None:
            return (0, int(hint))
    return (1, str(v.shape[axis]))  # type: ignore[index]


def probe_inputs(specs: Sequence[InputSpec], device: torch.device) -> list[torch.Tensor | None]:
    """Seeded random tensors of `specs` on `device` (bools mostly true: masks that keep most positions)."""
    gen = torch.Generator().manual_seed(0)
    tensors: list[torch.Tensor | None] = []
    for spec in specs:
        if spec is None:
            tensors.append(None)
            continue
        dtype, shape = DTYPES[spec[0]], spec[1]
        t = torch.rand(shape, generator=gen) > 0.1 if dtype == torch.bool else torch.randn(shape, generator=gen)
        tensors.append(t.to(dtype).to(device))
    return tensors


def build_job(job: tuple[str, dict, list[InputSpec], str]) -> str | None:
    """A worker's build: (op, attrs, input specs, device) -> None, or why the kernel failed."""
    os.environ["TKOPT_AUTOTUNE"] = "0"
    op, attrs, specs, device = job
    try:
        run_kernel(op, probe_inputs(specs, torch.device(device)), attrs)
    except Exception as e:  # noqa: BLE001 - the parent's own probe reports it
        return f"{type(e).__name__}: {e}"
    return None


def _jobs(nodes: Sequence[Node], device: torch.device, fingerprint: dict[str, Any]) -> dict[str, tuple]:
    """Build jobs of `nodes` by their key in `built-kernels.json` (`fingerprint`: the device and runtimes)."""
    jobs = {}
    for n in nodes:
        try:
            job = (n.op, dict(n.attrs), input_specs(n), str(device))
        except ValueError:
            continue  # the probe says why
        jobs[digest(versions(), fingerprint, job)] = job
    return jobs


def record_built(nodes: Sequence[Node], device: torch.device, fingerprint: dict[str, Any]) -> None:
    """Note that the kernels of `nodes` were built on this machine (their probes passed)."""
    built = JsonFile(cache_path("built-kernels.json"))
    known = built.read()
    for key in _jobs(nodes, device, fingerprint):
        if key not in known:
            try:
                built.update(key, True)
            except OSError:  # a read-only cache: workers start again next time, nothing worse
                return


def build_workers() -> int | None:
    """TKOPT_BUILD_WORKERS: at most this many build workers per compile (1: none; unset: one per core but one).
    Processes that already run side by side (pytest -n) set it so their workers do not multiply."""
    value = os.environ.get("TKOPT_BUILD_WORKERS")
    if not value:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"TKOPT_BUILD_WORKERS must be a number of workers, got {value!r}") from None


def prebuild(nodes: Sequence[Node], device: torch.device, fingerprint: dict[str, Any],
             workers: int | None = None) -> None:
    """Build the kernels of `nodes` (one per distinct kernel) not built here before in parallel worker
    interpreters, filling TileLang's disk cache for the probes that follow here. Nothing where one worker
    would do (`workers` defaults to TKOPT_BUILD_WORKERS, else one per core but one); a failure only warns:
    the probes then build one at a time, as without workers."""
    known = JsonFile(cache_path("built-kernels.json")).read()
    jobs = [job for key, job in _jobs(nodes, device, fingerprint).items() if key not in known]
    workers = workers or build_workers() or default_workers(len(jobs))
    if workers < 2 or len(jobs) < 2:
        return
    try:
        map_in_workers(build_job, jobs, workers)
    except Exception as e:  # noqa: BLE001 - parallel builds are an optimization, never a requirement
        warnings.warn(f"tkopt: building kernels in {workers} workers failed ({type(e).__name__}: {e}); building "
                      "them one at a time", stacklevel=2)
