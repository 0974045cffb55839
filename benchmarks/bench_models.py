"""Whole-model GPU benchmark: eager vs torch.compile (inductor) vs tkopt.compile, per kernel arch.

For each model config (BERT-base-like and Llama-like layers at realistic sizes first, then the
small reference blocks) and each forced kernel variant (TKOPT_ARCH=sm90, sm80), runs
tkopt.bench_torch.bench_module in fp16 on the GPU: per-output errors against eager, median
latency (CUDA events) of eager / inductor / tkopt, and per fused node the custom op against the
fx nodes it replaced. Inductor is timed once per model (on the first arch) since it does not
depend on TKOPT_ARCH. Jobs run in priority order under a wall-clock budget (--budget-s); a job
that would start after the budget is listed as skipped, and a failing job is recorded, not fatal.
Results are written after every job (atomically) to <out>/bench_models.json and .md.

    python benchmarks/bench_models.py --out benchmarks/results/models
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TKOPT_AUTOTUNE", "0")  # heuristic tile configs: tuning would not fit the budget

import torch  # noqa: E402

from tkopt.bench_torch import bench_module  # noqa: E402
from tkopt.models import blocks  # noqa: E402


@dataclass
class ModelConfig:
    name: str
    cls: type[torch.nn.Module]
    cfg: Any
    batch: int
    seq: int


BIG = [
    ModelConfig("bert_base_layer", blocks.BertLayer, blocks.BertLayerConfig(hidden=768, heads=12, ffn=3072),
                batch=8, seq=512),
    ModelConfig("llama_2k_block", blocks.LlamaBlock,
                blocks.LlamaBlockConfig(hidden=2048, heads=16, kv_heads=4, ffn=5632), batch=4, seq=512),
]
SMALL = [
    ModelConfig("mlp", blocks.MLP, None, batch=8, seq=128),
    ModelConfig("bert_layer", blocks.BertLayer, None, batch=8, seq=128),
    ModelConfig("gpt2_block", blocks.GPT2Block, blocks.GPT2BlockConfig(max_seq=128), batch=8, seq=128),
    ModelConfig("gpt2_block_sdpa", blocks.GPT2Block, blocks.GPT2BlockConfig(max_seq=128, use_sdpa=True),
                batch=8, seq=128),
    ModelConfig("llama_block", blocks.LlamaBlock, None, batch=8, seq=128),
    ModelConfig("vit_block", blocks.ViTBlock, None, batch=8, seq=128),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def build(mc: ModelConfig, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = mc.cls(mc.cfg).eval()
    inputs = model.example_inputs(batch=mc.batch, seq=mc.seq)
    model = model.to("cuda", dtype)
    inputs = tuple(x.to("cuda", dtype) if x.is_floating_point() else x.to("cuda") for x in inputs)
    return model, inputs


def run_job(mc: ModelConfig, arch: str, dtype: str, inductor: bool, args: argparse.Namespace) -> dict[str, Any]:
    os.environ["TKOPT_ARCH"] = arch
    t0 = time.perf_counter()
    model, inputs = build(mc, DTYPES[dtype])
    r = bench_module(model, inputs, runs=args.runs, warmup=args.warmup, inductor=inductor, nodes=not args.no_nodes,
                     name=mc.name)
    d = r.to_dict()
    d.update(model=mc.name, arch=arch, dtype=dtype, batch=mc.batch, seq=mc.seq, wall_s=time.perf_counter() - t0)
    return d


def _fmt(x: Any, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None or isinstance(x, str) else format(x, spec) + suffix


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# tkopt model benchmark (eager vs torch.compile vs tkopt.compile)", "",
        f"- date: {meta['date']}", f"- device: {meta['device']}", f"- torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"Python {meta['python']}", f"- command: `{meta['command']}`",
        "- latency: median of CUDA-event timed calls; speedups are eager median / variant median", "",
        "| model | arch | dtype | batch x seq | eager ms | inductor ms | inductor CUDA graphs ms | tkopt ms "
        "| tkopt no graphs ms | tkopt + inductor ms | tkopt vs eager | best tkopt vs inductor "
        "| best tkopt vs inductor CUDA graphs | max rel err | fused nodes | node speedup (geomean) | wall s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in results:
        if "error" in d or "skipped" in d:
            lines.append(f"| {d['model']} | {d['arch']} | {d['dtype']} | | | | | | | | | | | | | | | "
                         f"{d.get('skipped') or 'FAILED: ' + d['error'].splitlines()[0][:160]} |")
            continue
        t, s = d["timings"], d["summary"]
        ind = t.get("inductor", {}).get("median_ms")
        ind_cg = t.get("inductor_cudagraphs", {}).get("median_ms")
        hyb = t.get("tkopt_inductor", {}).get("median_ms")
        tk = min(t["tkopt"]["median_ms"], hyb or float("inf"))
        lines.append(
            f"| {d['model']} | {d['arch']} | {d['dtype']} | {d['batch']}x{d['seq']} | {_fmt(t['eager']['median_ms'])} "
            f"| {_fmt(ind)} | {_fmt(ind_cg)} | {_fmt(t['tkopt']['median_ms'])} "
            f"| {_fmt(t.get('tkopt_no_graphs', {}).get('median_ms'))} | {_fmt(hyb)} "
            f"| {_fmt(s['speedups'].get('tkopt'), '.2f', 'x')} | {_fmt(ind / tk if ind else None, '.2f', 'x')} "
            f"| {_fmt(ind_cg / tk if ind_cg else None, '.2f', 'x')} | {_fmt(s['max_rel_error'], '.2e')} "
            f"| {s['fused_nodes']} | {_fmt(s['node_speedup_geomean'], '.2f')} | {d['wall_s']:.0f} "
            f"| {'ok' if s['ok'] else 'MISMATCH'} |")
    lines += ["", "## Per fused node (custom op vs the fx nodes it replaced, on its real inputs)", ""]
    for d in results:
        if not d.get("nodes"):
            continue
        lines += [f"### {d['model']} / {d['arch']}", "", "| node | replaced | max rel | fused ms | unfused ms "
                  "| speedup | note |", "|---|---|---|---|---|---|---|"]
        for n in d["nodes"]:
            rel = max((o["max_rel"] for o in n["outputs"] if not isinstance(o["max_rel"], str)), default=None)
            fused, unfused = (n["fused"] or {}).get("median_ms"), (n["unfused"] or {}).get("median_ms")
            lines.append(f"| {n['node']} | {n['replaced']} | {_fmt(rel, '.2e')} | {_fmt(fused)} | {_fmt(unfused)} "
                         f"| {_fmt(n['speedup'], '.2f', 'x')} | {n['note']} |")
        lines.append("")
    notes = [f"- {d['model']}/{d['arch']}: {n}" for d in results for n in d.get("notes", [])]
    return "\n".join(lines + (["## Notes", "", *notes, ""] if notes else []))


def _status(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return row["skipped"]
    if "error" in row:
        return "FAILED " + row["error"].splitlines()[0]
    s = row["summary"]
    return (f"tkopt {_fmt(s['speedups'].get('tkopt'), '.2f')}x vs eager, max rel {_fmt(s['max_rel_error'], '.2e')}, "
            f"{row['wall_s']:.0f} s")


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for bench_models.json and bench_models.md")
    p.add_argument("--models", nargs="+", help="model names (default: all, big ones first)")
    p.add_argument("--archs", nargs="+", default=["sm90", "sm80"], choices=["sm90", "sm80"])
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=180.0, help="start no job after this many seconds")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--no-nodes", action="store_true", help="skip the per-fused-node rows")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_models.py needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = {m.name: m for m in BIG + SMALL}
    chosen = [configs[n] for n in args.models] if args.models else BIG + SMALL
    big = [m for m in chosen if m in BIG]
    small = [m for m in chosen if m not in BIG]
    # Priority: the big configs on every arch, then the small ones; inductor on each model's first arch only.
    jobs = [(m, a) for group in (big, small) for a in args.archs for m in group]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "env": {k: v for k, v in os.environ.items() if k.startswith("TKOPT_") and k != "TKOPT_ARCH"}}
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    for mc, arch in jobs:
        row = {"model": mc.name, "arch": arch, "dtype": args.dtype}
        if time.perf_counter() - start > args.budget_s:
            row["skipped"] = f"skipped: over the {args.budget_s:.0f} s budget"
        else:
            inductor = not args.no_inductor and arch == args.archs[0]
            try:
                row = run_job(mc, arch, args.dtype, inductor, args)
            except Exception as e:  # noqa: BLE001 - one failing config must not lose the others' numbers
                row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
            torch.cuda.empty_cache()
        results.append(row)
        print(f"[{time.perf_counter() - start:6.1f}s] {mc.name}/{arch}: {_status(row)}", flush=True)
        _write(out / "bench_models.json", json.dumps({"meta": meta, "results": results}, indent=2, default=str))
        _write(out / "bench_models.md", markdown(results, meta))
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
