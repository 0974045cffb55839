"""Near misses through real exports: each attention module is exported (torch.export FX path, dynamo and
TorchScript ONNX, dynamic shapes unless named static), fused, and either refused with its reason or run
fused against unfused at several sizes (1, odd, lengths not seen at export), NaN positions included.

The FX path runs fused ops on their torch references and compares with eager; the ONNX paths compare the
optimized model (fused ops in torch, the rest in ORT) with the original model in ORT, each at its own
semantics (the TorchScript exporter's SDPA, for one, gives NaN where eager gives 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from tkopt.backends.onnx_model import export_onnx as export_ir
from tkopt.backends.torch_module import to_torch_module
from tkopt.frontends.fx import import_fx
from tkopt.frontends.onnx import import_onnx
from tkopt.onnx_runtime_ref import run_model
from tkopt.passes.pipeline import run_passes
from tkopt.targets.torch_target import capture_values, replaced_module

H, D = 2, 8
HID = H * D
N_BUF = 48  # buffers' extent: lengths up to 47 are admitted
F32_MIN = float(torch.finfo(torch.float32).min)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "reference")


def _heads(x: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, H, D).transpose(1, 2)


def _merge(o: torch.Tensor) -> torch.Tensor:
    b, _, s, _ = o.shape
    return o.transpose(1, 2).reshape(b, s, HID)


def _qkv(x: torch.Tensor, kv: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    kv = x if kv is None else kv
    return _heads(x), _heads(torch.tanh(kv)), _heads(kv * 0.5 - 1)


def _attend(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _merge(w.softmax(-1) @ v)


def _band(window: int) -> torch.Tensor:
    i = torch.arange(N_BUF)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


# ---- the modules ------------------------------------------------------------------------------------
class BufferMask(nn.Module):
    """masked_fill(~buffer[:s, :s], -inf): tril for window >= N_BUF, else a sliding-window band. The masks are
    non-persistent buffers, as in transformers (a persistent one is state the user may load: no constant)."""

    def __init__(self, window: int = N_BUF) -> None:
        super().__init__()
        self.register_buffer("keep", _band(window), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = _qkv(x)
        w = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        return _attend(w.masked_fill(~self.keep[:s, :s], float("-inf")), v)


class IotaMask(nn.Module):
    """Keys j kept against query i by an arange comparison; `strict` (j < i) masks every key of row 0."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = torch.arange(x.shape[1], device=x.device)
        keep = i[None, :] < i[:, None] if self.strict else i[None, :] <= i[:, None]
        q, k, v = _qkv(x)
        return _attend((q @ k.transpose(-1, -2) * D**-0.5).masked_fill(~keep, float("-inf")), v)


class FiniteFillThenScale(nn.Module):
    """masked_fill(~tril, -1e4) and then a scale: eager's masked scores are -2, not -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", _band(N_BUF), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = _qkv(x)
        w = (q @ k.transpose(-1, -2)).masked_fill(~self.keep[:s, :s], -1e4)
        return _attend(w * 2e-4, v)


class AddThenScale(nn.Module):
    """(scores + mask) * scale with a -1e4 additive mask: the mask is scaled too, after it is added."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x)
        return _attend((q @ k.transpose(-1, -2) + mask[:, None, None, :]) * 2e-4, v)


class PaddingEq0(nn.Module):
    """masked_fill(attention_mask == 0, -inf): the mask computed from an int input, True where it masks."""

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x)
        w = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        return _attend(w, v)


class SdpaMask(nn.Module):
    """SDPA with a bool key mask (rows of a fully padded batch entry have every key masked)."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x)
        return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]))


class SdpaGqa(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x)
        return _merge(F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], enable_gqa=True))


class BatchBroadcast(nn.Module):
    """Q of batch 1 (one query set) against K/V of batch 2: the MatMuls broadcast the batch."""

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        q, _, _ = _qkv(x[:1])
        _, k, v = _qkv(mem)
        return _attend(q @ k.transpose(-1, -2) / math.sqrt(D), v)


class RelativeBias(nn.Module):
    """T5: no scale, a learned relative position bias added to the scores."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(17, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = torch.arange(x.shape[1], device=x.device)
        rel = (i[None, :] - i[:, None]).clamp(-8, 8) + 8
        bias = self.bias(rel).permute(2, 0, 1)[None]
        q, k, v = _qkv(x)
        return _attend(q @ k.transpose(-1, -2) + bias, v)


class Cross(nn.Module):
    """Encoder-decoder attention: queries from x (length s), keys/values from mem (length t), a key mask."""

    def forward(self, x: torch.Tensor, mem: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x, mem)
        w = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~keep[:, None, None, :], float("-inf"))
        return _attend(w, v)


class CausalCross(nn.Module):
    """Causal with Sq != Skv, top-left (torch's is_causal): SDPA, or a Trilu over (Sq, Skv) ones."""

    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.sdpa = sdpa

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x, mem)
        if self.sdpa:
            return _merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        keep = torch.ones(x.shape[1], mem.shape[1], dtype=torch.bool, device=x.device).tril()
        return _attend((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~keep, float("-inf")), v)


class BottomRight(nn.Module):
    """KV-cache causal: query i of the s new ones sees keys up to (t - s) + i: rows sliced from an offset."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", _band(N_BUF), persistent=False)

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        s, t = x.shape[1], mem.shape[1]
        q, k, v = _qkv(x, mem)
        keep = self.keep[t - s:t, :t]
        return _attend((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~keep, float("-inf")), v)


class FinfoCausalPlusPadding(nn.Module):
    """GPT-2's old form: Where(tril, w, finfo.min) + a finfo.min padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", _band(N_BUF), persistent=False)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = _qkv(x)
        w = torch.where(self.keep[:s, :s], q @ k.transpose(-1, -2) / math.sqrt(D), F32_MIN)
        return _attend(w + pad[:, None, None, :], v)


class FinfoCausal(nn.Module):
    """Llama's old form: scores * scale + triu(full(finfo.min), 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        causal = torch.full((s, s), F32_MIN, device=x.device).triu(1)
        q, k, v = _qkv(x)
        return _attend(q @ k.transpose(-1, -2) * D**-0.5 + causal, v)


class _KeepAll(nn.Module):
    """SDPA under a mask of form `form`: "iota" keeps where q >= 0 (everything), "zeros" adds zeros, "filled"
    adds masked_fill(zeros, q < 0, -inf) (everything kept): each changes no score. Near misses: "iota1" keeps
    q >= 1 (query 0 sees no key), "ones" adds ones (a bias, though one softmax cancels)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x)
        s = x.shape[1]
        i = torch.arange(s)
        rows = (i >= (1 if self.form == "iota1" else 0))[None, None, :, None].expand(x.shape[0], 1, s, s)
        if self.form in ("iota", "iota1"):
            mask = rows
        elif self.form == "filled":
            mask = torch.zeros(s, s).masked_fill((i < 0)[:, None], float("-inf"))
        else:
            mask = (torch.zeros if self.form == "zeros" else torch.ones)(s, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


# ---- cases -------------------------------------------------------------------------------------------
def _x(b: int, s: int) -> torch.Tensor:
    return torch.randn(b, s, HID)


def _keep(b: int, t: int, empty: bool = False) -> torch.Tensor:
    keep = torch.rand(b, t) > 0.3
    keep[:, 0] = True
    if empty:
        keep[-1] = False  # every key of the last batch entry masked
    return keep


@dataclass
class Case:
    module: Callable[[], nn.Module]
    inputs: Callable[[int, int], tuple[torch.Tensor, ...]]  # (batch, length) -> inputs
    dims: tuple[dict[int, str], ...]  # per input: axis -> dim name ("b", "s", "t")
    paths: tuple[str, ...]
    want: dict[str, object] = field(default_factory=dict)  # FusedAttention attributes (fused cases)
    refused: str | None = None  # the reason (refused cases)
    mask_input: bool | None = None  # whether the mask stays an explicit input
    sizes: tuple[int, ...] = (1, 11, 37, 40)


XS = ({0: "b", 1: "s"},)
CROSS = ({0: "b", 1: "s"}, {0: "b", 1: "t"})
ALL = ("fx", "dynamo", "torchscript")

CASES = {
    # defect 1: a band buffer sliced to the length agrees with tril at short lengths; it stays a mask
    "band_window_32": Case(lambda: BufferMask(32), lambda b, s: (_x(b, s),), XS, ALL, {"causal": 0}, mask_input=True),
    "band_window_8": Case(lambda: BufferMask(8), lambda b, s: (_x(b, s),), XS, ("fx",), {"causal": 0},
                          mask_input=True),
    "tril_buffer": Case(BufferMask, lambda b, s: (_x(b, s),), XS, ALL, {"causal": 1}, mask_input=False),
    "iota_causal": Case(IotaMask, lambda b, s: (_x(b, s),), XS, ALL, {"causal": 1}, mask_input=False),
    # defect 3: row 0 has every key masked: NaN in eager, NaN fused
    "strict_lower_nan_row": Case(lambda: IotaMask(strict=True), lambda b, s: (_x(b, s),), XS, ALL,
                                 {"causal": 0, "guard": "none"}, mask_input=True, sizes=(1, 2, 9)),
    # defect 2: finite fills stay finite, a scale after the mask scales it
    "finite_fill_then_scale": Case(FiniteFillThenScale, lambda b, s: (_x(b, s),), XS, ALL,
                                   {"causal": 0, "mask_fill": -2.0, "scale": 2e-4}, mask_input=True),
    "add_then_scale": Case(AddThenScale, lambda b, s: (_x(b, s), torch.where(torch.rand(b, s) > 0.3, 0.0, -1e4)),
                           ({0: "b", 1: "s"}, {0: "b", 1: "s"}), ALL, {"mask_scale": 2e-4, "scale": 1.0}),
    "masked_fill_eq0_padding": Case(PaddingEq0, lambda b, s: (_x(b, s), _keep(b, s, empty=True).long()),
                                    ({0: "b", 1: "s"}, {0: "b", 1: "s"}), ALL, {"mask_keeps": 0, "guard": "none"},
                                    mask_input=True),
    "sdpa_fully_masked_batch": Case(SdpaMask, lambda b, s: (_x(b, s), _keep(b, s, empty=True)),
                                    ({0: "b", 1: "s"}, {0: "b", 1: "s"}), ALL, {"causal": 0}, mask_input=True),
    # defect 5: the dynamo export of SDPA(enable_gqa=True)
    "sdpa_gqa": Case(SdpaGqa, lambda b, s: (_x(b, s),), XS, ("fx", "dynamo", "dynamo_static"), {}),
    # defect 7: Q of batch 1 against K/V of batch 2
    "q_batch_1_kv_batch_2": Case(BatchBroadcast, lambda b, s: (_x(1, s), _x(2, s)), ({1: "s"}, {1: "s"}), ALL,
                                 refused="not provably equal", sizes=(1, 11)),
    "relative_position_bias": Case(RelativeBias, lambda b, s: (_x(b, s),), XS, ALL, {"scale": 1.0},
                                   mask_input=True),
    "cross_attention": Case(Cross, lambda b, s: (_x(b, s), _x(b, s + 6), _keep(b, s + 6)),
                            ({0: "b", 1: "s"}, {0: "b", 1: "t"}, {0: "b", 1: "t"}), ALL, {"causal": 0},
                            mask_input=True, sizes=(1, 7, 30)),
    "sdpa_causal_sq_ne_skv": Case(lambda: CausalCross(sdpa=True), lambda b, s: (_x(b, s), _x(b, s + 5)), CROSS,
                                  ALL, {"causal": 1}, mask_input=False, sizes=(1, 7, 30)),
    "causal_trilu_sq_ne_skv": Case(lambda: CausalCross(sdpa=False), lambda b, s: (_x(b, 2 * s + 1), _x(b, s)),
                                   CROSS, ALL, {"causal": 1}, mask_input=False, sizes=(1, 7, 20)),
    "kv_cache_bottom_right": Case(BottomRight, lambda b, s: (_x(b, s), _x(b, s + 4)), CROSS, ("fx", "dynamo"),
                                  {"causal": 0}, mask_input=True, sizes=(1, 7, 30)),
    # a mask that keeps every score is left out; one that drops query 0's keys stays
    "keep_all_iota": Case(lambda: _KeepAll("iota"), lambda b, s: (_x(b, s),), XS, ALL, {"causal": 0},
                          mask_input=False),
    "keep_all_filled": Case(lambda: _KeepAll("filled"), lambda b, s: (_x(b, s),), XS, ALL, {"causal": 0},
                            mask_input=False),
    "keep_from_1": Case(lambda: _KeepAll("iota1"), lambda b, s: (_x(b, s),), XS, ALL, {"causal": 0},
                        mask_input=True, sizes=(1, 11)),
    "finfo_causal_alone": Case(FinfoCausal, lambda b, s: (_x(b, s),), XS, ALL, {"causal": 1}, mask_input=False),
    "finfo_causal_beside_padding": Case(
        FinfoCausalPlusPadding, lambda b, s: (_x(b, s), torch.where(_keep(b, s), 0.0, F32_MIN)),
        ({0: "b", 1: "s"}, {0: "b", 1: "s"}), ("fx", "dynamo"), refused="beside another mask"),
}


# ---- the harness -------------------------------------------------------------------------------------
def _dims(case: Case) -> dict[str, Dim]:
    bounds = {"b": (1, 8), "s": (1, 47), "t": (1, 47)}
    names = {n for d in case.dims for n in d.values()}
    return {n: Dim(n, min=bounds[n][0], max=bounds[n][1]) for n in names}


def _example(case: Case) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return case.inputs(2, 9)


def _fused_graph(case: Case, path: str, tmp: Path):
    module = case.module().eval()
    args = _example(case)
    dims = _dims(case)
    names = [f"in{i}" for i in range(len(args))]
    static = path.endswith("_static")
    if path == "fx":
        shapes = tuple({a: dims[n] for a, n in d.items()} for d in case.dims)
        graph = import_fx(torch.export.export(module, args, dynamic_shapes=shapes))
    else:
        file = tmp / f"{path}.onnx"
        if path.startswith("dynamo"):
            shapes = None if static else tuple({a: dims[n] for a, n in d.items()} for d in case.dims)
            torch.onnx.export(module, args, str(file), dynamo=True, input_names=names, dynamic_shapes=shapes)
        else:
            axes = None if static else {nm: dict(d) for nm, d in zip(names, case.dims, strict=True)}
            torch.onnx.export(module, args, str(file), dynamo=False, input_names=names, dynamic_axes=axes)
        graph = import_onnx(file)
    return module, graph, run_passes(graph), names


def _runner(case: Case, path: str, module: nn.Module, graph, names: list[str], tmp: Path):
    """(eager-or-original, fused) callables on a tuple of inputs."""
    if path == "fx":
        fused = to_torch_module(graph)
        return (lambda *a: module(*a)), (lambda *a: fused(*a))
    original = onnx.load(tmp / f"{path}.onnx")
    optimized = export_ir(graph)

    def run(model: onnx.ModelProto, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        feeds = {n: a.numpy() for n, a in zip(names, args, strict=True)}
        return torch.from_numpy(next(iter(run_model(model, feeds).values())))

    return (lambda *a: run(original, a)), (lambda *a: run(optimized, a))


@pytest.mark.parametrize(("name", "path"), [(n, p) for n, c in CASES.items() for p in c.paths])
def test_near_miss(name: str, path: str, tmp_path: Path) -> None:
    case = CASES[name]
    module, graph, report, names = _fused_graph(case, path, tmp_path)
    fused = [n for n in graph.nodes if n.op == "FusedAttention"]
    if case.refused is not None:
        assert not fused, [n.attrs for n in fused]
        assert any(case.refused in r.reason for r in report.refusals), [str(r) for r in report.refusals]
    else:
        assert len(fused) == 1, [str(r) for r in report.refusals]
        node = fused[0]
        for key, want in case.want.items():
            got = node.attrs[key]
            assert math.isclose(got, want, rel_tol=1e-6) if isinstance(want, float) else got == want, (key, got)
        if case.mask_input is not None:
            assert (node.inputs[3] is not None) == case.mask_input
    want_fn, got_fn = _runner(case, path, module, graph, names, tmp_path)
    sizes = (9,) if path.endswith("_static") else case.sizes
    for s in sizes:
        torch.manual_seed(s)
        args = case.inputs(2, s)
        with torch.no_grad():
            want, got = want_fn(*args), got_fn(*args)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m, s=s: f"s={s}: {m}")


@pytest.mark.parametrize("path", ALL)
def test_nan_inputs_propagate_as_in_eager(path: str, tmp_path: Path) -> None:
    """A NaN token poisons exactly the outputs it poisons in the original (a padding-masked cross attention,
    whose mask stays explicit: every key is read by both)."""
    case = CASES["cross_attention"]
    module, graph, _, names = _fused_graph(case, path, tmp_path)
    want_fn, got_fn = _runner(case, path, module, graph, names, tmp_path)
    x, mem, keep = case.inputs(2, 7)
    x[0, 3, 1] = float("nan")
    mem[1, 5, 0] = float("inf")
    with torch.no_grad():
        want, got = want_fn(x, mem, keep), got_fn(x, mem, keep)
    assert want.isnan().any() and not want.isnan().all()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_finfo_causal_beside_padding_would_differ() -> None:
    """Why that case is refused: a row whose earlier keys the padding all drops weighs the later keys in
    eager; FusedAttention(causal=1, mask=padding) would weigh no key (NaN)."""
    from tkopt.fused_ops import run_reference

    torch.manual_seed(0)
    m = FinfoCausalPlusPadding().eval()
    x = _x(1, 6)
    pad = torch.zeros(1, 6)
    pad[0, :3] = F32_MIN  # left padding: row 1 sees keys 0, 1 (both padded) and, in eager, later keys
    want = m(x, pad)
    q, k, v = _qkv(x)
    fused = run_reference("FusedAttention", [q, k, v, pad[:, None, None, :]],
                          {"causal": 1, "scale": 1 / math.sqrt(D), "guard": "none"})[0]
    assert (_merge(fused)[0, 1] - want[0, 1]).abs().max() > 0.1 or _merge(fused)[0, 1].isnan().any()


# ---- dtypes and broadcasting on ONNX graphs -----------------------------------------------------------
def _onnx(nodes: list, inputs: list, outputs: list, inits: list | None = None) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _optimized(model: onnx.ModelProto):
    graph = import_onnx(model)
    report = run_passes(graph)
    out = export_ir(graph)
    onnx.checker.check_model(out, full_check=True)
    return graph, report, out


def test_integer_matmul_relu_stays_unfused() -> None:
    """Defect 6: FusedGemm declares float dtypes only; an int32 MatMul + Relu is left as it was, and the model
    still passes the checker and runs."""
    t = onnx.TensorProto
    w = onnx.numpy_helper.from_array(np.arange(32, dtype=np.int32).reshape(8, 4) - 16, "w")
    model = _onnx([onnx.helper.make_node("MatMul", ["x", "w"], ["y"]), onnx.helper.make_node("Relu", ["y"], ["z"])],
                  [onnx.helper.make_tensor_value_info("x", t.INT32, ["b", 8])],
                  [onnx.helper.make_tensor_value_info("z", t.INT32, ["b", 4])], [w])
    graph, report, out = _optimized(model)
    assert not any(n.is_fused for n in graph.nodes)
    assert any("FusedGemm takes one dtype for its float tensors" in r.reason for r in report.refusals), report.refusals
    x = {"x": np.arange(24, dtype=np.int32).reshape(3, 8) - 12}
    np.testing.assert_array_equal(run_model(out, x)["z"], run_model(model, x)["z"])


@pytest.mark.parametrize("head", ["norm", "gemm"])
def test_residual_of_another_symbolic_dim_is_not_fused(head: str) -> None:
    """Defect 8: a residual whose batch dim has another name may be 1 at run time (ONNX broadcasting): the
    residual Add stays unfused (FusedAddNorm / FusedGemm add row by row), and the model runs fed batch 1."""
    t = onnx.TensorProto
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    g = onnx.numpy_helper.from_array(np.ones(16, np.float32), "g")
    if head == "norm":
        nodes = [onnx.helper.make_node("Add", ["x", "r"], ["s"]),
                 onnx.helper.make_node("LayerNormalization", ["s", "g"], ["y"], axis=-1)]
    else:
        nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["m"]), onnx.helper.make_node("Add", ["m", "r"], ["y"])]
    model = _onnx(nodes, [onnx.helper.make_tensor_value_info("x", t.FLOAT, ["batch", "seq", 16]),
                          onnx.helper.make_tensor_value_info("r", t.FLOAT, ["rbatch", "seq", 16])],
                  [onnx.helper.make_tensor_value_info("y", t.FLOAT, ["batch", "seq", 16])], [w, g])
    graph, report, out = _optimized(model)
    fused = [n for n in graph.nodes if n.is_fused]
    assert len(fused) == 1 and fused[0].inputs[1 if head == "norm" else 3] is None
    assert any("is not provably" in r.reason for r in report.refusals) or head == "gemm", report.refusals
    feeds = {"x": rng.standard_normal((3, 5, 16)).astype(np.float32),
             "r": rng.standard_normal((1, 5, 16)).astype(np.float32)}
    np.testing.assert_allclose(run_model(out, feeds)["y"], run_model(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_mask_of_another_symbolic_dim_is_refused(tmp_path: Path) -> None:
    """The same class for masks: a key mask whose length has its own name (fed 1 at run time, it broadcasts)
    would be read at full length by the kernels' static broadcast flags: refused with the axis named."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            q, k, v = _qkv(x)
            return _attend(q @ k.transpose(-1, -2) / math.sqrt(D) + mask[:, None, None, :], v)

    file = tmp_path / "m.onnx"
    torch.onnx.export(M(), (_x(2, 5), torch.zeros(2, 5)), str(file), dynamo=False, input_names=["x", "mask"],
                      dynamic_axes={"x": {0: "b", 1: "s"}, "mask": {0: "b", 1: "t"}})
    graph = import_onnx(file)
    report = run_passes(graph)
    assert not any(n.op == "FusedAttention" for n in graph.nodes)
    assert any("its axis 3 is neither 1 nor the scores' s" in r.reason for r in report.refusals), report.refusals
    feeds = {"x": _x(2, 6).numpy(), "mask": np.zeros((2, 1), np.float32)}  # t = 1 broadcasts
    got, want = (next(iter(run_model(m, feeds).values())) for m in (export_ir(graph), onnx.load(file)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_hf_causal_mask_from_positions_is_proven(model_type: str) -> None:
    """A transformers decoder called without attention_mask builds its mask from positions (iotas indexed
    by aten::index, the packed-sequence check cumsum(diff(positions) != 1)): proven causal, causal=1,
    fused == eager at lengths 1, 7 and 37."""
    from tkopt.models.hf import tiny_model

    class Body(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids, use_cache=False).logits

    torch.manual_seed(0)
    module = Body(tiny_model(model_type, "AutoModelForCausalLM", num_hidden_layers=1)).eval()
    ids = torch.randint(1, 100, (2, 9))
    ep = torch.export.export(module, (ids,), dynamic_shapes=({0: Dim("b", max=8), 1: Dim("s", max=64)},))
    graph = import_fx(ep)
    run_passes(graph)
    fused = [n for n in graph.nodes if n.op == "FusedAttention"]
    assert fused and all(n.attrs["causal"] == 1 and n.inputs[3] is None for n in fused), [n.attrs for n in fused]
    gm = to_torch_module(graph)
    for s in (1, 7, 37):
        x = torch.randint(1, 100, (2, s))
        with torch.no_grad():
            torch.testing.assert_close(gm(x), module(x), rtol=1e-4, atol=1e-5)


class _Padded(nn.Module):
    """A transformers model called with input_ids and attention_mask, returning its first output."""

    def __init__(self, model: nn.Module, **kwargs: object) -> None:
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=keep, **self.kwargs)[0]


def _check_padding_split(module: nn.Module, causal: int) -> None:
    """Export `module` (a _Padded) with dynamic batch and length; every FusedAttention gets `causal` and the
    (b, 1, 1, s) padding as its mask, and fused == eager with right, left and full padding of a row, at
    lengths 1, 7 and 37."""
    ids, keep = torch.randint(1, 100, (3, 9)), torch.ones(3, 9, dtype=torch.int64)
    dims = ({0: Dim("b", max=8), 1: Dim("s", max=64)},) * 2
    graph = import_fx(torch.export.export(module, (ids, keep), dynamic_shapes=dims))
    run_passes(graph)
    fused = [n for n in graph.nodes if n.op == "FusedAttention"]
    assert fused and all(n.attrs["causal"] == causal for n in fused), [n.attrs for n in fused]
    assert all(n.inputs[3] is not None and n.inputs[3].shape[1:3] == (1, 1) for n in fused), [n.inputs for n in fused]
    gm = to_torch_module(graph)
    for s in (1, 7, 37):
        x, keep = torch.randint(1, 100, (3, s)), torch.ones(3, s, dtype=torch.int64)
        keep[0, s // 2 + 1:] = 0  # right padding
        keep[1, : s // 2] = 0  # left padding: its first rows see no key
        keep[2, :] = 0 if s == 1 else keep[2, :]
        with torch.no_grad():
            torch.testing.assert_close(gm(x, keep), module(x, keep), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_hf_causal_and_padding_mask_splits_into_causal_and_the_padding(model_type: str) -> None:
    """Called with attention_mask, a transformers decoder's traced mask is causal And padding (eager, seeing
    no padding, would pass none). Keeping is causality and the padding, elementwise, so FusedAttention gets
    causal=1 and the (b, 1, 1, s) padding factor as its mask."""
    from tkopt.models.hf import tiny_model

    torch.manual_seed(0)
    lm = tiny_model(model_type, "AutoModelForCausalLM", num_hidden_layers=1)
    _check_padding_split(_Padded(lm, use_cache=False).eval(), causal=1)


def test_hf_encoder_padding_mask_reaches_the_kernel_as_key_padding() -> None:
    """transformers' BERT builds its mask as padding (b, 1, 1, s) And q >= 0 (true for every query), expanded to
    (b, 1, s, s). The factor that keeps everything and the Expand come out, so FusedAttention reads the (b, 1,
    1, s) key padding (the kernels' key-only path), causal=0."""
    from tkopt.models.hf import tiny_model

    torch.manual_seed(0)
    _check_padding_split(_Padded(tiny_model("bert", num_hidden_layers=1)).eval(), causal=0)


def _sdpa_masks(graph: object) -> list[object]:
    """The mask input of every attention node left in `graph`: FusedAttention's and SDPA's."""
    return [n.inputs[3] for n in graph.nodes if n.op in ("FusedAttention", "ScaledDotProductAttention")]


@pytest.mark.parametrize("model_type", ["bert", "vit"])
@pytest.mark.parametrize("fuse", [True, False])
def test_hf_encoder_mask_that_keeps_everything_is_left_out(model_type: str, fuse: bool) -> None:
    """Called without attention_mask, transformers' encoders trace their mask as q >= 0 expanded to (b, 1, s,
    s), where eager passes none. It keeps every score at every
    size, so it is left out: FusedAttention, or the unfused SDPA (attention fusion disabled), runs without a
    mask (torch's maskless kernels), and the result equals eager at other batches and lengths."""
    from tkopt.models.hf import TensorsIn, tiny_model

    torch.manual_seed(0)
    if model_type == "vit":  # called as most users first call them: pixel_values, or input_ids, alone
        module = TensorsIn(tiny_model("vit", image_size=16, patch_size=4, num_hidden_layers=1), ["pixel_values"])
        make = lambda b, s: torch.randn(b, 3, 16, 16)  # noqa: E731 - s: the image has one size
        dims: dict = {0: Dim("b", max=8)}
    else:
        module = TensorsIn(tiny_model("bert", num_hidden_layers=1), ["input_ids"])
        make = lambda b, s: torch.randint(1, 100, (b, s))  # noqa: E731
        dims = {0: Dim("b", max=8), 1: Dim("s", max=64)}
    graph = import_fx(torch.export.export(module, (make(2, 9),), dynamic_shapes=((dims,),)))  # *tensors
    report = run_passes(graph, disable=() if fuse else ["attention"])
    assert report.edits.get("drop_keep_all_masks") == 1, report.edits
    masks = _sdpa_masks(graph)
    assert masks == [None], masks
    assert any(n.op == "FusedAttention" for n in graph.nodes) == fuse
    # what runs unfused, and what selection times a fusion against, is SDPA without the mask
    sdpa_op = torch.ops.aten.scaled_dot_product_attention.default
    gm = to_torch_module(graph)
    if fuse:
        [n] = [n for n in graph.nodes if n.op == "FusedAttention"]
        gm_tiny, args = replaced_module(graph, n, capture_values(graph.meta["fx_module"], [n], (make(2, 9),)))
        [call] = gm_tiny.graph.find_nodes(op="call_function", target=sdpa_op)
        assert call.args[3] is None and len(args) == 3, (call.args, len(args))
    else:
        [call] = gm.graph.find_nodes(op="call_function", target=sdpa_op)
        assert call.args[3] is None, call.args
    for b, s in ((1, 1), (3, 7), (2, 37)):
        x = make(b, s)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), module(x), rtol=1e-4, atol=1e-5)


def test_the_backends_encoder_mask_that_keeps_everything_is_left_out() -> None:
    """The torch.compile backend's graph of the same BERT: its fused attention reads no mask, fused == eager."""
    from tkopt.backends.dynamo import make_backend
    from tkopt.models.hf import tiny_model

    torch.manual_seed(0)
    model = tiny_model("bert", num_hidden_layers=1).eval()
    backend = make_backend(select="all", inductor=False)
    x = torch.randint(1, 100, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x)[0], model(x)[0], rtol=1e-4, atol=1e-5)
    [n] = [n for n in backend.graph_modules[-1].graph.nodes if "fused_attention" in str(n.target)]
    assert n.args[3] is None, n.args


@pytest.mark.parametrize("form", ["iota", "zeros", "filled", "iota1", "ones"])
def test_only_a_mask_that_changes_no_score_is_left_out(form: str) -> None:
    """A bool mask that keeps everything, an additive mask of zeros, or -inf filled where nothing is dropped, is
    left out at every admitted length; the near misses (_KeepAll) keep theirs. Fused == eager either way."""
    module = _KeepAll(form)
    dims = ({0: Dim("b", max=8), 1: Dim("s", max=32)},)
    graph = import_fx(torch.export.export(module, (_x(2, 6),), dynamic_shapes=dims))
    report = run_passes(graph)
    dropped = form in ("iota", "zeros", "filled")
    assert (_sdpa_masks(graph) == [None]) == dropped, (_sdpa_masks(graph), report.refusals)
    assert bool(report.edits.get("drop_keep_all_masks")) == dropped, report.edits
    gm = to_torch_module(graph)
    for b, s in ((1, 1), (3, 7), (2, 19)):
        x = _x(b, s)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), module(x), rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_decomposed_mask_that_keeps_everything_is_left_out() -> None:
    """The same in a decomposed attention: Where(q >= 0, scores, -inf) keeps every score, so FusedAttention gets
    no mask. Near misses: with q >= 1 it keeps its mask; a condition that keeps everything but has batch 2
    against Q's 1 widens the scores to batch 2, so it stays, and that attention is refused."""

    class M(nn.Module):
        def __init__(self, first: int, batch: int = 1) -> None:
            super().__init__()
            self.first, self.batch = first, batch

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = _qkv(x)
            i = torch.arange(x.shape[1])
            w = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            keep = (i >= self.first)[None, None, :, None].expand(self.batch, 1, -1, 1)
            return (torch.where(keep, w, float("-inf")).softmax(-1) @ v).sum(1)

    for first, batch in ((0, 1), (1, 1), (0, 2)):
        module = M(first, batch)
        graph = import_fx(torch.export.export(module, (_x(1, 6),), dynamic_shapes=({1: Dim("s", max=32)},)))
        report = run_passes(graph)
        fused = [n for n in graph.nodes if n.op == "FusedAttention"]
        if batch == 2:
            assert not fused and report.refusals, report.refusals
        else:
            assert len(fused) == 1 and (fused[0].inputs[3] is None) == (first == 0), fused
        for s in (1, 7):
            x = _x(1, s)
            with torch.no_grad():
                torch.testing.assert_close(to_torch_module(graph)(x), module(x), rtol=1e-5, atol=1e-6,
                                           equal_nan=True)


def test_a_mask_factor_that_drops_some_query_stays_in_the_mask() -> None:
    """Near miss of the encoder's split: padding And q >= 1 drops query 0's every key, so that factor does not
    keep everything and must stay: the mask input is the whole (b, 1, s, s) mask, and fused == eager."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            s = x.shape[1]
            rows = (torch.arange(s) >= 1)[None, None, :, None]
            mask = (keep.bool()[:, None, None, :] & rows).expand(x.shape[0], 1, s, s)
            q = x.view(x.shape[0], s, H, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    x, keep = _x(2, 6), torch.ones(2, 6, dtype=torch.int64)
    graph = import_fx(torch.export.export(M(), (x, keep), dynamic_shapes=({0: Dim("b"), 1: Dim("s")},) * 2))
    run_passes(graph)
    [fused] = [n for n in graph.nodes if n.op == "FusedAttention"]
    assert fused.inputs[3] is not None and fused.inputs[3].shape[2] != 1, fused.inputs
    gm = to_torch_module(graph)
    x, keep = _x(2, 7), torch.ones(2, 7, dtype=torch.int64)
    keep[1, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(gm(x, keep), M()(x, keep), rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_hf_causal_and_padding_mask_splits_in_dynamos_graph_too(device: str) -> None:
    """The torch.compile backend traces SDPA decomposed into the kernel torch picks on the tracing device: on the
    CPU the mask arrives as Where(causal And padding, 0, -inf) added to the scores; on CUDA as masked_fill(zeros,
    Not(causal And padding), -inf), expanded to every head and padded then sliced back (the efficient kernel's
    bias; H200: GPT-2's attention then ran its full-mask path, 0.230 ms against tkopt.compile's 0.073). Both
    split the same way."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tkopt.backends.dynamo import make_backend
    from tkopt.models.hf import tiny_model

    torch.manual_seed(0)
    lm = tiny_model("gpt2", "AutoModelForCausalLM", num_hidden_layers=1).eval().to(device)
    backend = make_backend(select="all", inductor=False)
    fast = torch.compile(lm, backend=backend)
    x, keep = torch.randint(1, 100, (2, 11), device=device), torch.ones(2, 11, dtype=torch.int64, device=device)
    keep[0, :4] = 0
    with torch.no_grad():
        got = fast(input_ids=x, attention_mask=keep, use_cache=False).logits
        torch.testing.assert_close(got, lm(input_ids=x, attention_mask=keep, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-5)
    [n] = [n for n in backend.graph_modules[-1].graph.nodes if "fused_attention" in str(n.target)]
    causal, mask = n.args[6], n.args[3].meta["val"]  # after Q, K, V, mask, kept and scale
    assert causal == 1 and tuple(mask.shape) == (2, 1, 1, 11), (n.args, mask.shape)


def _cuda_style_bias(keep: torch.Tensor, dtype: torch.dtype, heads: int, form: str) -> torch.Tensor:
    """SDPA's conversion of bool mask `keep` (b, 1, s, s) to the float bias CUDA's efficient kernel reads: zeros
    with -inf where it drops, expanded to every head, padded to a multiple of 16 keys and sliced back. `form`
    names a near miss instead: "left_pad" pads before the keys (the slice then reads shifted), "ones" fills a
    base of ones (a bias, not a mask), "finite" fills -1e4."""
    b, _, s, _ = keep.shape
    base = torch.ones_like(keep, dtype=dtype) if form == "ones" else torch.zeros_like(keep, dtype=dtype)
    bias = base.masked_fill(keep.logical_not(), -1e4 if form == "finite" else float("-inf"))
    bias = bias.expand(b, heads, s, s)
    pad = 16 - s % 16
    return F.pad(bias, (1, pad - 1) if form == "left_pad" else (0, pad))[..., :s]


@pytest.mark.parametrize("form", ["cuda", "left_pad", "ones", "finite"])
def test_cuda_sdpas_float_bias_of_causal_and_padding_splits_and_its_near_misses_do_not(form: str) -> None:
    """The CUDA form of SDPA's bias (_cuda_style_bias) made of causal And padding splits into causal=1 and the
    (b, 1, 1, s) padding, as the Where form does. Near misses keep causal=0 and their whole mask: a left pad
    (what the slice reads is shifted), a base of ones and a finite fill (values that are no 0/-inf mask).
    Fused == eager either way, a row right-padded. Exported per length (1, 7, 37; batch dynamic), as the backend
    first traces: a dynamic length gives the pad width a guard torch.export cannot prove."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            q, k, v = _qkv(x)
            i = torch.arange(x.shape[1])
            mask = (i[None, :] <= i[:, None])[None, None] & keep.bool()[:, None, None, :]
            bias = _cuda_style_bias(mask.expand(x.shape[0], 1, -1, -1), q.dtype, H, form)
            return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=bias))

    for s in (1, 7, 37):
        x, keep = _x(3, s), torch.ones(3, s, dtype=torch.int64)
        keep[0, s // 2 + 1:] = 0
        graph = import_fx(torch.export.export(M(), (x, keep), dynamic_shapes=({0: Dim("b", max=8)},) * 2))
        run_passes(graph)
        [fused] = [n for n in graph.nodes if n.op == "FusedAttention"]
        mask = fused.inputs[3]
        if form == "cuda" and s > 1:  # one key: (b, H, 1, 1), nothing to split
            assert fused.attrs["causal"] == 1 and mask is not None and mask.shape[1:3] == (1, 1), (s, mask)
        elif s > 1:
            assert fused.attrs["causal"] == 0 and mask is not None and mask.shape[2] == s, (s, fused.attrs, mask)
        with torch.no_grad():
            torch.testing.assert_close(to_torch_module(graph)(x, keep), M()(x, keep), rtol=1e-5, atol=1e-6,
                                       equal_nan=True)


@pytest.mark.parametrize("combine", ["or", "anticausal"])
def test_mask_combined_otherwise_keeps_its_full_mask(combine: str) -> None:
    """Near misses of the split: causal Or padding keeps more than causality does, and an anti-causal
    factor (key j >= query i) is no causal proof: causal=0, the whole mask stays the input, fused == eager."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            q, k, v = _qkv(x)
            i = torch.arange(x.shape[1])
            tri = i[None, :] <= i[:, None] if combine == "or" else i[None, :] >= i[:, None]
            keep = (tri | pad[:, None, None, :]) if combine == "or" else (tri & pad[:, None, None, :])
            return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))

    x, pad = _x(2, 6), torch.tensor([[True] * 6, [False] * 2 + [True] * 4])
    s = Dim("s", max=32)
    graph = import_fx(torch.export.export(M(), (x, pad), dynamic_shapes=({1: s}, {1: s})))
    run_passes(graph)
    [n] = [n for n in graph.nodes if n.op == "FusedAttention"]
    assert n.attrs["causal"] == 0 and n.inputs[3].shape[2] != 1, (n.attrs, n.inputs[3])
    with torch.no_grad():
        torch.testing.assert_close(to_torch_module(graph)(x, pad), M()(x, pad), rtol=1e-5, atol=1e-6)


def test_float64_default_scale_survives_onnx_attributes(tmp_path: Path) -> None:
    """The TorchScript export computes SDPA's 1/sqrt(d) in the graph; as FusedAttention's float attribute
    (32 bits in ONNX) it lost float64 precision (fuzz seed 120: 3.5e-9 relative). The default scale is
    written as the default (0: computed at run time)."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, 1, 2).transpose(1, 2) for t in (x, x.tanh(), x * 0.5))
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 2)

    file = tmp_path / "m.onnx"
    x = torch.randn(3, 5, 2, dtype=torch.float64)
    torch.onnx.export(M(), (x,), str(file), dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "b", 1: "s"}})
    graph = import_onnx(file)
    run_passes(graph)
    assert [n.attrs["scale"] for n in graph.nodes if n.op == "FusedAttention"] == [0.0]
    feeds = {"x": x.numpy()}
    got, want = (next(iter(run_model(m, feeds).values())) for m in (export_ir(graph), onnx.load(file)))
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
