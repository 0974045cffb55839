"""Whole transformer models on the GPU: tkopt against what a user already has, measured in one run.

For each model (transformers BERT-base, GPT-2, a Llama-style 8-layer decoder, ViT-B/16 and torch's
nn.TransformerEncoderLayer, built from configs with random weights, fp16; and the test suite's reference blocks,
tkopt.models.blocks) and each variant:

- eager, torch.compile (inductor), torch.compile(mode="reduce-overhead") (inductor + CUDA graphs): the anchors;
- tkopt.compile, and torch.compile(backend="tkopt"):

the first call's wall time (compile; for a model served at another size than it is compiled at, the call at
the compile size and the first at the served size), then the median latency of CUDA-event-timed calls after a warm-up,
with two input sets alternating (so no variant is timed on one cached input); then, once every variant of
the model is compiled, each is timed again in --rounds interleaved rounds (its median: the median of its
rounds), so that no variant gains or loses by its place in the run. Each tkopt variant's ratio is
against the best anchor of the same run. With --profile, torch.profiler splits each variant's GPU time by
kernel family (GEMM, attention, norm, softmax, elementwise, copy, other) and prints it against the floor:
the model's FLOPs (counted by torch's FlopCounterMode) at the matrix rate measured in the same run, and its
weights read once at the copy bandwidth measured in the same run.

    python benchmarks/whole_models.py --out DIR [--models bert_base_16x512 ...] [--variants ...] [--profile]

Results go to DIR/whole_models.json and .md after every model (atomically), so a run cut short keeps what ran.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import itertools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

DTYPE = torch.float16
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself, no claims
ANCHORS = ("eager", "inductor", "inductor_cudagraphs")
TKOPT = ("tkopt", "tkopt_backend")
FAMILIES = (  # (family, kernel-name pattern), first match wins
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("gemm", r"gemm|xmma|cutlass|cublas|wgmma|matmul|sm90_|sm80_|ampere_|hopper_"),
    ("norm", r"norm"),
    ("softmax", r"softmax"),
    ("copy", r"copy|memcpy|memset|clone|cat"),
    ("elementwise", r"triton|elementwise|vectorized|unrolled|reduce|pointwise"),
)


@dataclass
class Model:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]  # a fresh random input set per call
    # Where set, each variant is built and called once at these inputs first, then timed at `inputs`: a model
    # compiled at one size and served at another (dynamic shapes), as the Llama 1x8192 row.
    compile_inputs: Callable[[], tuple[torch.Tensor, ...]] | None = None

    def module(self) -> nn.Module:
        """The model on the benchmark's device and dtype, in eval mode."""
        return self.build().to(DEVICE, DTYPE).eval()

    def cast_inputs(self) -> tuple[torch.Tensor, ...]:
        """A fresh random input set, floating inputs in the benchmark's dtype."""
        return self.cast(self.inputs())

    @staticmethod
    def cast(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`inputs` with the floating ones in the benchmark's dtype."""
        return tuple(x.to(DTYPE) if x.is_floating_point() else x for x in inputs)


class LastHidden(nn.Module):
    """A transformers model as forward(*inputs) -> last hidden state: cache off, tensors out."""

    def __init__(self, model: nn.Module, **call_kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.call_kwargs = call_kwargs

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        # By name: the second positional parameter is not the mask everywhere (GPT2Model's is past_key_values).
        named = dict(zip((self.model.main_input_name, "attention_mask"), inputs, strict=False))
        return self.model(**named, return_dict=False, **self.call_kwargs)[0]


def _tokens(batch: int, seq: int, vocab: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randint(0, vocab, (batch, seq), device=DEVICE),
                    torch.ones(batch, seq, dtype=torch.int64, device=DEVICE))


def _hf(model_cls: str, config: Callable[[], Any], **call_kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return LastHidden(getattr(transformers, model_cls)(config()), **call_kwargs)

    return build


def _config(name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        import transformers

        return getattr(transformers, name)(**kwargs)

    return make


def _block(cls_name: str, batch: int, seq: int, **cfg: Any) -> tuple[Callable[[], nn.Module],
                                                                     Callable[[], tuple[torch.Tensor, ...]]]:
    """A reference block of tkopt.models.blocks (the test suite's models; `cfg`: its config's fields) and its own
    example inputs at a size. Imported on a call: the anchors' processes (compile_time.py) never import tkopt."""
    def build() -> nn.Module:
        from tkopt.models import blocks

        cls = getattr(blocks, cls_name)
        return cls(getattr(blocks, f"{cls_name}Config")(**cfg))

    instance = functools.cache(build)  # example_inputs reads only the config, so one instance serves every call
    return build, lambda: tuple(x.to(DEVICE) for x in instance().example_inputs(batch=batch, seq=seq))


LLAMA8 = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
MODELS = {m.name: m for m in (
    Model("bert_base_16x512", _hf("BertModel", _config("BertConfig")), _tokens(16, 512, 30522)),
    Model("gpt2_8x1024", _hf("GPT2Model", _config("GPT2Config"), use_cache=False), _tokens(8, 1024, 50257)),
    Model("llama8_4x2048", _hf("LlamaModel", _config("LlamaConfig", **LLAMA8), use_cache=False),
          _tokens(4, 2048, 32000)),
    Model("encoder_layer_8x512", lambda: nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True),
          lambda: (torch.randn(8, 512, 1024, device=DEVICE),)),
    Model("bert_base_1x128", _hf("BertModel", _config("BertConfig")), _tokens(1, 128, 30522)),
    Model("llama8_1x8192_from_4x2048",
          _hf("LlamaModel", _config("LlamaConfig", **{**LLAMA8, "max_position_embeddings": 8192}), use_cache=False),
          _tokens(1, 8192, 32000), compile_inputs=_tokens(4, 2048, 32000)),
    Model("vit_b16_32", _hf("ViTModel", _config("ViTConfig")), lambda: (torch.randn(32, 3, 224, 224, device=DEVICE),)),
    # The reference blocks: two at BERT-base's and a Llama-2k's sizes, the rest at their test configs (launch bound).
    Model("block_bert_base_8x512", *_block("BertLayer", 8, 512, hidden=768, heads=12, ffn=3072)),
    Model("block_llama_2k_4x512", *_block("LlamaBlock", 4, 512, hidden=2048, heads=16, kv_heads=4, ffn=5632)),
    Model("block_mlp_8x128", *_block("MLP", 8, 128)),
    Model("block_bert_8x128", *_block("BertLayer", 8, 128)),
    Model("block_gpt2_8x128", *_block("GPT2Block", 8, 128, max_seq=128)),
    Model("block_gpt2_sdpa_8x128", *_block("GPT2Block", 8, 128, max_seq=128, use_sdpa=True)),
    Model("block_llama_8x128", *_block("LlamaBlock", 8, 128)),
    Model("block_vit_8x128", *_block("ViTBlock", 8, 128)),
)}


def make_variant(name: str, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model)
    if name == "inductor_cudagraphs":
        return torch.compile(model, mode="reduce-overhead")
    if name == "tkopt":
        import tkopt

        return tkopt.compile(model, inputs)
    if name == "tkopt_backend":
        import tkopt  # noqa: F401 - names the backend "tkopt" for Dynamo where tkopt is not pip-installed

        return torch.compile(model, backend="tkopt")
    raise ValueError(f"unknown variant {name!r}")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_median_ms(fn: Callable[[], Any], runs: int, warmup: int, warm_s: float = 0.0) -> float:
    """Median of per-call CUDA-event times after `warmup` calls and at least `warm_s` seconds of calls
    (perf_counter on the CPU smoke run). The seconds matter after a compile: the GPU idled through it, and a
    few calls of a sub-millisecond model do not bring its clocks back (an eager anchor timed first read 0.36
    ms against 0.23 ms for the same module timed later in the same run)."""
    start = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - start < warm_s:
        fn()
        done += 1
        if done % 10 == 0:
            _sync()
    if DEVICE == "cpu":
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    _sync()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    _sync()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def ceilings() -> dict[str, float]:
    """The card's matrix rate (fp16 8192^3, random data) and copy bandwidth (1 GiB clone), measured now."""
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.float16)
    ms = cuda_median_ms(lambda: a @ b, 20, 5)
    x = torch.randn(256 * 2**20, device=DEVICE)
    copy_ms = cuda_median_ms(lambda: x.clone(), 20, 5)
    return {"tflops": 2 * 8192**3 / ms / 1e9, "copy_tb_s": 2 * x.numel() * 4 / copy_ms / 1e9}


def _gqa_sdpa_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int], *_: Any, **__: Any) -> int:
    """SDPA's FLOPs (B, H, S, D shapes) with K/V's fewer heads counted as Q's: each query head attends over its
    group's K/V as over its own (torch 2.11's counter asserts that the head counts are equal)."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, (*k[:1], q[1], *k[2:]), (*v[:1], q[1], *v[2:]))


GQA_SDPA_FLOPS = {op: _gqa_sdpa_flops for op in (torch.ops.aten._scaled_dot_product_efficient_attention,
                                                 torch.ops.aten._scaled_dot_product_flash_attention,
                                                 torch.ops.aten._scaled_dot_product_cudnn_attention)}


def floor_ms(model: nn.Module, inputs: tuple[torch.Tensor, ...], ceil: dict[str, float]) -> dict[str, float]:
    from torch.utils.flop_counter import FlopCounterMode

    # torch's fused encoder fast path is one op the counter does not know: count the ops it stands for.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with FlopCounterMode(display=False, custom_mapping=GQA_SDPA_FLOPS) as counter:
            model(*inputs)
        flops = counter.get_total_flops()
    except AssertionError:  # the counter rejects an op's shapes: no floor rather than a wrong one
        return {}
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    compute = flops / (ceil["tflops"] * 1e9)
    memory = weight_bytes / (ceil["copy_tb_s"] * 1e9)
    return {"gflop": flops / 1e9, "compute_ms": compute, "weights_ms": memory, "floor_ms": max(compute, memory)}


def family(kernel: str) -> str:
    low = kernel.lower()
    return next((fam for fam, pat in FAMILIES if re.search(pat, low)), "other")


def profile(fn: Callable[[], Any], calls: int = 5) -> dict[str, Any]:
    """GPU time per kernel family per call (ms), and the top kernels, from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    _sync()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    per_family: dict[str, float] = {}
    kernels: list[tuple[str, float]] = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if us <= 0 or ev.key.startswith(("ProfilerStep", "cuda")) and "kernel" not in ev.key.lower():
            continue
        fam = family(ev.key)
        per_family[fam] = per_family.get(fam, 0.0) + us / 1e3 / calls
        kernels.append((ev.key[:90], us / 1e3 / calls))
    kernels.sort(key=lambda kv: -kv[1])
    return {"families": per_family, "top": kernels[:12]}


DYNAMO_VARIANTS = ("inductor", "inductor_cudagraphs", "tkopt_backend")


def _dynamo_graphs() -> int:
    """How many graphs Dynamo has compiled since its last reset."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run_model(m: Model, variants: list[str], args: argparse.Namespace, ceil: dict[str, float]) -> dict[str, Any]:
    """One model's row. Dynamo starts afresh: the transformers models share LastHidden.forward, one code object,
    whose cache entries across models reached Dynamo's recompile limit within one run (H200, 2026-12-02: from
    the third model on, every torch.compile variant ran eagerly, silently). A Dynamo variant that compiles no
    graph is an error, not a number."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = m.module()
    half = [m.cast_inputs() for _ in range(2)]
    inputs, alt = half
    row: dict[str, Any] = {"model": m.name, "variants": {}}
    timed: dict[str, Callable[[], Any]] = {}  # variant -> one call, alternating the two input sets
    with torch.no_grad():
        row["floor"] = floor_ms(model, inputs, ceil)
        want = model(*inputs).float()
        for name in variants:
            v: dict[str, Any] = {}
            row["variants"][name] = v
            try:
                t0 = time.perf_counter()
                first = m.cast(m.compile_inputs()) if m.compile_inputs else inputs
                graphs = _dynamo_graphs()
                fn = make_variant(name, model, first)
                if m.compile_inputs:
                    fn(*first)
                got = fn(*inputs)
                _sync()
                if name in DYNAMO_VARIANTS and _dynamo_graphs() == graphs:
                    raise RuntimeError("Dynamo compiled no graph: the variant ran eagerly (a recompile limit?)")
                v["first_call_s"] = time.perf_counter() - t0
                err = (got.float() - want).abs().max().item()
                v["max_rel_err"] = err / max(want.abs().max().item(), 1e-30)
                sets = itertools.cycle((inputs, alt))
                call = lambda fn=fn, sets=sets: fn(*next(sets))  # noqa: E731
                v["median_ms"] = cuda_median_ms(call, args.runs, args.warmup, args.warm_s)
                timed[name] = call
                if args.profile:
                    v["profile"] = profile(lambda fn=fn: fn(*inputs))
                if name in TKOPT:
                    v["report"] = _report_summary(fn)
            except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
                v["error"] = f"{type(e).__name__}: {e}"
                v["traceback"] = traceback.format_exc(limit=10)
            print(f"  {m.name}/{name}: {_cell(v)}", flush=True)
        interleaved(timed, row["variants"], args)
    best = [row["variants"][a]["median_ms"] for a in ANCHORS if "median_ms" in row["variants"].get(a, {})]
    row["best_anchor_ms"] = min(best) if best else None
    return row


def interleaved(timed: dict[str, Callable[[], Any]], variants: dict[str, dict[str, Any]],
                args: argparse.Namespace) -> None:
    """Each variant timed again in `args.rounds` rounds, every variant once per round, the order rotated each
    round; its median_ms becomes the median of its rounds' medians (the first, sequential, timing is kept as
    sequential_ms). Timed one after another, a variant's number depends on its place: the card's clocks and
    temperature drift over a run, and tkopt's variants always came last."""
    if args.rounds < 1 or len(timed) < 2:
        return
    names = list(timed)
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rounds[name].append(cuda_median_ms(timed[name], args.runs, warmup=3, warm_s=min(args.warm_s, 0.3)))
    for name in names:
        v = variants[name]
        v["sequential_ms"], v["round_ms"] = v["median_ms"], rounds[name]
        v["median_ms"] = statistics.median(rounds[name])


def _report_summary(fn: Any) -> Any:
    import tkopt

    rep = getattr(fn, "tkopt_report", None) or getattr(tkopt, "last_report", lambda: None)()
    if rep is None:
        return None
    to_dict = getattr(rep, "to_dict", None)
    d = to_dict() if callable(to_dict) else {"fusions": getattr(rep, "fusions", None)}
    out = {k: d[k] for k in ("candidates", "fusions", "total_fused", "whole_graph", "seconds", "notes") if k in d}
    out["nodes"] = [{k: n.get(k) for k in ("node", "op", "decision", "reason", "fused_ms", "unfused_ms")}
                    for n in d.get("nodes", [])]
    return out


def _cell(v: dict[str, Any]) -> str:
    if "error" in v:
        return "FAILED " + v["error"].splitlines()[0][:120]
    return f"{v['median_ms']:.3f} ms (first call {v['first_call_s']:.1f} s, max rel err {v['max_rel_err']:.1e})"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], variants: list[str]) -> str:
    lines = ["# Whole models: tkopt against eager and torch.compile (same run)", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "Latency: median of CUDA-event-timed calls (ms), the median over interleaved rounds where the run "
             "had them (sequential_ms and round_ms in the JSON); tkopt ratios are best anchor / tkopt (higher is "
             "better). Floor: max(FLOPs at the measured matrix rate, weights once at the measured copy bandwidth).", "",
             "| model | floor ms | " + " | ".join(variants) + " | " + " | ".join(f"{t} vs best" for t in TKOPT
                                                                       if t in variants) + " |",
             "|---|---|" + "---|" * (len(variants) + sum(t in variants for t in TKOPT))]
    for r in rows:
        cells = []
        for name in variants:
            v = r["variants"].get(name, {})
            cells.append("FAILED" if "error" in v else f"{v['median_ms']:.3f}" if "median_ms" in v else "-")
        ratios = []
        for t in (t for t in TKOPT if t in variants):
            v = r["variants"].get(t, {})
            ok = "median_ms" in v and r["best_anchor_ms"]
            ratios.append(f"{r['best_anchor_ms'] / v['median_ms']:.2f}x" if ok else "-")
        floor = f"{r['floor']['floor_ms']:.3f}" if r["floor"] else "-"
        lines.append(f"| {r['model']} | {floor} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "## First call (compile) wall time, s", "", "| model | " + " | ".join(variants) + " |",
              "|---|" + "---|" * len(variants)]
    for r in rows:
        lines.append(f"| {r['model']} | " + " | ".join(
            f"{r['variants'][n]['first_call_s']:.1f}" if "first_call_s" in r["variants"].get(n, {}) else "-"
            for n in variants) + " |")
    failures = [(r["model"], n, v["error"]) for r in rows for n, v in r["variants"].items() if "error" in v]
    if failures:
        lines += ["", "## Failures", "", *(f"- {m}/{n}: {e.splitlines()[0][:300]}" for m, n, e in failures)]
    profiled = [r for r in rows if any("profile" in v for v in r["variants"].values())]
    for r in profiled:
        fams = sorted({f for v in r["variants"].values() for f in v.get("profile", {}).get("families", {})})
        f = r["floor"]
        floor = (f"floor {f['floor_ms']:.3f} ms: {f['gflop']:.0f} GFLOP -> {f['compute_ms']:.3f} ms, weights "
                 f"{f['weights_ms']:.3f} ms" if f else "no floor: the flop counter rejected the model")
        lines += ["", f"## Where the GPU time goes: {r['model']} (ms per call; {floor})", "",
                  "| variant | " + " | ".join(fams) + " | total |", "|---|" + "---|" * (len(fams) + 1)]
        for n, v in r["variants"].items():
            p = v.get("profile")
            if p:
                lines.append(f"| {n} | " + " | ".join(f"{p['families'].get(f, 0.0):.3f}" for f in fams)
                             + f" | {sum(p['families'].values()):.3f} |")
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for whole_models.json and .md")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=[*ANCHORS, *TKOPT], default=[*ANCHORS, *TKOPT])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--warm-s", type=float, default=2.0, help="seconds of calls before timing each variant")
    p.add_argument("--profile", action="store_true", help="split each variant's GPU time by kernel family")
    p.add_argument("--rounds", type=int, default=3,
                   help="then time every variant again in this many interleaved rounds (0: only one after another)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: fp32 smoke run of the script only")
    args = p.parse_args(argv)
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, torch.float16 if args.device == "cuda" else torch.float32
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("whole_models.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings() if DEVICE == "cuda" else {"tflops": 1.0, "copy_tb_s": 0.01}
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu"
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "device": device,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "command": " ".join(["benchmarks/whole_models.py", *(argv if argv is not None else sys.argv[1:])]),
            "measured ceilings": f"{ceil['tflops']:.0f} TFLOP/s fp16 matmul, {ceil['copy_tb_s']:.2f} TB/s copy",
            "env": {k: v for k, v in os.environ.items() if k.startswith("TKOPT_")}}
    rows: list[dict[str, Any]] = []
    for name in args.models:
        print(f"{name}:", flush=True)
        rows.append(run_model(MODELS[name], args.variants, args, ceil))
        _write(out / "whole_models.json", json.dumps({"meta": meta, "results": rows}, indent=2, default=str))
        _write(out / "whole_models.md", markdown(rows, meta, args.variants))
    print(markdown(rows, meta, args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
