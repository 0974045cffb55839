"""The build wave without a GPU: what `tkopt.compile` builds for a model on a GPU arch, what each compile costs,
and the wave's wall time.

    python benchmarks/build_wave.py [--model bert_base_1x128] [--layers N] [--arch sm90] [--plan]
                                    [--sample] [--workers 2] [--simulate 15] [--startup-s 3] [--serial]

The model comes from benchmarks/whole_models.py's table (fp16, on the CPU here), exported as tkopt.compile
exports it (every input dim dynamic), its fused nodes planned at the example inputs and at the larger size
selection measures them at (TorchTarget.sizes), as the wave on an H200 (132 SMs) plans them: TileLang lowers for
sm90 and nvcc compiles without a GPU. `--layers` overrides the model's layer count (layers share their
kernels: the plan does not change). Caches are fresh temporary folders, tuning has no winners but the shipped ones
(tkopt/kernels/tuned/; TKOPT_SHIPPED_TUNING=0 leaves those out too): the cold compile's plan. Prints one JSON object:

- the plan: jobs per kernel family, split into defaults (what the plan holds with TKOPT_AUTOTUNE=0) and tuning
  candidates, and the distinct signatures (nodes whose compiles are the same set);
- `--plan`: that only;
- `--sample`: each distinct kind of job (family, default or candidate) compiled once in this process, seconds;
- `--simulate W`: the wave's wall time on W workers from those seconds (each job's kind's time) and a worker
  start-up of `--startup-s`, with jobs handed out as the wave does (the longest first, to the next free worker);
- otherwise the wave itself in `--workers` worker interpreters (and with `--serial`, one after another in one
  worker), then the loads in this process from TileLang's disk cache.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import os
import tempfile
import time
from typing import Any


def family(job: Any) -> str:
    """The kernel module a compile belongs to: gemm_epilogue, attention, norm."""
    return job.fn.split(":")[0].rsplit(".", 1)[1]


def plan(args: argparse.Namespace) -> tuple[list[Any], set[Any], dict[str, Any]]:
    """(the wave's compiles in its order, those the plan holds without tuning, a summary)."""
    import torch
    import whole_models as wm  # run as a script, its folder is on sys.path

    from tkopt.frontends.fx import import_fx
    from tkopt.kernels.arch import Build
    from tkopt.passes.pipeline import run_passes
    from tkopt.targets.kernel_builds import planned_builds, planned_jobs
    from tkopt.targets.torch_target import TorchTarget
    from tkopt.torch_compile import _export

    wm.DEVICE = "cpu"
    model = wm.MODELS[args.model]
    module = model.module()
    if args.layers is not None:
        module = _with_layers(module, args.layers)
    inputs = model.cast_inputs()
    graph = import_fx(_export(module, inputs, {}, True))
    run_passes(graph, ())
    nodes = [n for n in graph.nodes if n.is_fused]
    sizes = [size.dims for size in TorchTarget(inputs).sizes(graph.meta["fx_module"])[1:]]
    build = Build(args.arch, "sm_90", 132)  # an H200
    jobs = list(planned_builds(nodes, torch.device("cpu"), {"device": "build_wave.py"}, sizes, build).values())
    os.environ["TKOPT_AUTOTUNE"] = "0"
    defaults = {job for n in nodes for job in planned_jobs(n, build, sizes)}
    del os.environ["TKOPT_AUTOTUNE"]
    per_family: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"defaults": 0, "candidates": 0})
    for job in jobs:
        per_family[family(job)]["defaults" if job in defaults else "candidates"] += 1
    distinct = {frozenset(planned_jobs(n, build, sizes)): n for n in nodes}
    signatures = collections.Counter(n.op for n in distinct.values())
    summary = {"model": args.model, "arch": args.arch, "fused nodes": len(nodes),
               "sizes planned": [{str(k): v for k, v in s.items()} for s in sizes], "jobs": len(jobs),
               "jobs per family": dict(per_family), "distinct signatures": dict(signatures)}
    return jobs, defaults, summary


def _with_layers(module: Any, layers: int) -> Any:
    """A transformers model (whole_models.LastHidden) again with `layers` layers."""
    config = module.model.config
    config.num_hidden_layers = layers
    inner = type(module.model)(config).to(next(module.parameters()).dtype)
    return type(module)(inner, **module.call_kwargs).eval()


def kind(job: Any, defaults: set[Any]) -> str:
    return f"{family(job)} {'default' if job in defaults else 'candidate'}"


def sample(jobs: list[Any], defaults: set[Any]) -> dict[str, float]:
    """Seconds of one compile of each kind, in this process (imports paid before the first)."""
    import tilelang  # noqa: F401

    import tkopt.kernels.attention  # noqa: F401
    import tkopt.kernels.gemm_epilogue  # noqa: F401
    import tkopt.kernels.norm  # noqa: F401
    from tkopt.kernels.workers import compile_job

    seconds = {}
    for job in jobs:
        k = kind(job, defaults)
        if k in seconds:
            continue
        t = time.perf_counter()
        why = compile_job(job)
        seconds[k] = round(time.perf_counter() - t, 2) if why is None else why
    return seconds


def simulate(jobs: list[Any], seconds: list[float], workers: int, startup: float) -> float:
    """Wall time of `jobs` (in order, each to the next free worker) on `workers` workers that start in `startup`."""
    free = [startup] * min(workers, len(jobs))
    for s in seconds:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert_base_1x128")
    p.add_argument("--layers", type=int)
    p.add_argument("--arch", default="sm90", choices=("sm90", "sm80"))
    p.add_argument("--plan", action="store_true")
    p.add_argument("--sample", action="store_true")
    p.add_argument("--simulate", type=int, metavar="W")
    p.add_argument("--startup-s", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--serial", action="store_true")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="tkopt-build-wave-")
    os.environ["TKOPT_CACHE_DIR"] = os.path.join(root, "tkopt")
    os.environ["TILELANG_CACHE_DIR"] = os.path.join(root, "tilelang")  # the workers inherit both

    from tkopt.kernels.workers import compile_job, map_in_workers

    jobs, defaults, out = plan(args)
    if args.plan:
        print(json.dumps(out))
        return
    if args.sample or args.simulate:
        seconds = sample(jobs, defaults)
        out["seconds per job, one process"] = seconds
        if args.simulate:
            times = [seconds[kind(job, defaults)] for job in jobs]
            out[f"simulated wave s ({args.simulate} workers, start-up {args.startup_s} s)"] = round(
                simulate(jobs, times, args.simulate, args.startup_s), 1)
        print(json.dumps(out))
        return
    t = time.perf_counter()
    out["failed"] = [why for why in map_in_workers(compile_job, jobs, args.workers) if why is not None]
    out[f"wave s ({args.workers} workers)"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    for job in jobs:
        compile_job(job)
    out["loads here s"] = round(time.perf_counter() - t, 1)
    if args.serial:
        os.environ["TILELANG_CACHE_DIR"] = os.path.join(root, "serial")
        t = time.perf_counter()
        map_in_workers(compile_job, jobs, 1)  # one fresh process: this one has them in memory now
        out["serial s (1 worker)"] = round(time.perf_counter() - t, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
