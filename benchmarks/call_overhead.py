"""What one call costs the CPU, per variant: where a model's GPU work is short, the host's per-call work is its
speed (a user's loop launches no faster than the Python around each call runs).

For each model of benchmarks/whole_models.py's table and each variant: the wall time per call of calls back to
back (synchronized only at the end: the loop's rate), the CPU time per call spent before the call returns
(the launch side), and for tkopt's variants cProfile's top functions of those calls by own time.

    python benchmarks/call_overhead.py --out DIR [--models encoder_layer_8x512 ...] [--variants ...]

Results go to DIR/call_overhead.json and .md.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import pstats
import time
from pathlib import Path
from typing import Any

import torch
import whole_models as wm  # the model table and variants (run as a script, its folder is on sys.path)


def per_call(fn: Any, inputs: tuple, calls: int) -> dict[str, float]:
    """Loop rate and host time per call, in microseconds, after warm-up calls."""
    for _ in range(20):
        fn(*inputs)
    wm._sync()
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(calls):
        t = time.process_time()
        fn(*inputs)
        host += time.process_time() - t
    wm._sync()
    return {"loop_us": (time.perf_counter() - t0) / calls * 1e6, "host_cpu_us": host / calls * 1e6}


def profiled(fn: Any, inputs: tuple, calls: int) -> str:
    profiler = cProfile.Profile()
    with profiler:
        for _ in range(calls):
            fn(*inputs)
    wm._sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", choices=sorted(wm.MODELS), default=["encoder_layer_8x512"])
    p.add_argument("--variants", nargs="+", default=["eager", "inductor", "inductor_cudagraphs", "tkopt",
                                                     "tkopt_backend"])
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        m = wm.MODELS[name]
        torch.manual_seed(0)
        model = m.module()
        inputs = m.cast_inputs()
        with torch.no_grad():
            for variant in args.variants:
                fn = wm.make_variant(variant, model, inputs)
                fn(*inputs)
                row = {"model": name, "variant": variant, **per_call(fn, inputs, args.calls)}
                if variant in wm.TKOPT:
                    row["profile"] = profiled(fn, inputs, args.calls)
                rows.append(row)
                print(f"{name}/{variant}: loop {row['loop_us']:.1f} us/call, host {row['host_cpu_us']:.1f} us/call",
                      flush=True)
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    (out / "call_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Per-call host cost ({meta['date']}, {meta['device']}, torch {meta['torch']})", "",
             "| model | variant | loop us/call | host CPU us/call |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['variant']} | {r['loop_us']:.1f} | {r['host_cpu_us']:.1f} |" for r in rows]
    (out / "call_overhead.md").write_text("\n".join(lines) + "\n")
    for r in rows:
        if "profile" in r:
            print(f"--- {r['model']}/{r['variant']}\n" + "\n".join(r["profile"].splitlines()[:40]))


if __name__ == "__main__":
    main()
