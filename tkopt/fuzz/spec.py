"""What a fuzzed graph is: dims, a dtype and a list of blocks, each a kind with options.

A spec is plain data (JSON round-trips it), drawn from a seed by `generate` and made simpler by
`simpler` when a failure is shrunk. Every option lists its values simplest first, so shrinking sets
an option to its first value; `tkopt.fuzz.render` turns a spec into the nn.Module's source.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Per block kind: option -> its values, simplest first.
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "gelu_erf_hand", "gelu_tanh_hand", "silu", "silu_hand", "relu_module",
               "gelu_module", "gelu_tanh_module", "silu_module", "tanh", "none"]
NORMS = ["layer_norm_module", "layer_norm_functional", "layer_norm_hand", "layer_norm_no_bias", "rms_norm_module",
         "rms_norm_functional", "rms_norm_hand", "rms_norm_one_plus", "rms_norm_hand_pow", "layer_norm_no_affine"]
LINEARS = ["module", "functional", "matmul", "matmul_transposed", "addmm"]

OPTIONS: dict[str, dict[str, list[Any]]] = {
    "linear": {"spelling": LINEARS, "bias": [True, False], "act": ACTIVATIONS, "residual": [False, True]},
    "mlp": {"spelling": LINEARS, "bias": [True, False], "act": ACTIVATIONS, "residual": [False, True],
            "prenorm": ["none", *NORMS]},
    "gated_mlp": {"bias": [False, True], "act": ["silu", "silu_hand", "gelu", "gelu_tanh", "relu"],
                  "residual": [False, True], "prenorm": ["none", *NORMS]},
    "norm": {"kind": NORMS, "eps": [1e-5, 1e-6, 1e-12, 0.1]},
    "add_norm": {"kind": NORMS, "eps": [1e-5, 1e-6], "sub": ["linear", "mlp", "identity"]},
    "attention": {
        "form": ["sdpa", "decomposed"],
        "qkv": ["separate", "packed"],
        "kv": ["self", "latents"],  # keys and values from the hidden state, or from learned latents of batch 1
        "layout": ["view_transpose", "view_permute", "reshape_transpose", "contiguous"],
        "merge": ["transpose_reshape", "contiguous_view", "permute_flatten"],
        "sizes": ["input", "projection", "heads"],  # what B and S are read off
        "gqa": ["repeat_interleave", "expand_reshape", "enable_gqa"],  # only when kv_heads < heads
        "mask": ["none", "causal_flag", "causal_tril", "causal_triu", "causal_arange", "causal_buffer",
                 "band_buffer", "band_arange", "tril_offset", "padding", "rows_all", "rows_from_1"],
        "padding": [False, True],  # and the padding mask input, on top of `mask`
        "apply": ["bool", "additive", "additive_mul", "masked_fill", "where"],
        "fill": ["-inf", "-1e4", "min", "-1e9"],
        "scale": ["default", "explicit", "tiny"],
        "scale_at": ["scores", "div_sqrt", "query", "after_mask"],
        "softmax": ["functional", "torch", "method", "float32"],
        "bias": [True, False, "not_k"],  # "not_k": q and v have one and k none, as Whisper's attention
        "residual": [True, False],
        "prenorm": ["none", *NORMS],
    },
    "shape_read": {"kind": ["flatten_linear", "scale_by_width", "divide_by_seq", "divide_by_numel",
                            "view_sizes", "dim_branch", "view_as_intermediate", "numel_of_intermediate"],
                   "act": ACTIVATIONS},
    "reuse": {"kind": ["act_plus", "times_sigmoid", "side_output", "double_residual"], "act": ACTIVATIONS},
    "integer": {"act": ["relu", "none"], "bias": [False, True]},  # an int64 matmul (a quantized layer's core)
}
WEIGHTS = {"linear": 3, "mlp": 3, "gated_mlp": 2, "norm": 2, "add_norm": 2, "attention": 6, "shape_read": 2,
           "reuse": 2, "integer": 1}
DTYPES = ["float32", "float64"]


@dataclass
class Block:
    kind: str
    opts: dict[str, Any]


@dataclass
class GraphSpec:
    """One random graph: example sizes, widths, dtype and blocks (applied in order to the hidden state)."""

    seed: int
    dtype: str
    batch: int  # the example's batch and sequence length (what the graph is exported with)
    seq: int
    head_dim: int
    heads: int
    kv_heads: int
    ffn: int
    max_seq: int  # length of mask buffers sliced to the sequence; every size tried stays below it
    window: int  # band masks' width (8 or 16: a band that looks causal at the smaller sizes tried)
    blocks: list[Block] = field(default_factory=list)
    masked_row: bool = False  # the padding mask input leaves the last batch entry with no key at all

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GraphSpec:
        d = json.loads(text)
        d["blocks"] = [Block(**b) for b in d["blocks"]]
        return cls(**d)

    def shapes(self) -> list[tuple[int, int]]:
        """(batch, seq) sizes to check: the example's, 1 x 1, odd ones, and longer than the example."""
        longer = min(2 * self.seq + 3, self.max_seq - 1)
        out = [(self.batch, self.seq), (1, 1), (3, 5 if self.seq != 5 else 7), (self.batch, longer)]
        return list(dict.fromkeys(out))

    def uses(self, kind: str, **opts: Any) -> bool:
        return any(b.kind == kind and all(b.opts.get(k) == v for k, v in opts.items()) for b in self.blocks)

    @property
    def has_padding(self) -> bool:
        """Whether a block reads the padding mask input (cross-attention to latents has no keys to pad)."""
        return any(b.kind == "attention" and b.opts["kv"] == "self"
                   and (b.opts["padding"] or b.opts["mask"] == "padding") for b in self.blocks)


def generate(seed: int, max_blocks: int = 4) -> GraphSpec:
    """The spec seed `seed` stands for (the same seed always gives the same spec)."""
    rng = random.Random(seed)
    heads = rng.choice([1, 2, 3, 4])
    kv_heads = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
    head_dim = rng.choice([1, 2, 3, 4, 5, 8])
    hidden = heads * head_dim
    seq = rng.choice([1, 2, 3, 5, 7, 8, 9])
    spec = GraphSpec(
        seed=seed, dtype=rng.choice(DTYPES), batch=rng.choice([1, 2, 2, 3]), seq=seq, head_dim=head_dim,
        heads=heads, kv_heads=kv_heads, ffn=rng.choice([hidden, 2 * hidden + 1, 3, 4 * hidden]),
        max_seq=2 * seq + 8, window=rng.choice([1, 2, 3, 8, 16]), masked_row=rng.random() < 0.3,
    )
    kinds = list(WEIGHTS)
    for _ in range(rng.randint(1, max_blocks)):
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        spec.blocks.append(Block(kind, {k: rng.choice(v) for k, v in OPTIONS[kind].items()}))
    return spec


def simpler(spec: GraphSpec) -> Iterator[GraphSpec]:
    """Candidate simplifications of `spec`, boldest first: fewer blocks, plainer options, smaller sizes."""
    for i in range(len(spec.blocks)):
        if len(spec.blocks) > 1:
            yield replace(spec, blocks=spec.blocks[:i] + spec.blocks[i + 1:])
    for i, b in enumerate(spec.blocks):
        for k, values in OPTIONS[b.kind].items():
            if b.opts.get(k) != values[0]:
                blocks = list(spec.blocks)
                blocks[i] = Block(b.kind, {**b.opts, k: values[0]})
                yield replace(spec, blocks=blocks)
    if spec.masked_row:
        yield replace(spec, masked_row=False)
    if spec.dtype != DTYPES[0]:
        yield replace(spec, dtype=DTYPES[0])
    for name, smaller in (("batch", [1, 2]), ("seq", [1, 2, 3]), ("heads", [1, 2]), ("head_dim", [1, 2, 4]),
                          ("window", [1])):
        for v in smaller:
            if v < getattr(spec, name):
                cand = replace(spec, **{name: v})
                if name == "heads":
                    cand = replace(cand, kv_heads=v if spec.kv_heads == spec.heads else min(spec.kv_heads, v))
                if cand.heads % cand.kv_heads == 0:
                    yield cand
    if spec.kv_heads != spec.heads:
        yield replace(spec, kv_heads=spec.heads)
    for v in (spec.hidden, 2):
        if v < spec.ffn:
            yield replace(spec, ffn=v)
