"""Building fused nodes' kernels for the torch targets, ahead of the calls: one parallel wave of worker
interpreters that compiles every kernel selection will run or time, then loads here.

Each fused node's calls at its example shapes use known kernels: the cached tuning winner, else, where the
kernel tunes at those shapes, each tuning candidate (the probe takes the first: tuning never times a default
that is not one), else the default config (`FusedOp.compiles`, from the kernels' own `planned_kernels`). Each
is one job of the wave, deduplicated across nodes, so the wave balances and nothing compiles twice. Jobs only
compile: no kernel runs, so they need no GPU, and workers never time. TileLang's lowering holds the GIL, so
threads do not overlap builds; processes do (forked from
one interpreter that imported the kernel modules, started before the export: tkopt.kernels.workers,
`workers_ahead`), and TileLang's disk cache hands what they built to this process, which then loads
each compiled kernel into its kernels' caches: the probes that follow (one run of each distinct kernel on
random inputs of the example's shapes and strides, tuning off) only check, and tuning at the real shapes only
times (it starts no compiles of its own). Kernels this machine has built before
(recorded in the tkopt cache, `built-kernels.json`) are left to TileLang's disk cache: starting workers for
them would cost a warm compile seconds for nothing.

Sizes: compile keys are size-free (GEMM rows, attention's batch and lengths are dynamic), so the larger size
selection measures a node at too (TorchTarget.sizes, tkopt.input_sizes) tunes again over the same candidates:
it only times. What does depend on sizes, a GEMM's default tile (by M) and whether it tunes (M > 64), is
planned at each size: a GEMM of few rows at the example tunes at the larger size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from tkopt.cache import JsonFile, cache_path, digest, versions
from tkopt.fused_ops import schema, use_kernels
from tkopt.fused_ops.base import TORCH_DTYPES as DTYPES
from tkopt.fused_ops.base import InputSpec
from tkopt.input_sizes import size_at
from tkopt.ir import Node, Value
from tkopt.kernels.arch import Build
from tkopt.kernels.workers import Cancel, Compile, compile_job, default_workers, map_in_workers, zygote

log = logging.getLogger(__name__)


def example_specs(node: Node, at: Mapping[Any, int] | None = None) -> list[InputSpec]:
    """A node's inputs as (dtype, shape, strides) at the example inputs, as its calls there get them (the FX
    values' sizes and strides; a constant a pass made is contiguous); with `at` (the graph's input symbols'
    sizes at another size, TorchTarget.sizes), there. Raises ValueError for an input whose sizes the graph
    does not hold."""
    specs: list[InputSpec] = []
    for v in node.inputs:
        if v is None:
            specs.append(None)
            continue
        _check_buildable(v)
        val = getattr(v.origin, "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and val.dim() == len(v.shape):  # type: ignore[arg-type]
            specs.append((v.dtype, _concrete(val.shape, v, at), _concrete(val.stride(), v, at)))  # type: ignore[arg-type]
        elif all(isinstance(d, int) for d in v.shape):  # type: ignore[union-attr]
            specs.append((v.dtype, tuple(v.shape), _contiguous(v.shape)))  # type: ignore[arg-type]
        else:
            raise ValueError(f"input {v.name} has no example value")
    return specs


def input_specs(node: Node) -> list[InputSpec]:
    """A node's inputs as (dtype, shape, strides), contiguous, for a node without example values: its static
    dims, and its symbolic dims small but in the relation their example sizes have (equal where equal, ordered
    as ordered). A graph may name equal dims by different symbols (an export that never learnt K's and V's
    lengths are one): sizes drawn per symbol would hand the kernel shapes no call has, and it would refuse
    them. Raises ValueError for an input no kernel can be built for."""
    keys: list[list[Any] | None] = []  # per input: each dim's size or what tells its size apart
    for v in node.inputs:
        if v is None:
            keys.append(None)
            continue
        _check_buildable(v)
        keys.append([d if isinstance(d, int) else _size_key(v, axis) for axis, d in enumerate(v.shape)])  # type: ignore[arg-type]
    symbolic = {k for shape in keys if shape is not None for k in shape if not isinstance(k, int)}
    small = {k: 3 + i for i, k in enumerate(sorted(symbolic))}
    specs: list[InputSpec] = []
    for v, shape in zip(node.inputs, keys, strict=True):
        if v is None or shape is None:
            specs.append(None)
            continue
        sizes = tuple(k if isinstance(k, int) else small[k] for k in shape)
        specs.append((v.dtype, sizes, _contiguous(sizes)))  # type: ignore[arg-type]
    return specs


def probe_specs(node: Node, at: Mapping[Any, int] | None = None) -> list[InputSpec]:
    """What a node's kernels are built and probed on: its example inputs' shapes and strides where the graph
    holds them (a GEMM's tile depends on its rows, attention's kernel on its inputs' layouts), else small ones;
    with `at` (the input symbols' sizes at another size selection measures), there."""
    if at is not None:
        return example_specs(node, at)
    try:
        return example_specs(node)
    except ValueError:
        return input_specs(node)


def _check_buildable(v: Value) -> None:
    if v.dtype not in DTYPES:
        raise ValueError(f"input {v.name} has dtype {v.dtype}, which no kernel takes")
    if v.shape is None:
        raise ValueError(f"input {v.name} has unknown rank")
    if any(d is None for d in v.shape):
        raise ValueError(f"input {v.name} has a dim of unknown size")


def _concrete(dims: Sequence[Any], v: Value, at: Mapping[Any, int] | None = None) -> tuple[int, ...]:
    """Sizes (or strides) as ints: at the symbols' sizes `at` where they decide them, else the example's."""
    out = []
    for d in dims:
        hint = d
        if isinstance(d, torch.SymInt):
            size = size_at(d, at) if at else None
            hint = d.node.hint if size is None else size
        if hint is None:
            raise ValueError(f"input {v.name} has a size with no example value")
        out.append(int(hint))
    return tuple(out)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


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
    """Seeded random tensors of `specs` on `device`, with the specs' strides (broadcast dims of stride 0
    included), drawn there (the example's sizes can be large); bools mostly true: masks that keep most
    positions."""
    gen = torch.Generator(device).manual_seed(0)
    tensors: list[torch.Tensor | None] = []
    for spec in specs:
        if spec is None:
            tensors.append(None)
            continue
        dtype, shape, strides = DTYPES[spec[0]], spec[1], spec[2]
        storage = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        if dtype == torch.bool:
            t = torch.rand(storage, generator=gen, device=device) > 0.1
        else:
            t = torch.randn(storage, generator=gen, device=device)
        tensors.append(t.to(dtype).as_strided(shape, strides))
    return tensors


def planned_jobs(node: Node, build: Build, sizes: Sequence[Mapping[Any, int]] = ()) -> list[Compile]:
    """The compiles a node's calls at its example shapes use (module docstring), and at each of `sizes` (the
    input symbols' sizes selection measures it at too: a GEMM with few rows at the example tunes there); none
    where its inputs cannot be described or its op refuses them (the probe then says why)."""
    return list(dict.fromkeys(job for at in (None, *sizes) for job in _compiles_at(node, build, at)))


def _compiles_at(node: Node, build: Build, at: Mapping[Any, int] | None = None) -> list[Compile]:
    """The compiles a node's calls use at the example (`at` None) or at the input symbols' sizes `at`."""
    op = schema(node.op)
    try:
        return op.compiles(probe_specs(node, at), op.full_attrs(node.attrs), build)
    except Exception:  # noqa: BLE001 - the probe, or the measurement there, runs the kernel and reports it
        return []


# Seconds one compile of each kind takes for sm90 (benchmarks/build_wave.py --sample: BERT-base's kernels, one
# process, 2026-12-01): TileLang's lowering and nvcc (cicc parsing TileLang's CUDA templates: ~2.2 s of each).
# Only their order matters: the wave hands out the longest first, so that none starts last and runs alone.
BUILD_SECONDS = {"tkopt.kernels.attention:compile_gpu": 8.0, "tkopt.kernels.gemm_epilogue:kernel_for_key": 3.6,
                 "tkopt.kernels.norm:compile_norm": 3.0}


def planned_builds(nodes: Sequence[Node], device: torch.device, fingerprint: dict[str, Any],
                   sizes: Sequence[Mapping[Any, int]] = (), build: Build | None = None) -> dict[str, Compile]:
    """The compiles of `nodes` (at the example and `sizes`), each once, by their key in `built-kernels.json`
    (`fingerprint`: the device and runtimes; `build`: what kernels are built for, by default what `device`
    runs), the longest first (BUILD_SECONDS; a kind it does not name counts as a GEMM)."""
    build = build or Build.here(device)
    jobs = {digest(versions(), fingerprint, job): job for n in nodes for job in planned_jobs(n, build, sizes)}
    gemm = BUILD_SECONDS["tkopt.kernels.gemm_epilogue:kernel_for_key"]
    return dict(sorted(jobs.items(), key=lambda item: -BUILD_SECONDS.get(item[1].fn, gemm)))


def record_built(nodes: Sequence[Node], device: torch.device, fingerprint: dict[str, Any],
                 sizes: Sequence[Mapping[Any, int]] = ()) -> None:
    """Note that the kernels of `nodes` (planned at the example and `sizes`) were built on this machine (their
    probes passed)."""
    _remember(planned_builds(nodes, device, fingerprint, sizes))


def probe_record(node: Node, device: torch.device, fingerprint: dict[str, Any],
                 at: Mapping[Any, int] | None = None) -> str | None:
    """The key under which a node's passed probe is kept in `built-kernels.json`: its op, attributes and inputs'
    layouts at the example (or at the symbols' sizes `at`), and the compiles its calls there use (a tuning winner
    is another kernel than the candidate probed before tuning), on this device with these versions: the same
    kernel checked on the same inputs would pass again. None where its inputs cannot be described (it is probed
    every time)."""
    try:
        specs = probe_specs(node, at)
    except ValueError:
        return None
    jobs = _compiles_at(node, Build.here(device), at)
    return "probe:" + digest(versions(), fingerprint, node.op, schema(node.op).full_attrs(node.attrs), specs, jobs)


def probes_passed() -> set[str]:
    """The `probe_record` keys of the probes that passed on this machine."""
    return {key for key in JsonFile(cache_path("built-kernels.json")).read() if key.startswith("probe:")}


def record_probes(keys: Sequence[str | None]) -> None:
    """Remember passed probes by their `probe_record` keys."""
    _remember(k for k in keys if k is not None)


def _remember(keys: Iterable[str]) -> None:
    """Add `keys` to `built-kernels.json`, writing only those it lacks."""
    built = JsonFile(cache_path("built-kernels.json"))
    known = built.read()
    for key in dict.fromkeys(k for k in keys if k not in known):
        try:
            built.update(key, True)
        except OSError:  # a read-only cache: the builds and probes run again next time, nothing worse
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


@contextlib.contextmanager
def workers_ahead() -> Iterator[None]:
    """The wave's workers' zygote (tkopt.kernels.workers), started now, where kernels run and a wave may start
    workers, so that it imports the kernel modules while the caller exports and fuses (3-4 s, which every cold
    wave waited for); ended with the block. A warm compile, whose wave starts none, pays those imports on a
    core the export leaves idle."""
    if not use_kernels() or (build_workers() or default_workers(2)) < 2:
        yield
        return
    with zygote(sorted({fn.split(":")[0] for fn in BUILD_SECONDS})):
        yield


def prebuild(nodes: Sequence[Node], device: torch.device, fingerprint: dict[str, Any],
             sizes: Sequence[Mapping[Any, int]] = (), workers: int | None = None,
             cancel: Cancel | None = None, beside: bool = False) -> list[Compile]:
    """Build the kernels the calls of `nodes` need at their example shapes and at `sizes` (the input symbols'
    sizes selection measures them at too; module docstring), those not built here before, in parallel worker
    interpreters where builds would overlap (`workers` defaults to TKOPT_BUILD_WORKERS, else one per core but
    one; 1: none): two or more, or a lone one `beside` the caller's own work (TorchTarget.probe's `meanwhile`:
    the first calls of programs that compile in this process), after which it would otherwise build, as it is
    loaded. A failed wave only warns: what it left is compiled as it is loaded. Returns the compiles to `load`
    here: every planned one but those that failed in a worker. Loads and runs nothing on the device, so it can
    run beside other work (TorchTarget.probe's thread), which may `cancel` it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # a torch.compile backend runs under Dynamo's fake mode
        jobs = planned_builds(nodes, device, fingerprint, sizes)
    known = JsonFile(cache_path("built-kernels.json")).read()
    todo = {key: job for key, job in jobs.items() if key not in known}
    workers = workers or build_workers() or default_workers(max(len(todo), 2))
    failed: dict[str, str] = {}
    if workers >= 2 and len(todo) >= (1 if beside else 2):
        try:
            results = map_in_workers(compile_job, list(todo.values()), workers, cancel)
            failed = {key: why for key, why in zip(todo, results, strict=True) if why is not None}
            if failed:  # a kernel that cannot be built fails again where it is used, and is reported there
                log.info("tkopt: %d of %d kernel builds failed in the workers (%s); they build here as they are used",
                         len(failed), len(todo), next(iter(failed.values())))
        except Exception as e:  # noqa: BLE001 - parallel builds are an optimization, never a requirement
            warnings.warn(f"tkopt: building kernels in {workers} workers failed ({type(e).__name__}: {e}); "
                          "building them one at a time", stacklevel=2)
    return [job for key, job in jobs.items() if key not in failed]


def load(compiles: Sequence[Compile]) -> None:
    """Put `compiles` in this process's kernel caches, from TileLang's disk cache where the wave built them
    (compiled here where it did not run), so that probes and tuning find them there. Not in prebuild's thread:
    loading a kernel is a CUDA call, which a CUDA graph captured meanwhile on another thread could refuse."""
    for job in compiles:
        compile_job(job)  # a failure is reported where the kernel is used
