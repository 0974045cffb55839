"""Sweep transformers' model families through tkopt.compile on CPU: does what the coverage matrix checks for
its listed models hold for the ones it does not list?

Each family is built from its default config at tiny sizes (tkopt.models.hf.tiny_model, random weights).
Decoders (AutoModelForCausalLM, encoder-decoder families through their ForCausalLM decoder) are compiled on
a prompt and run a 3-step greedy decode with the cache fed back, token for token against eager; encoders
(AutoModel on token ids and a padding mask), vision models (AutoModel on a batch of images) and audio models
(AutoModel on raw waveforms) are compiled and compared once. Vision families whose sizes are lists per stage
(Swin, ConvNeXt, SegFormer, ...) keep their default config, at its image size. Every fusion is kept
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
    "longformer",
)
VISION = (
    "vit", "deit", "beit", "dinov2", "dinov2_with_registers", "data2vec-vision", "yolos", "ijepa", "mlcd",
    "clip_vision_model", "siglip_vision_model", "aimv2_vision_model", "mobilevit", "hiera", "vitdet",
    "swiftformer", "efficientnet", "mobilenet_v2", "poolformer", "bit", "cvt", "resnet", "regnet",
    "swin", "swinv2", "convnext", "convnextv2", "levit", "segformer", "pvt", "pvt_v2", "glpn", "focalnet",
)
# Their sizes are lists per stage, which TINY's integers would break: built from their default config.
DEFAULT_CONFIG = ("swin", "swinv2", "convnext", "convnextv2", "levit", "segformer", "pvt", "pvt_v2", "glpn",
                  "focalnet")
AUDIO = ("wav2vec2", "hubert", "wavlm", "data2vec-audio", "sew", "unispeech")
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
    depths = getattr(cfg, "depths", getattr(cfg, "depth", None))  # multi-stage vision models: blocks per stage
    if isinstance(depths, list | tuple) and depths and all(isinstance(d, int) for d in depths):
        return sum(depths)
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


def _pixels_model(model_type: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """A vision model and a batch of two images at its config's size (64 for the tiny configs' patch models)."""
    from tkopt.models.hf import _transformers, tiny_config

    tf = _transformers()
    cfg = tf.AutoConfig.for_model(model_type) if model_type in DEFAULT_CONFIG else tiny_config(model_type)
    given = getattr(cfg, "image_size", 64)
    size = given[0] if isinstance(given, list | tuple) else given
    if model_type not in DEFAULT_CONFIG and size > 64 and getattr(cfg, "patch_size", 0) in (14, 16):
        size = 64
        cfg.image_size = [size, size] if isinstance(given, list | tuple) else size  # YOLOS: (height, width)
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(cfg).eval()
    x = torch.randn(2, getattr(cfg, "num_channels", 3), size, size, generator=torch.Generator().manual_seed(0))
    return model, x


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
            elif kind == "encoder":
                model = tiny_model(model_type, "AutoModel")
                mask = torch.ones_like(ids)
                mask[1, -2:] = 0  # padding in the second row
                fast = tkopt.compile(model, (), {"input_ids": ids, "attention_mask": mask}, select="all")
                with torch.no_grad():
                    got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
                    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            else:
                if kind == "vision":
                    model, x = _pixels_model(model_type)
                else:
                    model = tiny_model(model_type, "AutoModel")
                    x = torch.randn(2, 4000, generator=torch.Generator().manual_seed(0))  # 0.25 s at 16 kHz
                fast = tkopt.compile(model, (x,), select="all")
                with torch.no_grad():
                    got, want = fast(x).to_tuple()[0], model(x).to_tuple()[0]
            row.max_rel = _rel(got, want)
        layers = _layers(model)
        # Fusions per layer: the first program's (later ones are the same model at other sizes), or where
        # torch.export could not export the model, every graph of the tkopt backend's (Dynamo's pieces of it)
        reports = fast.backend_reports or [s.report for s in fast.specializations]
        counted = reports if fast.backend_reports else reports[:1]
        row.fusions = {f: sum(r.fusions.get(k, 0) for r in counted for k in kinds) / layers
                       for f, kinds in FAMILIES.items()}
        row.refusals = sorted({x for r in reports for x in reasons(r)})
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
        "equal to eager's). Encoders: token ids with a padding mask. Vision: two images; audio: two 0.25 s "
        "waveforms. max rel: the prompt's logits (decoders) or the first output (the others) against eager. "
        "Fusions per layer: attention / norm / GEMM-family.",
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
    todo = ([(m, "decoder") for m in DECODERS] + [(m, "encoder") for m in ENCODERS] + [(m, "vision") for m in VISION]
            + [(m, "audio") for m in AUDIO])
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
