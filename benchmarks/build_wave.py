"""The build wave's wall time without a GPU: every kernel a model's fused nodes will run or time on a GPU arch,
planned at its example shapes and compiled (TileLang's CUDA lowering and nvcc need no GPU) in worker
interpreters, then loaded in this process from TileLang's disk cache, as tkopt.compile does before selection.

    python benchmarks/build_wave.py [--layers 1] [--workers 2] [--arch sm90] [--serial]

The model is transformers BERT-base's layer shape (hidden 768, 12 heads, intermediate 3072, fp16) at batch 1,
sequence 128 (`--layers`: how many; they share their kernels). Caches are fresh temporary folders, tuning has no
winners: the cold compile's plan. `--serial` also compiles the same jobs one after another in this process
(a fresh cache), the time one process would take. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--arch", default="sm90", choices=("sm90", "sm80"))
    p.add_argument("--serial", action="store_true")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="tkopt-build-wave-")
    os.environ["TKOPT_CACHE_DIR"] = os.path.join(root, "tkopt")
    os.environ["TILELANG_CACHE_DIR"] = os.path.join(root, "tilelang")  # the workers inherit both

    import torch
    import transformers

    from tkopt.frontends.fx import import_fx
    from tkopt.kernels.arch import Build
    from tkopt.kernels.workers import map_in_workers
    from tkopt.passes.pipeline import run_passes
    from tkopt.targets.kernel_builds import build_job, planned_builds

    cfg = transformers.BertConfig(num_hidden_layers=args.layers)
    model = transformers.BertModel(cfg, add_pooling_layer=False).half().eval()
    ids, mask = torch.randint(0, cfg.vocab_size, (1, 128)), torch.ones(1, 128, dtype=torch.int64)
    graph = import_fx(torch.export.export(model, (ids, mask)))
    run_passes(graph, ())
    nodes = [n for n in graph.nodes if n.is_fused]
    build = Build(args.arch, "sm_90", 132)  # an H200
    jobs = list(planned_builds(nodes, torch.device("cpu"), {"device": "build_wave.py"}, build).values())
    out: dict = {"arch": args.arch, "fused nodes": len(nodes), "jobs": len(jobs),
                 "jobs by kernel": dict(collections.Counter(j.fn.split(":")[0].rsplit(".", 1)[1] for j in jobs))}
    t = time.perf_counter()
    failed = [why for why in map_in_workers(build_job, jobs, args.workers) if why is not None]
    out[f"wave s ({args.workers} workers)"] = round(time.perf_counter() - t, 1)
    out["failed"] = failed
    t = time.perf_counter()
    for job in jobs:
        build_job(job)
    out["loads here s"] = round(time.perf_counter() - t, 1)
    if args.serial:
        os.environ["TILELANG_CACHE_DIR"] = os.path.join(root, "serial")
        t = time.perf_counter()
        map_in_workers(build_job, jobs, 1)  # one fresh process: this one has them in memory now
        out["serial s (1 worker)"] = round(time.perf_counter() - t, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
