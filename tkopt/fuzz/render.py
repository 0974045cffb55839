"""A GraphSpec as Python source: an nn.Module spelled the way model code spells it, plus its inputs.

The source is the single form of a fuzzed graph: the fuzzer imports it to get the module, and a
failure's reproducer is the same source with a call to the failing check appended. Each block
writes its own parameters (`self.b<i>_...`) and forward lines on the hidden state `h`.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

from .spec import Block, GraphSpec

FILLS = {"-inf": 'float("-inf")', "-1e4": "-1e4", "min": "torch.finfo(h.dtype).min", "-1e9": "-1e9"}
SCALES = {"explicit": 0.3, "tiny": 1e-3}
LATENTS = 4  # how many learned latents cross-attention reads


class InvalidSpec(ValueError):
    """The spec's options do not make a module (only a shrinking step can produce one)."""


class Source:
    """The lines of the module being written."""

    def __init__(self, spec: GraphSpec) -> None:
        self.spec = spec
        self.init: list[str] = []
        self.fwd: list[str] = []
        self.outputs: list[str] = []

    def param(self, name: str, shape: str, scale: float) -> str:
        self.init.append(f"self.{name} = nn.Parameter(torch.randn({shape}) * {scale!r})")
        return f"self.{name}"


# ---- pieces several blocks use ------------------------------------------------------------------
def act(src: Source, p: str, x: str, spelling: str) -> str:
    """The activation `spelling` applied to the variable `x`, as an expression."""
    modules = {"relu_module": "nn.ReLU()", "gelu_module": "nn.GELU()", "silu_module": "nn.SiLU()",
               "gelu_tanh_module": 'nn.GELU(approximate="tanh")'}
    if spelling in modules:
        src.init.append(f"self.{p}_act = {modules[spelling]}")
        return f"self.{p}_act({x})"
    return {
        "relu": f"F.relu({x})",
        "gelu": f"F.gelu({x})",
        "gelu_tanh": f'F.gelu({x}, approximate="tanh")',
        "gelu_erf_hand": f"0.5 * {x} * (1.0 + torch.erf({x} / math.sqrt(2.0)))",
        "gelu_tanh_hand": f"0.5 * {x} * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * ({x} + 0.044715 * "
                          f"torch.pow({x}, 3.0))))",
        "silu": f"F.silu({x})",
        "silu_hand": f"{x} * torch.sigmoid({x})",
        "tanh": f"torch.tanh({x})",
        "none": x,
    }[spelling]


def linear(src: Source, p: str, x: str, d_in: int, d_out: int, spelling: str, bias: bool) -> str:
    """x @ W^T (+ b) in the given spelling, as an expression."""
    if spelling == "module":
        src.init.append(f"self.{p} = nn.Linear({d_in}, {d_out}, bias={bias})")
        return f"self.{p}({x})"
    transposed = spelling == "matmul_transposed"
    w = src.param(f"{p}_w", f"{d_in}, {d_out}" if transposed else f"{d_out}, {d_in}", round(1 / math.sqrt(d_in), 4))
    b = src.param(f"{p}_b", str(d_out), 0.1) if bias else None
    if spelling == "functional":
        return f"F.linear({x}, {w}, {b})"
    if spelling == "addmm":
        flat = f"{x}.reshape(-1, {d_in})"
        mm = f"torch.addmm({b}, {flat}, {w}.t())" if bias else f"torch.mm({flat}, {w}.t())"
        return f"{mm}.view(*{x}.shape[:-1], {d_out})"
    mm = f"torch.matmul({x}, {w})" if transposed else f"{x} @ {w}.t()"
    return f"{mm} + {b}" if bias else mm


def norm(src: Source, p: str, x: str, kind: str, eps: float) -> str:
    """Normalization `kind` over the last dim of `x`, as an expression (hand forms add lines)."""
    d = src.spec.hidden
    modules = {"layer_norm_module": f"nn.LayerNorm({d}, eps={eps!r})",
               "layer_norm_no_bias": f"nn.LayerNorm({d}, eps={eps!r}, bias=False)",
               "layer_norm_no_affine": f"nn.LayerNorm({d}, eps={eps!r}, elementwise_affine=False)",
               "rms_norm_module": f"nn.RMSNorm({d}, eps={eps!r})"}
    if kind in modules:
        src.init.append(f"self.{p} = {modules[kind]}")
        return f"self.{p}({x})"
    w = src.param(f"{p}_w", str(d), 1.0)
    if kind == "layer_norm_functional":
        b = src.param(f"{p}_b", str(d), 0.1)
        return f"F.layer_norm({x}, ({d},), {w}, {b}, {eps!r})"
    if kind == "layer_norm_hand":
        b = src.param(f"{p}_b", str(d), 0.1)
        src.fwd.append(f"{p}_mu = {x}.mean(-1, keepdim=True)")
        src.fwd.append(f"{p}_var = ({x} - {p}_mu).pow(2).mean(-1, keepdim=True)")
        return f"({x} - {p}_mu) / torch.sqrt({p}_var + {eps!r}) * {w} + {b}"
    if kind == "rms_norm_functional":
        return f"F.rms_norm({x}, ({d},), {w}, {eps!r})"
    if kind == "rms_norm_hand":
        return f"{x} * torch.rsqrt({x}.pow(2).mean(-1, keepdim=True) + {eps!r}) * {w}"
    if kind == "rms_norm_one_plus":
        return f"{x} * torch.rsqrt({x}.pow(2).mean(-1, keepdim=True) + {eps!r}) * (1.0 + {w})"
    if kind == "rms_norm_hand_pow":
        return f"{x} / torch.sqrt(torch.mean({x} * {x}, dim=-1, keepdim=True) + {eps!r}) * {w}"
    raise InvalidSpec(f"unknown norm {kind!r}")


def prenorm(src: Source, p: str, kind: str) -> str:
    if kind == "none":
        return "h"
    src.fwd.append(f"{p}_n = {norm(src, f'{p}_norm', 'h', kind, 1e-5)}")
    return f"{p}_n"


def finish(src: Source, p: str, y: str, residual: bool) -> None:
    src.fwd.append(f"h = h + {y}" if residual else f"h = {y}")


# ---- blocks -------------------------------------------------------------------------------------
def block_linear(src: Source, p: str, o: dict) -> None:
    d = src.spec.hidden
    src.fwd.append(f"{p}_y = {linear(src, p, 'h', d, d, o['spelling'], o['bias'])}")
    finish(src, p, act(src, p, f"{p}_y", o["act"]), o["residual"])


def block_mlp(src: Source, p: str, o: dict) -> None:
    d, f = src.spec.hidden, src.spec.ffn
    x = prenorm(src, p, o["prenorm"])
    src.fwd.append(f"{p}_a = {linear(src, f'{p}_fc1', x, d, f, o['spelling'], o['bias'])}")
    src.fwd.append(f"{p}_a = {act(src, p, f'{p}_a', o['act'])}")
    finish(src, p, linear(src, f"{p}_fc2", f"{p}_a", f, d, o["spelling"], o["bias"]), o["residual"])


def block_gated_mlp(src: Source, p: str, o: dict) -> None:
    d, f = src.spec.hidden, src.spec.ffn
    x = prenorm(src, p, o["prenorm"])
    src.fwd.append(f"{p}_g = {linear(src, f'{p}_gate', x, d, f, 'module', o['bias'])}")
    src.fwd.append(f"{p}_u = {linear(src, f'{p}_up', x, d, f, 'module', o['bias'])}")
    src.fwd.append(f"{p}_g = {act(src, p, f'{p}_g', o['act'])} * {p}_u")
    finish(src, p, linear(src, f"{p}_down", f"{p}_g", f, d, "module", o["bias"]), o["residual"])


def block_norm(src: Source, p: str, o: dict) -> None:
    src.fwd.append(f"h = {norm(src, p, 'h', o['kind'], o['eps'])}")


def block_add_norm(src: Source, p: str, o: dict) -> None:
    d = src.spec.hidden
    if o["sub"] == "identity":
        other = "x"  # a residual from the graph input
    elif o["sub"] == "linear":
        other = linear(src, f"{p}_lin", "h", d, d, "module", True)
    else:
        src.fwd.append(f"{p}_a = F.gelu({linear(src, f'{p}_fc1', 'h', d, src.spec.ffn, 'module', True)})")
        other = linear(src, f"{p}_fc2", f"{p}_a", src.spec.ffn, d, "module", True)
    src.fwd.append(f"{p}_s = h + {other}")
    src.fwd.append(f"h = {norm(src, p, f'{p}_s', o['kind'], o['eps'])}")


def _keep_mask(src: Source, p: str, o: dict, form: str) -> str | None:
    """Lines building the boolean keep-mask (True = attend) the block uses; its variable, or None."""
    s = src.spec
    if o["kv"] == "latents":  # every query sees every latent: the masks here are over the sequence
        return None
    mask, keep = o["mask"], None
    if mask == "causal_flag" and (form == "decomposed" or o["padding"]):
        mask = "causal_tril"  # SDPA's is_causal cannot be combined with an attn_mask
    if mask == "causal_tril":
        keep = "torch.ones(S, S, dtype=torch.bool, device=h.device).tril()"
    elif mask == "causal_triu":
        keep = "~torch.ones(S, S, dtype=torch.bool, device=h.device).triu(1)"
    elif mask == "tril_offset":
        keep = "torch.ones(S, S, dtype=torch.bool, device=h.device).tril(1)"
    elif mask in ("causal_arange", "band_arange"):
        src.fwd.append(f"{p}_i = torch.arange(S, device=h.device)")
        keep = f"{p}_i[:, None] >= {p}_i[None, :]"
        if mask == "band_arange":
            keep = f"({keep}) & ({p}_i[:, None] - {p}_i[None, :] < {s.window})"
    elif mask in ("rows_all", "rows_from_1"):  # transformers' encoders trace q >= 0 (keeps every score)
        src.fwd.append(f"{p}_i = torch.arange(S, device=h.device)")
        keep = f"({p}_i >= {int(mask == 'rows_from_1')})[:, None].expand(S, S)"
    elif mask in ("causal_buffer", "band_buffer"):
        rule = "(i[:, None] >= i[None, :])"
        if mask == "band_buffer":
            rule += f" & (i[:, None] - i[None, :] < {s.window})"
        src.init.append(f"i = torch.arange({s.max_seq})")
        src.init.append(f'self.register_buffer("{p}_mask", {rule}, persistent=False)')
        keep = f"self.{p}_mask[:S, :S]"
    if o["padding"] or mask == "padding":
        pad = "mask[:, None, None, :]"
        keep = pad if keep is None else f"({keep}) & {pad}"
    if keep is None:
        return None
    src.fwd.append(f"{p}_keep = {keep}")
    return f"{p}_keep"


def _bias(src: Source, p: str, keep: str, o: dict) -> str:
    """An additive float mask from the keep-mask (0 where kept, the fill elsewhere)."""
    fill = FILLS[o["fill"]]
    if o["apply"] == "additive_mul":  # BERT's (1 - mask) * min: 0 * -inf would be NaN, so a finite fill
        fill = FILLS["min"] if o["fill"] == "-inf" else fill
        src.fwd.append(f"{p}_bias = (1.0 - {keep}.to(h.dtype)) * {fill}")
    else:
        zeros = f"torch.zeros({keep}.shape, dtype=h.dtype, device=h.device)"
        src.fwd.append(f"{p}_bias = {zeros}.masked_fill(~{keep}, {fill})")
    return f"{p}_bias"


def block_attention(src: Source, p: str, o: dict) -> None:
    s = src.spec
    d, hd, heads, kvh = s.hidden, s.head_dim, s.heads, s.kv_heads
    kvd = kvh * hd
    x = prenorm(src, p, o["prenorm"])
    if o["sizes"] == "input":
        src.fwd.append(f"B, S, _ = {x}.shape")
    bias = o["bias"] is not False  # "not_k" leaves k's out where q, k and v are separate
    latents = o["kv"] == "latents"
    kv_x, kv_b, kv_s = x, "B", "S"
    if latents:  # cross-attention to learned latents: K/V of batch 1 broadcast against the queries' batch
        kv_x, kv_b, kv_s = src.param(f"{p}_latents", f"1, {LATENTS}, {d}", 1.0), "1", str(LATENTS)
    if o["qkv"] == "packed" and not latents:
        src.fwd.append(f"q, k, v = {linear(src, f'{p}_qkv', x, d, d + 2 * kvd, 'module', bias)}"
                       f".split([{d}, {kvd}, {kvd}], dim=-1)")
    else:
        for name, width, inp in (("q", d, x), ("k", kvd, kv_x), ("v", kvd, kv_x)):
            has = bias and not (name == "k" and o["bias"] == "not_k")
            src.fwd.append(f"{name} = {linear(src, f'{p}_{name}', inp, d, width, 'module', has)}")
    if o["sizes"] == "projection":
        src.fwd.append("B, S, _ = q.shape")
    for name, nh in (("q", heads), ("k", kvh), ("v", kvh)):
        if o["sizes"] == "heads":
            bs, first = f"*{name}.shape[:-1]", f"{name}.shape[0]"
        else:
            bs = "B, S" if name == "q" else f"{kv_b}, {kv_s}"
            first = bs.split(", ")[0]
        src.fwd.append(f"{name} = " + {
            "view_transpose": f"{name}.view({bs}, {nh}, {hd}).transpose(1, 2)",
            "view_permute": f"{name}.view({bs}, {nh}, {hd}).permute(0, 2, 1, 3)",
            "reshape_transpose": f"{name}.reshape({first}, -1, {nh}, {hd}).transpose(1, 2)",
            "contiguous": f"{name}.view({bs}, {nh}, {hd}).transpose(1, 2).contiguous()",
        }[o["layout"]])
    if o["sizes"] == "heads":  # read off the split heads: an intermediate the attention fusion absorbs
        src.fwd.append("B, _, S, _ = q.shape")
    form = o["form"]
    gqa = kvh < heads and (o["gqa"] != "enable_gqa" or form == "decomposed")
    if gqa:
        rep = heads // kvh
        for name in ("k", "v"):
            src.fwd.append(f"{name} = " + (
                f"{name}.repeat_interleave({rep}, dim=1)" if o["gqa"] != "expand_reshape"
                else f"{name}[:, :, None, :, :].expand({kv_b}, {kvh}, {rep}, {kv_s}, {hd})"
                     f".reshape({kv_b}, {heads}, {kv_s}, {hd})"))
    scale = SCALES.get(o["scale"])
    keep = _keep_mask(src, p, o, form)
    if form == "sdpa":
        kwargs = []
        if keep is not None:
            kwargs.append(f"attn_mask={keep if o['apply'] == 'bool' else _bias(src, p, keep, o)}")
        if o["mask"] == "causal_flag" and keep is None and not latents:
            kwargs.append("is_causal=True")
        if scale is not None:
            kwargs.append(f"scale={scale!r}")
        if kvh < heads and not gqa:
            kwargs.append("enable_gqa=True")
        src.fwd.append(f"o = F.scaled_dot_product_attention(q, k, v{''.join(', ' + k for k in kwargs)})")
    else:
        factor = scale if scale is not None else 1 / math.sqrt(hd)
        at = o["scale_at"]
        if at == "query":
            src.fwd.append(f"q = q * {factor!r}")
        src.fwd.append("w = q @ k.transpose(-2, -1)")
        if at == "scores":
            src.fwd.append(f"w = w * {factor!r}")
        elif at == "div_sqrt":
            src.fwd.append(f"w = w / math.sqrt({hd})" if scale is None else f"w = w / {1 / factor!r}")
        if keep is not None:
            fill = FILLS[o["fill"]]
            if o["apply"] in ("bool", "masked_fill"):
                src.fwd.append(f"w = w.masked_fill(~{keep}, {fill})")
            elif o["apply"] == "where":
                src.fwd.append(f"w = torch.where({keep}, w, {fill})")
            else:
                src.fwd.append(f"w = w + {_bias(src, p, keep, o)}")
        if at == "after_mask":
            src.fwd.append(f"w = w * {factor!r}")
        src.fwd.append("w = " + {
            "functional": "F.softmax(w, dim=-1)", "torch": "torch.softmax(w, -1)", "method": "w.softmax(dim=-1)",
            "float32": "F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)",
        }[o["softmax"]])
        src.fwd.append("o = w @ v")
    src.fwd.append("o = " + {
        "transpose_reshape": f"o.transpose(1, 2).reshape(B, S, {d})",
        "contiguous_view": f"o.transpose(1, 2).contiguous().view(B, S, {d})",
        "permute_flatten": "o.permute(0, 2, 1, 3).flatten(2)",
    }[o["merge"]])
    finish(src, p, linear(src, f"{p}_o", "o", d, d, "module", bias), o["residual"])


def block_shape_read(src: Source, p: str, o: dict) -> None:
    d = src.spec.hidden
    kind = o["kind"]
    if kind == "flatten_linear":
        src.init.append(f"self.{p} = nn.Linear({d}, {d})")
        src.fwd.append("B, S, _ = h.shape")
        src.fwd.append(f"h = F.gelu(self.{p}(h.reshape(B * S, {d}))).view(B, S, {d})")
    elif kind == "scale_by_width":
        src.fwd.append("h = h * (h.shape[-1] ** -0.5)")
    elif kind == "divide_by_seq":
        src.fwd.append("h = h / h.size(1)")
    elif kind == "divide_by_numel":
        src.fwd.append("h = h * (h.size(0) * h.size(1) * h.size(2) / h.numel())")
    elif kind == "view_sizes":
        src.fwd.append("h = h.view(h.size(0), h.size(1), -1)")
    elif kind == "dim_branch":
        src.fwd.append("h = h + float(h.dim())")
    else:  # sizes of a GEMM's output that its activation epilogue absorbs
        src.fwd.append(f"{p}_a = {linear(src, p, 'h', d, d, 'module', True)}")
        if kind == "view_as_intermediate":
            src.fwd.append(f"h = ({act(src, p, f'{p}_a', o['act'])}).view({p}_a.shape)")
        else:
            src.fwd.append(f"h = {act(src, p, f'{p}_a', o['act'])} * ({p}_a.size(-1) * {p}_a.size(0) / {p}_a.numel())"
                           f" * {p}_a.size(1)")


def block_reuse(src: Source, p: str, o: dict) -> None:
    d = src.spec.hidden
    src.fwd.append(f"{p}_a = {linear(src, p, 'h', d, d, 'module', True)}")
    a = f"{p}_a"
    if o["kind"] == "act_plus":  # the GEMM's output read by its activation and again after it
        src.fwd.append(f"h = {act(src, p, a, o['act'])} + {a}")
    elif o["kind"] == "times_sigmoid":
        src.fwd.append(f"h = {a} * torch.sigmoid({a})")
    elif o["kind"] == "side_output":
        src.fwd.append(f"{a} = {act(src, p, a, o['act'])}")
        src.outputs.append(a)
        src.fwd.append(f"h = {a} + h")
    else:
        src.fwd.append(f"h = h + {a} + {a} * 0.5")


def block_integer(src: Source, p: str, o: dict) -> None:
    d = src.spec.hidden
    src.init.append(f'self.register_buffer("{p}_w", torch.randint(-3, 4, ({d}, {d})))')
    src.fwd.append(f"{p}_i = (h * 4).round().long() @ self.{p}_w")
    if o["bias"]:
        src.init.append(f'self.register_buffer("{p}_b", torch.randint(-3, 4, ({d},)))')
        src.fwd.append(f"{p}_i = {p}_i + self.{p}_b")
    if o["act"] == "relu":
        src.fwd.append(f"{p}_i = torch.relu({p}_i)")
    src.fwd.append(f"h = h + {p}_i.to(h.dtype) * 0.01")


BLOCKS = {"linear": block_linear, "mlp": block_mlp, "gated_mlp": block_gated_mlp, "norm": block_norm,
          "add_norm": block_add_norm, "attention": block_attention, "shape_read": block_shape_read,
          "reuse": block_reuse, "integer": block_integer}


# ---- the whole module ---------------------------------------------------------------------------
HEADER = '''"""tkopt fuzz graph, seed {seed}. Spec: {json}"""

import math

import torch
import torch.nn.functional as F
from torch import nn

SEED = {seed}
DTYPE = torch.{dtype}
HIDDEN = {hidden}
SHAPES = {shapes!r}  # (batch, seq): the example first, then the sizes each check also runs
'''

FOOTER = '''

def make_model() -> nn.Module:
    """The module with seeded weights; parameters get noise so that norms' ones and zeros are generic."""
    torch.manual_seed(SEED)
    model = Fuzzed()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.to(DTYPE).eval()


def make_inputs(batch: int, seq: int) -> tuple:
    """Inputs of one size (seeded by the size)."""
    g = torch.Generator().manual_seed(SEED * 7919 + batch * 131 + seq)
    x = torch.randn(batch, seq, HIDDEN, generator=g, dtype=DTYPE)
{mask_lines}
'''


def render(spec: GraphSpec) -> str:
    """The module source for `spec` (class Fuzzed, make_model, make_inputs, SHAPES)."""
    src = Source(spec)
    for i, b in enumerate(spec.blocks):
        _render_block(src, f"b{i}", b)
    params = "self, x, mask" if spec.has_padding else "self, x"
    init = "\n".join(f"        {line}" for line in src.init) or "        pass"
    fwd = "\n".join(f"        {line}" for line in src.fwd)
    ret = ", ".join(["h", *src.outputs])
    cls = (f"\n\nclass Fuzzed(nn.Module):\n    def __init__(self) -> None:\n        super().__init__()\n"
           f"        self.max_seq = {spec.max_seq}\n{init}\n\n    def forward({params}):\n        h = x\n{fwd}\n"
           f"        return {ret}\n")
    if spec.has_padding:
        mask_lines = "    mask = torch.rand(batch, seq, generator=g) > 0.3\n"
        if spec.masked_row:
            mask_lines += "    if batch > 1:\n        mask[-1] = False  # a batch entry with no key to attend to\n"
        mask_lines += "    return (x, mask)"
    else:
        mask_lines = "    return (x,)"
    head = HEADER.format(seed=spec.seed, json=spec.to_json(), dtype=spec.dtype, hidden=spec.hidden,
                         shapes=spec.shapes())
    return head + cls + FOOTER.format(mask_lines=mask_lines)


def _render_block(src: Source, p: str, b: Block) -> None:
    if b.kind not in BLOCKS:
        raise InvalidSpec(f"unknown block kind {b.kind!r}")
    BLOCKS[b.kind](src, p, b.opts)


def load(source: str, directory: Path, name: str) -> ModuleType:
    """Write `source` to `<directory>/<name>.py` and import it (tracebacks and export see real lines)."""
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # torch.export looks the class's module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
