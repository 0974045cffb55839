"""Compile time: tkopt.compile against torch.compile (default mode), cold and warm, each in a fresh process.

For each model (benchmarks/whole_models.py's table and variants) four subprocesses run one after another,
so nothing is warm in memory: torch.compile cold (a fresh TORCHINDUCTOR_CACHE_DIR) and warm (the same dir
again), tkopt.compile cold (fresh TKOPT_CACHE_DIR, TILELANG_CACHE_DIR and inductor cache) and warm (the same
dirs again). Each measures the wall time from building the compiled object to the end of its first call
(synchronized), then times a few calls after it, so a compile that is cheap because it left work for later
calls (or ran something else) is visible, and checks the first output against eager's. The tkopt runs add
the report's laps (passes, kernels, selection, emit, whole graph). A model compiled at one size and served at
another (`compile_inputs`: the Llama-style model compiled at 4x2048, served at 1x8192) is first called at its
compile size, then at its serving size: that first call there recompiles (torch.compile's automatic dynamic
shapes, tkopt.compile's dynamic export) and is timed on its own ("resize", with the laps of its own report
beside the first call's).

    python benchmarks/compile_time.py --out DIR [--models encoder_layer_8x512 ...] [--device cpu]

Results go to DIR/compile_time.json and .md after every measurement (atomically). The issue's bar (H200): cold
<= 2x torch.compile's, warm <= 1.2x. --device cpu is a smoke run of the script (fp32, tiny model; no claims).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import io
import json
import os
import platform
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import whole_models as wm  # the model table and variants (run as a script, its folder is on sys.path)
from torch import nn

VARIANTS = {"torch_compile": "inductor", "tkopt": "tkopt"}  # ours -> whole_models.make_variant's name
# What --compile-bytecode compiles ahead: the packages either tool imports while it compiles.
BYTECODE_PACKAGES = ("torch", "triton", "sympy", "tilelang", "tvm", "tvm_ffi", "tkopt")
RUNS = ("cold", "warm")
LAPS = ("export", "passes", "kernels", "selection", "emit", "whole graph")
# A CPU smoke run's model: the encoder layer's shape at sizes the CPU compiles in seconds, served at another.
TINY = wm.Model("encoder_layer_tiny_1x24_from_2x16",
                lambda: nn.TransformerEncoderLayer(64, 4, 128, batch_first=True),
                lambda: (torch.randn(1, 24, 64, device=wm.DEVICE),),
                compile_inputs=lambda: (torch.randn(2, 16, 64, device=wm.DEVICE),))
MODELS = {**wm.MODELS, TINY.name: TINY}


def child(model_name: str, variant: str, calls: int, profile: str | None = None) -> dict[str, Any]:
    """One measurement in this (fresh) process: build the compiled object, call it once (at its compile size, then
    at its serving size where they differ), time `calls` more.
    With `profile` (a file name), cProfile's top functions (cumulative) of the build and first call go in
    "profile", and the whole profile to that file (pstats)."""
    m = MODELS[model_name]
    torch.manual_seed(0)
    model = m.module()
    inputs = m.cast_inputs()
    first = m.cast(m.compile_inputs()) if m.compile_inputs else inputs
    out: dict[str, Any] = {}
    if variant == "tkopt":
        import tkopt  # noqa: F401 - imported up front, as a user's script does (torch already is)
    profiler = cProfile.Profile() if profile else None
    with torch.no_grad():
        t0 = time.perf_counter()
        with profiler or contextlib.nullcontext():
            fn = wm.make_variant(VARIANTS[variant], model, first)
            out["build_s"] = time.perf_counter() - t0
            got = fn(*first)
            wm._sync()
            out["first_call_s"] = time.perf_counter() - t0
            first_report = getattr(fn, "tkopt_report", None)
            reports = {"first": first_report}
            if m.compile_inputs:
                t1 = time.perf_counter()
                got = fn(*inputs)
                wm._sync()
                out["resize_s"] = time.perf_counter() - t1
                served = getattr(fn, "tkopt_report", None)
                if served is not first_report:  # else the first program serves this size too
                    reports["served"] = served
        out["modules"] = len(sys.modules)  # imported by the build and first call (and before them)
        out["imported_tilelang"] = "tilelang" in sys.modules
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
            out["profile"] = text.getvalue()
            profiler.dump_stats(profile)
        after = []
        for _ in range(calls):
            t = time.perf_counter()
            fn(*inputs)
            wm._sync()
            after.append((time.perf_counter() - t) * 1e3)
        out["after_ms"] = after
        want = model(*inputs).float()
        out["max_rel_err"] = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    laps = {call: {"seconds": dict(report.seconds), "fused": f"{report.total_fused} of {len(report.nodes)}",
                   "winner": report.whole_graph.winner if report.whole_graph else "tkopt"}
            for call, report in reports.items() if report is not None}
    if laps:
        out["laps"] = laps
    return out


def measure(model: str, variant: str, run: str, dirs: Path, args: argparse.Namespace,
            bytecode: Path | None = None) -> dict[str, Any]:
    """One child process; `dirs` holds its caches (fresh for "cold", the cold run's again for "warm"), `bytecode`
    the packages' compiled bytecode (compile_bytecode)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(dirs / "inductor"), TRITON_CACHE_DIR=str(dirs / "triton"))
    if bytecode is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode)
    if variant == "tkopt":
        env.update(TKOPT_CACHE_DIR=str(dirs / "tkopt"), TILELANG_CACHE_DIR=str(dirs / "tilelang"))
    cmd = [sys.executable, __file__, "--child", model, variant, "--device", args.device, "--calls", str(args.calls),
           *(["--profile-to", str(Path(args.out, f"{model}-{variant}-{run}.prof"))] if args.profile else [])]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.child_timeout} s"}
    result: dict[str, Any] = {"process_s": time.perf_counter() - t0}
    last = p.stdout.strip().splitlines()[-1:] if p.returncode == 0 else []
    if not last:
        lines = p.stderr.strip().splitlines()
        # The table shows the error's last lines; the JSON keeps the traceback, which a CUDA fault needs to be
        # placed (its own message only says it may have come from elsewhere).
        result["error"] = f"exit {p.returncode}: " + " | ".join(lines[-3:])
        result["stderr_tail"] = "\n".join(lines[-80:])
        return result
    result.update(json.loads(last[0]))
    return result


def compile_bytecode(prefix: Path) -> float:
    """Compile the packages either tool imports into `prefix`, every child's PYTHONPYCACHEPREFIX, as pip does when it
    installs a package; returns the seconds it took. Where no bytecode cache is kept (the H200 machine), each fresh
    process compiles every module it imports from source: 3.0 s of torch.compile's warm first call and 3.7 s of
    tkopt.compile's in their profiles (2026-12-03, call 2), a cost no installed package has."""
    import compileall
    import importlib.util

    t0 = time.perf_counter()
    sys.pycache_prefix = str(prefix)
    for name in BYTECODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            # a package's own path, links unresolved: the bytecode's name in the prefix is the path imports see
            compileall.compile_dir(folder, quiet=2, workers=os.cpu_count() or 1)
    return time.perf_counter() - t0


def ratios(row: dict[str, Any], key: str = "first_call_s") -> dict[str, float | None]:
    """tkopt / torch.compile per run, of the first call's seconds (`key`; "resize_s": of the first call served)."""
    out: dict[str, float | None] = {}
    for run in RUNS:
        ours, theirs = (row["runs"].get(v, {}).get(run, {}).get(key) for v in ("tkopt", "torch_compile"))
        out[run] = ours / theirs if ours is not None and theirs else None
    return out


def _s(v: dict[str, Any], key: str = "first_call_s") -> str:
    return "FAILED" if "error" in v else f"{v[key]:.1f}" if key in v else "-"


def _ratio(q: float | None) -> str:
    return "-" if q is None else f"{q:.2f}x"


def _after(v: dict[str, Any]) -> str:
    return f"{statistics.median(v['after_ms']):.3g}" if v.get("after_ms") else "-"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Compile time: tkopt.compile against torch.compile (default mode), fresh processes", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "First call: wall seconds from building the compiled object to the end of its first call. Cold: empty "
             "caches; warm: the cold run's caches. Ratio: tkopt / torch.compile (the bar: cold <= 2, warm <= 1.2). "
             "After: median ms of the calls that followed. Error: tkopt's output against eager's, relative.", "",
             "| model | torch.compile cold | warm | tkopt cold | warm | cold ratio | warm ratio | after ms "
             "(torch.compile / tkopt, warm) | error (tkopt cold / warm) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tc, tk, q = r["runs"].get("torch_compile", {}), r["runs"].get("tkopt", {}), r["ratios"]
        cells = [_s(tc.get("cold", {})), _s(tc.get("warm", {})), _s(tk.get("cold", {})), _s(tk.get("warm", {})),
                 *(_ratio(q[run]) for run in RUNS),
                 f"{_after(tc.get('warm', {}))} / {_after(tk.get('warm', {}))}",
                 " / ".join(f"{tk[run]['max_rel_err']:.1e}" if "max_rel_err" in tk.get(run, {}) else "-"
                            for run in RUNS)]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    resized = [r for r in rows if "resize" in r]
    if resized:
        lines += ["", "Served at another size: its first call there (a recompile), s. Ratio: tkopt / torch.compile.",
                  "", "| model | torch.compile cold | warm | tkopt cold | warm | cold ratio | warm ratio |",
                  "|---|---|---|---|---|---|---|"]
        for r in resized:
            tc, tk, q = r["runs"].get("torch_compile", {}), r["runs"].get("tkopt", {}), r["resize"]
            cells = [_s(x.get(run, {}), "resize_s") for x in (tc, tk) for run in RUNS]
            lines.append(f"| {r['model']} | " + " | ".join([*cells, *(_ratio(q[run]) for run in RUNS)]) + " |")
    lines += ["", "## tkopt.compile's laps (report.seconds), s: of the first call, and of the first call served at "
              "another size where that compiled again", "",
              "| model | run | call | " + " | ".join(LAPS) + " | fused | calls run |",
              "|---|---|---|" + "---|" * (len(LAPS) + 2)]
    for r in rows:
        for run in RUNS:
            for call, lap in r["runs"].get("tkopt", {}).get(run, {}).get("laps", {}).items():
                cells = [f"{lap['seconds'][k]:.1f}" if k in lap["seconds"] else "-" for k in LAPS]
                lines.append(f"| {r['model']} | {run} | {call} | " + " | ".join(cells)
                             + f" | {lap['fused']} | {lap['winner']} |")
    failures = [(r["model"], v, run, x["error"]) for r in rows for v, runs in r["runs"].items()
                for run, x in runs.items() if "error" in x]
    if failures:
        lines += ["", "## Failures", "", *(f"- {m}/{v}/{run}: {e[:300]}" for m, v, run, e in failures)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for compile_time.json and .md")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                   help=f"default: encoder_layer_8x512 (cuda), {TINY.name} (cpu)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: fp32 smoke run of the script only")
    p.add_argument("--calls", type=int, default=5, help="calls timed after the first")
    p.add_argument("--child-timeout", type=float, default=900.0, help="seconds one measurement may take")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="cold (empty caches) and/or warm (the cold run's caches; needs cold)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile each compile and first call (top functions in the JSON; pstats files in --out)")
    p.add_argument("--compile-bytecode", action="store_true",
                   help="compile both tools' Python packages to bytecode first, as an install does (compile_bytecode)")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--profile-to", help=argparse.SUPPRESS)  # a child's pstats file
    args = p.parse_args(argv)
    if "warm" in args.runs and "cold" not in args.runs:
        p.error("--runs warm reads the caches a cold run fills: give cold too")
    wm.DEVICE, wm.DTYPE = args.device, torch.float16 if args.device == "cuda" else torch.float32
    if args.child:
        print(json.dumps(child(*args.child, args.calls, args.profile_to)))
        return 0
    if args.out is None:
        p.error("--out is required")
    # A timeout's SIGTERM as an exception: subprocess.run then kills the running measurement, not orphaning it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("compile_time.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    models = args.models or ["encoder_layer_8x512" if args.device == "cuda" else TINY.name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(["benchmarks/compile_time.py", *(argv if argv is not None else sys.argv[1:])]),
            "env": {k: v for k, v in os.environ.items() if k.startswith("TKOPT_")},
            # Without bytecode caches every fresh process compiles each module it imports from source, both tools'
            "bytecode caches": "compiled ahead" if args.compile_bytecode
            else "not written" if sys.dont_write_bytecode else "written"}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="compile_time.") as tmp:
        bytecode = Path(tmp, "bytecode") if args.compile_bytecode else None
        if bytecode is not None:
            meta["bytecode compiled ahead, s"] = round(compile_bytecode(bytecode), 1)
        for model in models:
            print(f"{model}:", flush=True)
            row: dict[str, Any] = {"model": model, "runs": {}}
            rows.append(row)
            for variant in VARIANTS:
                dirs = Path(tmp, model, variant)
                for run in args.runs:
                    v = row["runs"].setdefault(variant, {})[run] = measure(model, variant, run, dirs, args, bytecode)
                    print(f"  {variant} {run}: " + (v["error"] if "error" in v else
                          f"first call {v['first_call_s']:.1f} s, after {_after(v)} ms"
                          + (f", first call served {v['resize_s']:.1f} s" if "resize_s" in v else "")
                          + "".join(f", laps ({call}) {json.dumps({k: round(s, 1) for k, s in lap['seconds'].items()})}"
                                    for call, lap in v.get("laps", {}).items())), flush=True)
                    row["ratios"] = ratios(row)
                    if MODELS[model].compile_inputs:
                        row["resize"] = ratios(row, "resize_s")
                    wm._write(out / "compile_time.json", json.dumps({"meta": meta, "results": rows}, indent=2,
                                                                    default=str))
                    wm._write(out / "compile_time.md", markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
