"""CPU, "never slower": tkopt against what a CPU user already has, on transformers models, in one run.

For each model (transformers BERT-base, GPT-2 and a 4-layer Llama with hidden 512, built from configs
with random weights; float32; batch 1, sequence 128 by default) it measures:

- torch: eager, and `tkopt.compile` (measured selection, the default);
- ONNX (the dynamo exporter, dynamic batch and sequence): plain ONNX Runtime, ORT's transformer optimizer
  (onnxruntime.transformers.optimizer) as a second anchor, and `tkopt optimize --target cpu` run in ORT on
  its op library;

each variant's median and fastest latency over `--runs` calls after a warm-up, the variants of one side
timed in turn within each round (so drift hits them alike; ORT's sessions with their workers' spinning off, as
tkopt's own race has them: tkopt.ort.run.session says why), with the ratios `eager / tkopt.compile` and
`plain ORT / tkopt` of both (> 1: tkopt faster; on a shared machine the fastest call is the steadier
number, other processes only ever add time), and the machine's load average. It also records each tkopt
compile's wall time twice: cold (an empty TKOPT_CACHE_DIR; TileLang's own cache as found) and warm (the
second compile, whose decisions come from the cache), and what measured selection kept.

    python benchmarks/cpu_never_slower.py --out benchmarks/results/cpu-never-slower [--models bert gpt2 llama]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def build(name: str) -> tuple[torch.nn.Module, str, int, int]:
    """(HF model wrapped as forward(input_ids, attention_mask) -> hidden states, ORT optimizer model type,
    heads, hidden)."""
    import transformers as tf

    from tkopt.models.hf import TensorsIn

    torch.manual_seed(0)
    if name == "bert":
        cfg = tf.BertConfig()
        model, kind = tf.BertModel(cfg, add_pooling_layer=False), "bert"
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    elif name == "gpt2":
        cfg = tf.GPT2Config()
        model, kind = tf.GPT2Model(cfg), "gpt2"
        heads, hidden = cfg.n_head, cfg.n_embd
    elif name == "llama":
        cfg = tf.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, max_position_embeddings=2048)
        model, kind = tf.LlamaModel(cfg), "gpt2"  # the optimizer has no Llama type; its gpt2 fusions are generic
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    else:
        raise ValueError(f"unknown model {name!r}")
    return TensorsIn(model, ["input_ids", "attention_mask"], use_cache=False).eval(), kind, heads, hidden


def rounds(variants: dict[str, Callable[[], Any]], runs: int, warmup: int) -> dict[str, dict[str, float]]:
    """{"median": ms per variant, "min": ms per variant}; each round calls every variant once, in turn, in
    alternating order."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants.items())
    for i in range(runs):
        for k, fn in order if i % 2 == 0 else order[::-1]:  # alternate the order: no variant always goes first
            t0 = time.perf_counter()
            fn()
            samples[k].append((time.perf_counter() - t0) * 1e3)
    return {"median": {k: statistics.median(v) for k, v in samples.items()},
            "min": {k: min(v) for k, v in samples.items()}}


def summary(report: Any) -> dict[str, Any]:
    w = report.whole_graph
    return {"candidates": sum(report.passes.fusions.values()), "kept": report.total_fused,
            "decisions": {d: len(report.decided(d)) for d in ("kept", "slower", "kernel_failed", "declined")},
            "kept_ops": sorted({n.op for n in report.decided("kept")}),
            "speedups": {op: [round(min(xs), 2), round(max(xs), 2)] for op in sorted({n.op for n in report.nodes})
                         if (xs := [n.speedup for n in report.nodes if n.op == op and n.speedup is not None])},
            "whole_graph": None if w is None else {"winner": w.winner, "times_ms": w.times_ms},
            "seconds": report.seconds}


def torch_side(model: torch.nn.Module, inputs: tuple, runs: int, warmup: int) -> dict[str, Any]:
    import tkopt

    t0 = time.perf_counter()
    fast = tkopt.compile(model, inputs)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = tkopt.compile(model, inputs)
    warm = time.perf_counter() - t0
    with torch.no_grad():
        want = model(*inputs)
        err = ((fast(*inputs) - want).abs().max() / want.abs().max()).item()
        ms = rounds({"eager": lambda: model(*inputs), "tkopt.compile": lambda: fast(*inputs)}, runs, warmup)
    return {"ms": ms, "ratio": {k: v["eager"] / v["tkopt.compile"] for k, v in ms.items()}, "max_rel_err": err,
            "compile_s": {"cold": cold, "warm": warm}, "report": summary(fast.tkopt_report),
            "warm_cached": all(d.cached for d in again.tkopt_report.nodes)}


def onnx_side(model: torch.nn.Module, inputs: tuple, kind: str, heads: int, hidden: int, runs: int, warmup: int,
              work: Path) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort
    from onnxruntime.transformers.optimizer import optimize_model

    import tkopt
    from tkopt.models.export import export_onnx
    from tkopt.ort import run
    from tkopt.ort.run import make_inputs
    from tkopt.ort.session import library_for

    path = export_onnx(model, inputs, work / "model.onnx", dynamo=True)
    feeds = {k: v for k, v in zip(("input_ids", "attention_mask"), (t.numpy() for t in inputs), strict=True)}
    names = {i.name for i in ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names} or make_inputs(__import__("onnx").load(str(path)))
    plain = run.session(path, spinning=False)
    opt_path = work / "ort_optimized.onnx"
    try:
        optimized = optimize_model(str(path), model_type=kind, num_heads=heads, hidden_size=hidden)
        optimized.save_model_to_file(str(opt_path))
        ort_opt, opt_error = run.session(opt_path, spinning=False), None
    except Exception as e:  # noqa: BLE001 - the second anchor is optional; say why it is missing
        ort_opt, opt_error = None, f"{type(e).__name__}: {e}"
    out = work / "model.tkopt.onnx"
    t0 = time.perf_counter()
    _, report = tkopt.optimize_onnx(path, out, report=False, target="cpu")
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, again = tkopt.optimize_onnx(path, work / "again.tkopt.onnx", report=False, target="cpu")
    warm = time.perf_counter() - t0
    fused = run.session(out, library_for(out), spinning=False)
    want = plain.run(None, feeds)[0]
    err = float(np.abs(fused.run(None, feeds)[0] - want).max() / np.abs(want).max())
    variants = {"ort": plain, "ort_transformers_optimizer": ort_opt, "tkopt": fused}
    ms = rounds({k: lambda s=s: s.run(None, feeds) for k, s in variants.items() if s is not None}, runs, warmup)
    return {"ms": ms, "ratio": {k: v["ort"] / v["tkopt"] for k, v in ms.items()},
            "ratio_vs_ort_optimizer": {k: v["ort_transformers_optimizer"] / v["tkopt"] for k, v in ms.items()
                                       if "ort_transformers_optimizer" in v},
            "ort_optimizer_error": opt_error, "max_rel_err": err,
            "compile_s": {"cold": cold, "warm": warm}, "report": summary(report),
            "warm_cached": all(d.cached for d in again.nodes)}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def ms(side: dict[str, Any], k: str) -> str:
        m = side["ms"]
        return f"{m['median'][k]:.1f} ({m['min'][k]:.1f})" if k in m["median"] else "-"

    def x(ratios: dict[str, float]) -> str:
        return f"{ratios['median']:.2f}x ({ratios['min']:.2f}x)" if ratios else "-"

    lines = ["# CPU: tkopt against eager torch and plain ONNX Runtime (same run)", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "Latency in ms: median (fastest) of calls timed in rounds, every variant once per round. Ratios: anchor "
             "/ tkopt, of medians (of fastest calls); >= 1.00 means tkopt is not slower. Compile: wall seconds of the "
             "first tkopt compile (empty decision and kernel-object cache) and of the second (decisions cached).", "",
             "| model | eager | tkopt.compile | vs eager | plain ORT | ORT transformers optimizer | tkopt ORT cpu "
             "| vs plain ORT | vs ORT optimizer | fused kept (torch / ORT) | whole graph runs (torch / ORT) "
             "| compile s cold/warm (torch / ORT) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, o = r.get("torch", {}), r.get("onnx", {})
        if "error" in t or "error" in o:
            lines.append(f"| {r['model']} | FAILED: {t.get('error') or o.get('error')} |")
            continue
        tr, orr = t["report"], o["report"]
        lines.append(
            f"| {r['model']} | {ms(t, 'eager')} | {ms(t, 'tkopt.compile')} | {x(t['ratio'])} | {ms(o, 'ort')} "
            f"| {ms(o, 'ort_transformers_optimizer')} | {ms(o, 'tkopt')} | {x(o['ratio'])} "
            f"| {x(o['ratio_vs_ort_optimizer'])} "
            f"| {tr['kept']}/{tr['candidates']} / {orr['kept']}/{orr['candidates']} "
            f"| {tr['whole_graph']['winner']} / {orr['whole_graph']['winner']} "
            f"| {t['compile_s']['cold']:.0f}/{t['compile_s']['warm']:.0f} / {o['compile_s']['cold']:.0f}/"
            f"{o['compile_s']['warm']:.0f} |")
    lines += ["", "Per model, what measured selection decided (the JSON beside this file has every number):", ""]
    for r in rows:
        for side in ("torch", "onnx"):
            s = r.get(side, {})
            if s.get("report"):
                rep = s["report"]
                lines.append(f"- {r['model']} {side}: {rep['decisions']}, kept ops {rep['kept_ops']}, speedup range "
                             f"per op {rep.get('speedups')}, whole graph "
                             f"{rep['whole_graph']}, stage seconds "
                             + ", ".join(f"{k} {v:.1f}" for k, v in rep["seconds"].items()))
            if s.get("ort_optimizer_error"):
                lines.append(f"- {r['model']}: ORT's transformer optimizer failed: {s['ort_optimizer_error']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for cpu_never_slower.json and .md")
    p.add_argument("--models", nargs="+", default=["bert", "gpt2", "llama"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TKOPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="tkopt-cache-")  # cold tkopt caches
    from tkopt.files import write_atomic
    from tkopt.targets import cpu_model

    meta = {"command": "python " + " ".join(sys.argv), "date": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "versions": f"torch {torch.__version__}, onnxruntime {__import__('onnxruntime').__version__}, "
                        f"transformers {__import__('transformers').__version__}, python {platform.python_version()}",
            "inputs": f"batch {args.batch}, sequence {args.seq}, float32, random weights",
            "load average at start (1, 5, 15 min)": os.getloadavg()}
    rows: list[dict[str, Any]] = []
    for name in args.models:
        model, kind, heads, hidden = build(name)
        g = torch.Generator().manual_seed(0)
        inputs = (torch.randint(0, 1000, (args.batch, args.seq), generator=g),
                  torch.ones(args.batch, args.seq, dtype=torch.int64))
        row: dict[str, Any] = {"model": name}
        work = Path(tempfile.mkdtemp(prefix=f"cpu-{name}-"))
        for side in ("torch", "onnx"):
            try:
                if side == "torch":
                    row[side] = torch_side(model, inputs, args.runs, args.warmup)
                else:
                    row[side] = onnx_side(model, inputs, kind, heads, hidden, args.runs, args.warmup, work)
            except Exception as e:  # noqa: BLE001 - one failing side must not lose the others' numbers
                row[side] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name} {side}: {json.dumps(row[side], default=str)[:400]}", flush=True)
        rows.append(row)
        meta["load average at end (1, 5, 15 min)"] = os.getloadavg()
        write_atomic(out / "cpu_never_slower.json", json.dumps({"meta": meta, "rows": rows}, indent=1,
                                                               default=str).encode())
        write_atomic(out / "cpu_never_slower.md", markdown(rows, meta).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
