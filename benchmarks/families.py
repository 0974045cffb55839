"""Sweep transformers' model families through tkopt.compile on CPU: does what the coverage matrix checks for
its listed models hold for the ones it does not list?

Each family is built from its default config at tiny sizes (tkopt.models.hf.tiny_model, random weights).
Decoders (AutoModelForCausalLM, encoder-decoder families through their ForCausalLM decoder) are compiled on
a prompt and run a 3-step greedy decode with the cache fed back, token for token against eager; encoders
(AutoModel on token ids and a padding mask) are compiled and compared once. Every fusion is kept
(select="all"), so the comparison runs the fused graph. Per family: whether it ran, the
largest relative error against eager (fused ops on their torch references, float32), the fusions per layer
(attention / norm / GEMM-family) and the refusal reasons.

    python benchmarks/families.py [--out benchmarks/results/families.md] [MODEL_TYPE ...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tkopt.coverage import FAMILIES, TOLERANCE, reasons

os.environ.setdefault("TKOPT_KERNELS", "reference")

DECODERS = (
    "gpt2", "llama", "mistral", "phi", "gemma", "gptj", "qwen2", "gpt_neox", "opt", "stablelm", "starcoder2",
    "olmo", "granite", "falcon", "bloom", "codegen", "gpt_bigcode", "qwen3", "phi3", "gemma2", "gemma3_text",
    "cohere", "mpt", "xglm", "bart", "mbart", "marian", "whisper",
    "apertus", "arcee", "biogpt", "bitnet", "cohere2", "diffllama", "doge", "ernie4_5", "exaone", "exaone4", "glm",
    "glm4", "gpt_oss", "granitemoe", "helium", "hunyuan_v1_dense", "internlm3", "ministral", "mixtral", "nemotron",
    "olmo2", "olmo3", "olmoe", "persimmon", "phimoe", "qwen2_moe", "qwen3_moe", "seed_oss", "smollm3", "vaultgemma",
    "jetmoe", "ctrl", "gemma4_text", "llama4_text", "minimax", "lfm2", "blenderbot", "pegasus", "plbart", "trocr",
)
ENCODERS = (
    "bert", "roberta", "deberta-v2", "albert", "distilbert", "electra", "mobilebert", "xlm-roberta", "camembert",
    "mpnet", "ernie", "deberta",
    "megatron-bert", "roformer", "rembert", "roberta-prelayernorm", "data2vec-text", "big_bird", "modernbert", "esm",
    "nystromformer", "layoutlm", "xlm-roberta-xl", "ibert", "canine", "luke", "splinter", "flaubert", "xlm",
)
# Families left out: their tiny config fails in eager too (deepseek_v2/v3: MLA head dims; lilt: layout dims; gpt_neo,
# dbrx, squeezebert, funnel: config validation; xmod: needs a language set), or they keep no cache (openai-gpt).


@dataclass
class Row:
    model_type: str
    kind: str
    error: str | None = None
    max_rel: float | None = None
    tokens_match: bool | None = None
    fusions: dict[str, float] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _layers(model: torch.nn.Module) -> int:
    cfg = model.config
    for key in ("num_hidden_layers", "decoder_layers", "n_layer", "num_layers"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 0:
            return n
    return 1


def _greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = []
    with torch.no_grad():
        out = model(ids)
        first = out.logits
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            out = model(nxt, past_key_values=out.past_key_values)
    return torch.cat(tokens, 1), first


def sweep_one(model_type: str, kind: str) -> Row:
    import tkopt
    from tkopt.models.hf import tiny_model

    row = Row(model_type, kind)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "decoder":
                model = tiny_model(model_type, "AutoModelForCausalLM")
                fast = tkopt.compile(model, (ids,), select="all")
                want_tokens, want = _greedy(model, ids)
                got_tokens, got = _greedy(fast, ids)
                row.tokens_match = bool(torch.equal(got_tokens, want_tokens))
            else:
                model = tiny_model(model_type, "AutoModel")
                mask = torch.ones_like(ids)
                mask[1, -2:] = 0  # padding in the second row
                fast = tkopt.compile(model, (), {"input_ids": ids, "attention_mask": mask}, select="all")
                with torch.no_grad():
                    got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
                    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            row.max_rel = _rel(got, want)
        layers = _layers(model)
        rep = fast.specializations[0].report
        row.fusions = {f: sum(rep.fusions.get(k, 0) for k in kinds) / layers for f, kinds in FAMILIES.items()}
        row.refusals = sorted({r for s in fast.specializations for r in reasons(s.report)})
    except Exception as e:  # noqa: BLE001 - a failing family is a result
        tb = traceback.extract_tb(e.__traceback__)[-1]
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())[:240]} ({Path(tb.filename).name}:{tb.lineno})"
    return row


def markdown(rows: list[Row], command: str) -> str:
    import transformers

    lines = [
        "# transformers families through tkopt.compile",
        "",
        f"Command: `{command}` ({dt.date.today().isoformat()}, CPU, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, fused ops on their torch references, float32).",
        "",
        "Decoders: compiled on a 7-token prompt, then a 3-step greedy decode with the cache fed back (tokens: "
        "equal to eager's). Encoders: token ids with a padding mask. max rel: the prompt's logits (decoders) or "
        "last hidden state (encoders) against eager. Fusions per layer: attention / norm / GEMM-family.",
        "",
        "| family | kind | runs | max rel | tokens | fusions per layer | refusals |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.model_type} | {r.kind} | ✗ | | | | {len(r.refusals)} |")
            continue
        ok = r.max_rel is not None and r.max_rel <= TOLERANCE and r.tokens_match is not False
        per = "/".join(f"{r.fusions[f]:g}" for f in FAMILIES)
        tok = "" if r.tokens_match is None else ("=" if r.tokens_match else "≠")
        lines.append(f"| {r.model_type} | {r.kind} | {'✓' if ok else '✗'} | {r.max_rel:.0e} | {tok} | {per} | "
                     f"{len(r.refusals)} |")
    lines += ["", "## Errors and refusals", ""]
    for r in rows:
        if r.error or r.refusals:
            lines.append(f"- **{r.model_type}**")
            if r.error:
                lines.append(f"  - error: {r.error}")
            lines += [f"  - {x}" for x in r.refusals]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", help="model types (default: every family listed in this file)")
    p.add_argument("--out", type=Path, help="write the Markdown table here")
    a = p.parse_args()
    todo = [(m, "decoder") for m in DECODERS] + [(m, "encoder") for m in ENCODERS]
    if a.models:
        todo = [(m, k) for m, k in todo if m in a.models]
    rows = []
    for m, k in todo:
        rows.append(sweep_one(m, k))
        r = rows[-1]
        status = f"ERR {r.error}" if r.error else f"rel={r.max_rel:.1e} tokens_match={r.tokens_match} {r.fusions}"
        print(f"{m:14s} {k:8s} {status}", flush=True)
        for x in r.refusals:
            print(f"    {x}", flush=True)
    if a.out:
        a.out.write_text(markdown(rows, "python benchmarks/families.py" + "".join(f" {m}" for m in a.models)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
