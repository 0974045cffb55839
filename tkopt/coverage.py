"""The coverage matrix: real models through every entry point, on CPU with tiny random configs.

Rows: transformers' BERT, GPT-2, Llama, T5, ViT and the Whisper encoder (default configs, tiny sizes),
torch's nn.TransformerEncoderLayer / TransformerDecoderLayer / MultiheadAttention, and the reference
blocks (tkopt.models.blocks). Columns: tkopt.compile, torch.compile(backend="tkopt") under no_grad and
in training, the dynamo ONNX export with static and with dynamic shapes, and the TorchScript export.
The torch entry points get each model as users call it (transformers' output classes and caches
included); the ONNX exporters get it as plain tensors in, its first output out (`TensorsIn`).

Per cell: whether it ran, the fusions per layer by family (attention / norm / GEMM-family: gemm, gemm_group
and gated_mlp), the largest relative error against eager over every output (and, in training, every
parameter's gradient, relative to the largest one), and the refusal reasons. Fused ops run their
torch references (TKOPT_KERNELS=reference): the matrix checks the graph side, in float32, against 1e-5.
`tkopt coverage --out FILE` writes it as Markdown.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

TOLERANCE = 1e-5
ENTRIES = {
    "compile": "tkopt.compile",
    "backend": "backend no_grad",
    "backend_train": "backend training",
    "onnx_static": "ONNX dynamo static",
    "onnx_dynamic": "ONNX dynamo dynamic",
    "onnx_torchscript": "ONNX TorchScript",
}
FAMILIES = {"attention": ("attention",), "norm": ("add_norm",), "gemm": ("gemm", "gemm_group", "gated_mlp")}


@dataclass
class Case:
    """A model row: how to build it (torch form: module, args, kwargs; and its ONNX form), its layer
    count, and which fusion families it holds (a norm-less model is not asked for norm fusions)."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple, dict[str, Any]]]
    plain: Callable[[nn.Module], nn.Module]  # the torch-form model -> the exporters' form
    layers: int
    families: tuple[str, ...] = ("attention", "norm", "gemm")


@dataclass
class Cell:
    model: str
    entry: str
    error: str | None = None
    fusions: dict[str, int] = field(default_factory=dict)
    max_rel: float | None = None
    refusals: list[str] = field(default_factory=list)

    def per_layer(self, case: Case) -> dict[str, float]:
        return {f: sum(self.fusions.get(k, 0) for k in kinds) / case.layers for f, kinds in FAMILIES.items()}

    def ok(self, case: Case) -> bool:
        """Ran, matches eager, and every family the model holds fused at least once per layer."""
        if self.error is not None or self.max_rel is None or not self.max_rel <= TOLERANCE:
            return False
        per = self.per_layer(case)
        return all(per[f] >= 1 for f in case.families)


# ---- the rows ----------------------------------------------------------------------------------

def _ids(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(1, 100, (batch, seq), generator=torch.Generator().manual_seed(0))


def _plain_tensors(model: nn.Module, dynamic_axes: dict | None = None) -> nn.Module:
    """A torch module that takes and returns tensors is its own exporters' form (`dynamic_axes` as in
    tkopt.models.export)."""
    if dynamic_axes:
        model.dynamic_axes = dynamic_axes
    return model


def _hf(model_type: str, auto_class: str, inputs: Callable[[], dict[str, torch.Tensor]],
        dynamic_axes: dict | None = None, pick: Callable[[nn.Module], nn.Module] = lambda m: m,
        plain_kwargs: dict | None = None, **overrides: Any) -> tuple[Callable, Callable]:
    from tkopt.models.hf import TensorsIn, tiny_model

    def build() -> tuple[nn.Module, tuple, dict[str, Any]]:
        return pick(tiny_model(model_type, auto_class, **overrides)), (), inputs()

    def plain(model: nn.Module) -> nn.Module:
        return TensorsIn(model, list(inputs()), dynamic_axes, **(plain_kwargs or {}))

    return build, plain


def _torch_module(make: Callable[[], nn.Module], inputs: Callable[[], tuple]) -> Callable:
    def build() -> tuple[nn.Module, tuple, dict[str, Any]]:
        torch.manual_seed(0)
        return make().eval(), inputs(), {}

    return build


class SelfAttention(nn.Module):
    """nn.MultiheadAttention as self-attention returning its output only (need_weights=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def cases() -> list[Case]:
    """Every row (transformers rows only when transformers is installed)."""
    from tkopt.models.blocks import EXPECTED_FUSIONS, REFERENCE_MODELS

    rows: list[Case] = []
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        text = {"input_ids": _ids(), "attention_mask": torch.ones(2, 8, dtype=torch.int64)}
        rows += [
            Case("bert", *_hf("bert", "AutoModel", lambda: dict(text)), layers=2),
            Case("gpt2", *_hf("gpt2", "AutoModelForCausalLM", lambda: dict(text), plain_kwargs={"use_cache": False}),
                 layers=2),
            Case("llama", *_hf("llama", "AutoModelForCausalLM", lambda: dict(text),
                               plain_kwargs={"use_cache": False}), layers=2),
            Case("t5", *_hf("t5", "AutoModel", lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(2, 5)},
                            {"decoder_input_ids": {0: "batch", 1: "decoder_seq"}}, plain_kwargs={"use_cache": False},
                            num_decoder_layers=2, d_kv=16, d_ff=128), layers=4),
            Case("vit", *_hf("vit", "AutoModel", lambda: {"pixel_values": torch.randn(2, 3, 32, 32)},
                             {"pixel_values": {0: "batch"}}, image_size=32, patch_size=8), layers=2),
            Case("whisper_encoder", *_hf(
                "whisper", "AutoModel", lambda: {"input_features": torch.randn(2, 16, 32)},
                {"input_features": {0: "batch"}}, pick=lambda m: m.get_encoder(), encoder_layers=2, decoder_layers=1,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                num_mel_bins=16, max_source_positions=16), layers=2),
        ]
    x = lambda: (torch.randn(2, 8, 64),)  # noqa: E731
    rows += [
        Case("nn.TransformerEncoderLayer", _torch_module(
            lambda: nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), x), _plain_tensors, 1),
        Case("nn.TransformerDecoderLayer", _torch_module(
            lambda: nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
            lambda: (torch.randn(2, 8, 64), torch.randn(2, 6, 64))),
            lambda m: _plain_tensors(m, {"memory": {0: "batch", 1: "memory_seq"}}), 1),
        Case("nn.MultiheadAttention", _torch_module(SelfAttention, x), _plain_tensors, 1, ("attention", "gemm")),
    ]
    for name in sorted(REFERENCE_MODELS):
        held = tuple(f for f, kinds in FAMILIES.items() if any(EXPECTED_FUSIONS[name].get(k) for k in kinds))

        def build(name: str = name) -> tuple[nn.Module, tuple, dict[str, Any]]:
            model, inputs = REFERENCE_MODELS[name]()
            return model, tuple(inputs), {}

        rows.append(Case(f"blocks.{name}", build, _plain_tensors, 1, held))
    return rows


# ---- the columns -------------------------------------------------------------------------------

def _rel(got: Any, want: Any) -> float:
    """The largest relative error over the tensor leaves of two output trees of the same structure."""
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(g) != len(w):
        raise AssertionError(f"{len(g)} outputs, eager has {len(w)}")
    worst = 0.0
    for a, b in zip(g, w, strict=True):
        if not isinstance(b, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            raise AssertionError(f"an output of shape {getattr(a, 'shape', type(a))}, eager's is {tuple(b.shape)}")
        a, b = a.detach().double(), b.detach().double()
        if b.is_floating_point() and b.numel():
            scale = b.abs().max().item()
            diff = (a - b).abs().max().item()
            worst = max(worst, diff / scale if scale else diff)
        elif not torch.equal(a, b):
            return float("inf")
    return worst


def _no_dropout(model: nn.Module) -> None:
    """Training runs compare against eager, so nothing may be random: every dropout probability to 0."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout", "attention_probs_dropout_prob", "dropout_p"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
        cfg = getattr(m, "config", None)
        if cfg is not None:
            for k, v in vars(cfg).items():
                if isinstance(v, float) and ("dropout" in k or k.endswith("pdrop")):
                    setattr(cfg, k, 0.0)


def reasons(report: Any) -> list[str]:
    """Why things were left unfused: the passes' refusals of near matches, and the candidates the target
    did not keep (kernel failures, declined, slower), each with its reason."""
    refused = {f"{r.rule}: {r.reason}" for r in report.passes.refusals}
    unkept = {f"{n.fusion} {n.node} {n.decision.replace('_', ' ')}: {n.reason}" for n in report.nodes
              if n.decision != "kept"}
    return sorted(refused | unkept)


def _run_compile(case: Case, cell: Cell) -> None:
    import tkopt

    model, args, kwargs = case.build()
    fast = tkopt.compile(model, args, kwargs)
    with torch.no_grad():
        cell.max_rel = _rel(fast(*args, **kwargs), model(*args, **kwargs))
    rep = fast.tkopt_report
    cell.fusions, cell.refusals = rep.fusions, reasons(rep)


def _run_backend(case: Case, cell: Cell, training: bool) -> None:
    from tkopt.backends.dynamo import make_backend

    model, args, kwargs = case.build()
    torch._dynamo.reset()
    backend = make_backend()
    fast = torch.compile(model, backend=backend, dynamic=True)
    if not training:
        with torch.no_grad():
            cell.max_rel = _rel(fast(*args, **kwargs), model(*args, **kwargs))
    else:
        _no_dropout(model)
        model.train()
        results = []
        for fn in (fast, model):
            model.zero_grad()
            out = fn(*args, **kwargs)
            leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            gen = torch.Generator().manual_seed(1)
            sum((t * torch.randn(t.shape, generator=gen)).sum() for t in leaves).backward()
            results.append((out, [p.grad for p in model.parameters() if p.grad is not None]))
        (got, got_grads), (want, want_grads) = results
        # Gradients as one vector: some are exactly zero in math (a key bias under softmax) and their
        # float32 noise has no scale of its own.
        flat = [torch.cat([g.reshape(-1) for g in grads]) for grads in (got_grads, want_grads)]
        cell.max_rel = max(_rel(got, want), _rel(flat[0], flat[1]))
    for gm in backend.graph_modules:
        for k, v in gm.tkopt_report.fusions.items():
            cell.fusions[k] = cell.fusions.get(k, 0) + v
        cell.refusals += reasons(gm.tkopt_report)
    cell.refusals = sorted(set(cell.refusals))


def _run_onnx(case: Case, cell: Cell, dynamo: bool, dynamic: bool) -> None:
    import tkopt
    from tkopt.models.export import export_onnx

    model, args, kwargs = case.build()
    plain = case.plain(model).eval()
    inputs = tuple(args) + tuple(kwargs.values())
    with tempfile.TemporaryDirectory(prefix="tkopt-coverage-") as d:
        try:
            path = export_onnx(plain, inputs, Path(d) / "model.onnx", dynamo=dynamo, dynamic_batch_seq=dynamic)
        except Exception as e:
            raise ExportFailed(_one_line(e)) from e
        _, rep = tkopt.optimize_onnx(path, report=False, check_accuracy=True)
    cell.fusions, cell.refusals = rep.fusions, reasons(rep)
    acc = rep.accuracy
    if acc is None or not acc.checked:
        raise RuntimeError(f"accuracy not checked: {'; '.join(acc.skipped) if acc else 'no check ran'}")
    cell.max_rel = max(o.max_rel for o in acc.outputs)
    cell.refusals += [f"accuracy check skipped {s}" for s in acc.skipped]


RUNNERS: dict[str, Callable[[Case, Cell], None]] = {
    "compile": _run_compile,
    "backend": lambda case, cell: _run_backend(case, cell, training=False),
    "backend_train": lambda case, cell: _run_backend(case, cell, training=True),
    "onnx_static": lambda case, cell: _run_onnx(case, cell, dynamo=True, dynamic=False),
    "onnx_dynamic": lambda case, cell: _run_onnx(case, cell, dynamo=True, dynamic=True),
    "onnx_torchscript": lambda case, cell: _run_onnx(case, cell, dynamo=False, dynamic=True),
}


class ExportFailed(RuntimeError):
    """torch's ONNX exporter failed on the model: a cell tkopt never saw."""


def _one_line(e: BaseException) -> str:
    """The exception and, if it wraps others, the innermost one (the exporters wrap the real cause)."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    last = traceback.extract_tb(root.__traceback__)[-1] if root.__traceback__ else None
    where = f" ({Path(last.filename).name}:{last.lineno})" if last else ""
    text = f"{type(root).__name__}: {' '.join(str(root).split())[:300]}{where}"
    return text if root is e else f"{type(e).__name__} from {text}"


def run_cell(case: Case, entry: str) -> Cell:
    """One model through one entry point; any failure is recorded as the cell's one-line error."""
    cell = Cell(case.name, entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            RUNNERS[entry](case, cell)
        except ExportFailed as e:
            cell.error = f"the exporter failed: {e}"
        except Exception as e:  # noqa: BLE001 - a failing cell is a result, not the end of the run
            cell.error = _one_line(e)
    return cell


def run(models: Iterable[str] | None = None, entries: Iterable[str] | None = None,
        progress: Callable[[Cell], None] | None = None) -> tuple[list[Case], list[Cell]]:
    """The matrix (every row and column unless named), fused ops on their torch references."""
    wanted = set(models) if models is not None else None
    every = cases()
    rows = [c for c in every if wanted is None or c.name in wanted]
    if wanted is not None and wanted - {c.name for c in rows}:
        raise ValueError(f"unknown models {sorted(wanted - {c.name for c in rows})}; known: {[c.name for c in every]}")
    cols = list(entries) if entries is not None else list(ENTRIES)
    unknown = set(cols) - set(ENTRIES)
    if unknown:
        raise ValueError(f"unknown entry points {sorted(unknown)}; known: {list(ENTRIES)}")
    before = os.environ.get("TKOPT_KERNELS")
    os.environ["TKOPT_KERNELS"] = "reference"
    cells = []
    try:
        for case in rows:
            for entry in cols:
                cells.append(run_cell(case, entry))
                if progress is not None:
                    progress(cells[-1])
    finally:
        if before is None:
            os.environ.pop("TKOPT_KERNELS", None)
        else:
            os.environ["TKOPT_KERNELS"] = before
    return rows, cells


# ---- the table ---------------------------------------------------------------------------------

def _cell_text(cell: Cell, case: Case) -> str:
    if cell.error is not None:
        return "✗ export failed" if cell.error.startswith("the exporter failed") else "✗ error"
    per = cell.per_layer(case)
    counts = "/".join(f"{per[f]:g}" for f in FAMILIES)
    return f"{'✓' if cell.ok(case) else '✗'} {counts} · {cell.max_rel:.0e}"


def markdown(rows: list[Case], cells: list[Cell], command: str) -> str:
    """The matrix as Markdown: the table, then per cell the errors and refusal reasons."""
    by = {(c.model, c.entry): c for c in cells}
    cols = [e for e in ENTRIES if any(c.entry == e for c in cells)]
    versions = f"torch {torch.__version__}"
    try:
        import transformers

        versions += f", transformers {transformers.__version__}"
    except ImportError:
        pass
    lines = [
        "# Coverage: real models through every entry point",
        "",
        f"Command: `{command}` ({datetime.date.today().isoformat()}, CPU, {versions}, fused ops on their torch "
        "references, float32).",
        "",
        "Each cell: ✓ when it ran, matched eager within 1e-5 (relative, every output; in training also every "
        "parameter's gradient, relative to the largest one) and fused each family the model holds at least once "
        "per layer; then the fusions per layer as attention/norm/GEMM-family (gemm + gemm_group + gated_mlp) and the "
        "largest relative error. \"export failed\": torch's exporter failed on the model (tkopt never saw it).",
        "",
        "| model | " + " | ".join(ENTRIES[e] for e in cols) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for case in rows:
        row = [_cell_text(by[(case.name, e)], case) if (case.name, e) in by else "" for e in cols]
        lines.append(f"| {case.name} | " + " | ".join(row) + " |")
    lines += ["", "## Errors and refusals", ""]
    for case in rows:
        for e in cols:
            cell = by.get((case.name, e))
            if cell is None or (cell.error is None and not cell.refusals):
                continue
            lines.append(f"- **{case.name} · {ENTRIES[e]}**")
            if cell.error is not None:
                lines.append(f"  - error: {cell.error}")
            lines += [f"  - {r}" for r in cell.refusals]
    return "\n".join(lines) + "\n"
