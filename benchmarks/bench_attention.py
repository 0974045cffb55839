"""Benchmark flash_attention (sm90 and forced sm80) against torch SDPA, same run, same inputs.

Usage (on the GPU): python benchmarks/bench_attention.py [--prewarm N [--prewarm-only]] [--out DIR] [--quick]
[--short [--only NAME ...]]
(device run: see benchmarks/results/attention.md for the exact command; `--prewarm N` compiles this
benchmark's kernels with N processes first, `--prewarm N --prewarm-only` also the GPU tests' kernels; run
the GPU tests with `python -m pytest -m gpu tests/kernels/test_attention.py`).
Prints a table: shape, causal, ms and TFLOP/s for SDPA and ours, ratio ours/SDPA (speed, >1 is faster).
FLOPs: 4 * B * Hq * Sq * Skv * D (two GEMMs), halved for causal (Sq == Skv).
Also: cold compile time (fresh TileLang cache dir, one key) and warm load (disk cache, fresh process).
Tuning: TKOPT_AUTOTUNE=1 makes pick_config time the candidates in tkopt/kernels/attention.py TUNE_CANDIDATES
(for the headline and d64 shapes only, to stay inside the device budget); every candidate's timing goes to
the log and to bench_attention.json ("tuning"). The rows "sm90 pipelined" / "sm90 plain" run the headline
shapes with the sm90 default config forced to each loop schedule (`pipelined` True / False).
`--short` instead times the whole-model attention nodes (`SHORT_CASES`: the encoders' at sequence 512, head
dim 64; GPT-2's and the Llama-style model's, causal with a key padding mask and without) as CUDA-graph
replays (GPU time, as tkopt's node selection times them) for every sm90 tuning candidate, against SDPA, plus
ours launched eagerly (host cost included); writes bench_attention_short.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def flops(b, hq, sq, skv, d, causal):
    f = 4.0 * b * hq * sq * skv * d
    return f / 2 if causal else f


def bench(fn, rep_ms=300):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_case(name, b, hq, hkv, s, d, causal, arch, dtype=torch.float16, tune=True, do_sdpa=True, config=None):
    from tkopt.kernels import attention as A

    torch.manual_seed(0)
    # Several input sets, rotated, so repeated runs are not served from L2 (each set ~ 8*16*2048*128*2*3 B).
    n_sets = 2
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
        sets.append((q, k, v))
    out = torch.empty_like(sets[0][0])
    os.environ["TKOPT_AUTOTUNE"] = "1" if tune else "0"
    t0 = time.perf_counter()
    q, k, v = sets[0]
    A.flash_attention(q, k, v, causal=causal, out=out, arch=arch, config=config)  # compile / load / tune
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    gqa = hq != hkv
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    err = rel_err(out, ref)
    it = [0]

    def ours():
        q, k, v = sets[it[0] % n_sets]
        it[0] += 1
        A.flash_attention(q, k, v, causal=causal, out=out, arch=arch, config=config)

    def sdpa():
        q, k, v = sets[it[0] % n_sets]
        it[0] += 1
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    gkey_cfg = A.last_config.get(arch)
    t_ours = bench(ours)
    t_sdpa = bench(sdpa) if do_sdpa else float("nan")
    fl = flops(b, hq, s, s, d, causal)
    row = dict(
        name=name, arch=arch, B=b, Hq=hq, Hkv=hkv, S=s, D=d, causal=causal, dtype=str(dtype).split(".")[-1],
        ms_ours=t_ours, ms_sdpa=t_sdpa, tflops_ours=fl / t_ours / 1e9, tflops_sdpa=fl / t_sdpa / 1e9,
        speedup=t_sdpa / t_ours, rel_err_vs_sdpa=err, first_call_s=first_s, config=gkey_cfg,
    )  # fmt: skip
    return row


def cold_and_warm(tmp_cache: str):
    """Cold compile: fresh TILELANG_CACHE_DIR, new process. Warm load: same dir again, new process."""
    code = (
        "import time,torch;t=time.perf_counter();import tkopt.kernels.attention as A;"
        "q=torch.randn(1,16,256,128,device='cuda',dtype=torch.float16);"
        "A.flash_attention(q,q[:, :16],q[:, :16],causal=True, config=A.default_config('sm90',128));"
        "torch.cuda.synchronize();print('T=%.2f'%(time.perf_counter()-t))"
    )
    env = dict(os.environ, TILELANG_CACHE_DIR=tmp_cache, TKOPT_AUTOTUNE="0")
    res = {}
    for label in ("cold_compile_s", "warm_load_s"):
        p = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("T=")]
        res[label] = float(line[0][2:]) if line else f"failed: {p.stderr[-500:]}"
    return res


def qkv(b, hq, hkv, sq, skv, d, layout, dtype):
    """Random q, k, v in `layout`: "bhsd", "bshd", or "mha" (BHSD views of (seq, batch, embed) projections,
    as nn.MultiheadAttention makes them: SBHD in memory)."""

    def one(h, s):
        if layout == "mha":
            return torch.randn(s, b, h * d, device="cuda", dtype=dtype).view(s, b, h, d).permute(1, 2, 0, 3)
        return torch.randn(*((b, h, s, d) if layout == "bhsd" else (b, s, h, d)), device="cuda", dtype=dtype)

    return one(hq, sq), one(hkv, skv), one(hkv, skv)


# whole_models' attention nodes: nn.TransformerEncoderLayer(1024, 16) at 8x512, whose q/k/v are "mha" views;
# BERT-base 16x512, whose padding mask tkopt takes out of its (B, 1, S, S) mask as a (B, 1, 1, S) key padding
# mask; the decoders', whose causal And padding mask tkopt splits into causal=1 and a key padding mask:
# (name, B, Hq, Hkv, S, D, causal, layout, mask kind). Masks keep everything, as the benchmarks' inputs do; the
# "padded" rows time the same node with one key of every batch row masked (the kernels' masked path).
SHORT_CASES = [
    ("encoder 8x512", 8, 16, 16, 512, 64, False, "mha", None),
    ("encoder 8x512 contiguous", 8, 16, 16, 512, 64, False, "bhsd", None),
    ("bert 16x512 keys", 16, 12, 12, 512, 64, False, "bshd", "bool"),
    ("bert 16x512 no mask", 16, 12, 12, 512, 64, False, "bshd", None),
    ("gpt2 8x1024 causal+keys", 8, 12, 12, 1024, 64, True, "bhsd", "bool"),
    ("gpt2 8x1024 causal", 8, 12, 12, 1024, 64, True, "bhsd", None),
    ("llama 4x2048 gqa causal+keys", 4, 16, 4, 2048, 128, True, "bshd", "bool"),
    ("llama 4x2048 gqa causal", 4, 16, 4, 2048, 128, True, "bshd", None),
]


def short_cases(only: list[str] | None = None) -> list[tuple]:
    """SHORT_CASES, or those whose name contains one of `only`."""
    return [c for c in SHORT_CASES if not only or any(o in c[0] for o in only)]


def short_specs(only: list[str] | None = None):
    from tkopt.kernels import attention as A

    return [("sm90", "float16", 1, hq, hkv, d, causal, layout, mk, dict(cfg))
            for _, _, hq, hkv, _, d, causal, layout, mk in short_cases(only)
            for cfg in A.tune_candidates("sm90", d, masked=mk is not None)]  # fmt: skip


def short_mask(kind, b, s, padded: bool = False):
    """A SHORT_CASES mask, "bool" key padding (B, 1, 1, S), that keeps every key, or with `padded` all but
    every row's last key."""
    if kind is None:
        return None
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
    if padded:
        mask[..., -1] = False
    return mask


def short_row(name, b, hq, hkv, s, d, causal, layout, mk):
    """One SHORT_CASES row: each tuning candidate and SDPA as CUDA-graph replays, and ours launched eagerly.
    SDPA gets what the unfused graph gives it: a causal key padding mask as one (B, 1, S, S) mask (SDPA takes
    no mask with is_causal); with a mask and causal, "sdpa causal" is eager's fast path, given no mask. Ours gets
    the mask's per-row summary (`kept_rows`) computed once, as a model's graph computes it for all its layers:
    computed in every call, its reduction added about 6 us to BERT's 53 us node (H100, 2026-12-07)."""
    from tkopt.cuda_graphs import capture
    from tkopt.kernels import attention as A

    torch.manual_seed(0)
    q, k, v = qkv(b, hq, hkv, s, s, d, layout, torch.float16)
    lay = "bhsd" if layout == "mha" else layout
    mask = short_mask(mk, b, s)
    kept = None if mask is None else A.kept_rows(mask)
    qt, kt, vt = (t if lay == "bhsd" else t.transpose(1, 2) for t in (q, k, v))
    row = dict(name=name, B=b, Hq=hq, Hkv=hkv, S=s, D=d, causal=causal, layout=layout, mask=mk,
               layouts=A.kernel_layouts(q, k, v, lay, strided=A.reads_strided("sm90"))[0])  # fmt: skip
    sdpa = dict(enable_gqa=hq != hkv)
    if mask is None:
        fns = {"sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **sdpa)}
    else:
        full = mask & torch.ones(s, s, dtype=torch.bool, device="cuda").tril() if causal else mask
        fns = {"sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=full, **sdpa)}
        if causal:
            fns["sdpa causal"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **sdpa)
    cands = A.tune_candidates("sm90", d, masked=mk is not None)
    for cfg in cands:
        label = "ours " + config_label(cfg)
        fns[label] = lambda cfg=cfg: A.flash_attention(q, k, v, causal=causal, mask=mask, kept=kept, layout=lay,
                                                       arch="sm90", config=cfg)  # fmt: skip
    ref = fns["sdpa"]()
    for label, fn in fns.items():
        try:
            graph, out = capture(fn, q.device)
            row[label + " (graph)"] = bench(graph.replay)
            if label.startswith("ours"):
                row[label + " rel err"] = rel_err(out if lay == "bhsd" else out.transpose(1, 2), ref)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the other numbers
            row[label + " (graph)"] = f"failed: {e!r}"[:300]
    first = next(x for x in fns if x.startswith("ours"))
    row[first + " (eager)"] = bench(fns[first])
    if mask is not None:
        padded = short_mask(mk, b, s, padded=True)
        kept_padded = A.kept_rows(padded)
        graph, _ = capture(lambda: A.flash_attention(q, k, v, causal=causal, mask=padded, kept=kept_padded, layout=lay,
                                                     arch="sm90", config=cands[0]), q.device)  # fmt: skip
        row[first + " padded (graph)"] = bench(graph.replay)
    return row


def config_label(cfg: dict) -> str:
    """A tile config as a row label: "128x128 t256 s2 pipelined", "mb2" added where it asks for 2 CTAs per SM."""
    sched = "pipelined" if cfg.get("pipelined") else "plain"
    label = f"{cfg['block_M']}x{cfg['block_N']} t{cfg['threads']} s{cfg['num_stages']} {sched}"
    return label + (f" mb{cfg['min_blocks']}" if cfg.get("min_blocks", 1) > 1 else "")


def run_short(out_dir, only: list[str] | None = None):
    rows = []
    for case in short_cases(only):
        rows.append(short_row(*case))
        print(json.dumps(rows[-1], default=str), flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_attention_short.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)


def _warm_one(spec):
    """Compile (or load) one kernel in a worker interpreter by calling the wrapper on small tensors."""
    import traceback

    os.environ["TKOPT_AUTOTUNE"] = "0"
    sys.path.insert(0, "tests/kernels")
    from tkopt.kernels.attention import flash_attention

    arch, dtype, b, hq, hkv, d, causal, layout, mk, cfg = spec
    sq, skv = 70, 90
    q, k, v = qkv(b, hq, hkv, sq, skv, d, layout, getattr(torch, dtype))
    mask = None
    if mk == "add":
        mask = torch.randn(b, 1, sq, skv, device="cuda")
    elif mk == "bool":
        mask = torch.rand(b, 1, 1, skv, device="cuda") > 0.3
    t = time.perf_counter()
    try:
        flash_attention(q, k, v, causal=causal, mask=mask, layout="bhsd" if layout == "mha" else layout, arch=arch,
                        config=cfg)
        torch.cuda.synchronize()
        return spec, time.perf_counter() - t, None
    except Exception:
        return spec, time.perf_counter() - t, traceback.format_exc()[-800:]


def schedule_config(pipelined: bool, d: int = 128) -> dict:
    """The sm90 default tile config with the loop schedule forced (the "sm90 pipelined" / "sm90 plain" rows)."""
    from tkopt.kernels import attention as A

    return {**A.default_config("sm90", d), "pipelined": pipelined}


def warm_specs(tests: bool = True):
    """Every kernel this benchmark uses, and with `tests` those of the GPU tests too (so one parallel pass
    fills TileLang's disk cache)."""
    from tkopt.kernels import attention as A

    specs = []
    if tests:
        sys.path.insert(0, "tests/kernels")
        import test_attention as TA

        for variant in TA.GPU_VARIANTS:
            for dtype in TA.GPU_DTYPES:
                for case, (b, hq, hkv, _sq, _skv, d, causal, layout, mk) in TA.GPU_CASES.items():
                    if not TA.gpu_case_enabled(dtype, case, variant):
                        continue
                    arch, cfg = TA.gpu_variant_config(variant, dtype, d)
                    specs.append((arch, str(dtype).split(".")[-1], b, hq, hkv, d, causal, layout, mk, cfg))
        specs.append(("sm90", "float16", 1, 4, 4, 64, False, "bhsd", None, None))  # dynamic-lengths test
    for causal in (False, True):
        for d in (128, 64):
            for cfg in A.tune_candidates("sm90", d):
                specs.append(("sm90", "float16", 1, 16, 16, d, causal, "bhsd", None, dict(cfg)))
            specs.append(("sm90", "float16", 1, 16, 16, d, causal, "bhsd", None, None))
        for pipelined in (True, False):
            specs.append(("sm90", "float16", 1, 16, 16, 128, causal, "bhsd", None, schedule_config(pipelined)))
        specs.append(("sm90", "float16", 1, 32, 8, 128, causal, "bhsd", None, None))
        specs.append(("sm80", "float16", 1, 16, 16, 128, causal, "bhsd", None, None))
    seen, out = set(), []
    for s_ in specs:
        # A None config compiles the default one: the same kernel as that config given explicitly.
        arch, dtype, b, hq, hkv, d, causal, layout, mk, cfg = s_
        if cfg is None and dtype != "float32":
            cfg = A.default_config(arch, d)
        key = json.dumps((arch, dtype, b, hq, hkv, d, causal, layout, mk, sorted((cfg or {}).items())), default=str)
        if key not in seen:
            seen.add(key)
            out.append(s_)
    return out


def prewarm(workers: int, tests: bool = True, short: bool = False, only: list[str] | None = None):
    import bench_attention  # this script under its module name: workers import that, never __main__

    from tkopt.kernels.workers import map_in_workers

    specs = short_specs(only) if short else warm_specs(tests)
    t = time.perf_counter()
    res = map_in_workers(bench_attention._warm_one, specs, workers)
    wall = time.perf_counter() - t
    fails = [r for r in res if r[2]]
    times = sorted(r[1] for r in res)
    print(f"prewarm: {len(specs)} kernels, {workers} workers, {wall:.1f} s wall; per-kernel compile "
          f"median {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s; {len(fails)} failed", flush=True)  # fmt: skip
    for spec, _, err in fails:
        print("PREWARM FAIL", spec, err, flush=True)
    return dict(n=len(specs), wall_s=wall, median_s=times[len(times) // 2], max_s=times[-1], failed=len(fails))


def tuning_records():
    """The flash_attention tuning records in the tuning cache ({key: {config, ms, timings}}), per arch."""
    import glob

    from tkopt.kernels.tuning import cache_dir

    recs = {}
    for path in sorted(glob.glob(os.path.join(cache_dir(), "tune-flash_attention-*.json"))):
        try:
            with open(path) as f:
                recs[os.path.basename(path)] = json.load(f)
        except (OSError, ValueError) as e:
            recs[os.path.basename(path)] = repr(e)
    return recs


def write_outputs(out_dir, dev, rows, cw, tuning) -> str:
    """The markdown table (and, with out_dir, bench_attention.md / .json written there)."""
    lines = [
        "| case | arch | B,Hq,Hkv,S,D | causal | SDPA ms | SDPA TFLOP/s | ours ms | ours TFLOP/s | ours/SDPA | "
        "rel err | first call s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['arch']} | {r['B']},{r['Hq']},{r['Hkv']},{r['S']},{r['D']} | "
                         f"{r['causal']} | ERROR {r['error'][:120]} |||||||")  # fmt: skip
            continue
        lines.append(
            f"| {r['name']} | {r['arch']} | {r['B']},{r['Hq']},{r['Hkv']},{r['S']},{r['D']} | {r['causal']} | "
            f"{r['ms_sdpa']:.3f} | {r['tflops_sdpa']:.0f} | {r['ms_ours']:.3f} | {r['tflops_ours']:.0f} | "
            f"{r['speedup']:.2f}x | {r['rel_err_vs_sdpa']:.1e} | {r['first_call_s']:.1f} |"
        )
    lines.append(f"\ncold compile (new process, empty TileLang cache, 1 kernel): {cw.get('cold_compile_s')} s; "
                 f"warm load (new process, disk cache): {cw.get('warm_load_s')} s")  # fmt: skip
    table = "\n".join(lines)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_attention.json"), "w") as f:
            json.dump(dict(device=dev, rows=rows, cold_warm=cw, tuning=tuning), f, indent=1)
        with open(os.path.join(out_dir, "bench_attention.md"), "w") as f:
            f.write(table + "\n")
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--prewarm", type=int, default=0, help="compile every kernel first with N processes")
    ap.add_argument("--prewarm-only", action="store_true")
    ap.add_argument("--short", action="store_true", help="only SHORT_CASES (the whole models' nodes)")
    ap.add_argument("--only", nargs="*", help="--short: the cases whose name contains one of these")
    args = ap.parse_args()
    if args.prewarm:
        prewarm(args.prewarm, tests=args.prewarm_only, short=args.short, only=args.only)
        if args.prewarm_only:
            return
    if args.short:
        run_short(args.out, args.only)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}")
    tune = not args.no_tune
    cases = [
        ("headline", 8, 16, 16, 2048, 128, False, "sm90", tune),
        ("headline", 8, 16, 16, 2048, 128, True, "sm90", tune),
        ("d64", 8, 16, 16, 2048, 64, False, "sm90", tune),
        ("d64", 8, 16, 16, 2048, 64, True, "sm90", tune),
        ("gqa", 8, 32, 8, 2048, 128, False, "sm90", False),
        ("gqa", 8, 32, 8, 2048, 128, True, "sm90", False),
        ("sm80-on-h200", 8, 16, 16, 2048, 128, False, "sm80", False),
        ("sm80-on-h200", 8, 16, 16, 2048, 128, True, "sm80", False),
    ]
    cases = [c + (None,) for c in cases]
    schedules = [  # the two loop schedules on the headline, same tile config (right after it: the main question)
        ("sm90 pipelined" if p else "sm90 plain", 8, 16, 16, 2048, 128, causal, "sm90", False, schedule_config(p))
        for causal in (False, True)
        for p in (True, False)
    ]
    cases = cases[:2] + schedules + cases[2:]
    if args.quick:
        cases = cases[:2]
    rows = []
    for name, b, hq, hkv, s, d, causal, arch, tn, cfg in cases:
        try:
            row = run_case(name, b, hq, hkv, s, d, causal, arch, tune=tn, config=cfg)
        except Exception as e:  # report and continue: one failure must not lose the other numbers
            row = dict(name=name, arch=arch, B=b, Hq=hq, Hkv=hkv, S=s, D=d, causal=causal, error=repr(e)[-400:])
        rows.append(row)
        print(json.dumps(row), flush=True)
    tuning = tuning_records()
    print(json.dumps(dict(tuning=tuning)), flush=True)
    # Written once before the (slow) cold/warm compile measurement and again after it, so that a run cut
    # short by a device time limit still leaves the table.
    write_outputs(args.out, dev, rows, {}, tuning)
    cw = cold_and_warm(os.path.join(args.out or "/tmp", "tl_cache_coldwarm"))
    print(json.dumps(cw))
    print(write_outputs(args.out, dev, rows, cw, tuning))


if __name__ == "__main__":
    main()
