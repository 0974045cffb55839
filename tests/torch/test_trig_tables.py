"""Broadcast cos/sin tables are computed once by inductor (tkopt.backends.trig_tables), not in every consumer,
on each path that hands tkopt's program to inductor: compile_fx on an exported graph, torch.compile's Dynamo
graph, static and symbolic sizes."""

from __future__ import annotations

import re

import pytest
import torch
import torch._inductor.inductor_prims  # noqa: F401 - registers the barrier's prim
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.export import Dim

import tkopt
from tkopt.backends.inductor import InductorOrEager, compile_graph
from tkopt.backends.trig_tables import realize_broadcast_tables
from tkopt.models.hf import example_inputs, tiny_model

BARRIER = torch.ops.prims.inductor_force_stride_order.default


def _kernels_computing(code: str, op: str) -> int:
    """How many of inductor's generated kernels (C++ or Triton) evaluate `op`."""
    kernels = re.split(r"\n(?=\w+ = async_compile\.)", code)
    return sum(bool(re.search(rf"\b{op}\(", k)) for k in kernels[1:])


class TwoLayerRotary(nn.Module):
    """HF's rotary embedding: one (1, S, D) cos/sin table, applied to q and k of two layers over the heads."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.proj = nn.Linear(dim, dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(q.shape[2], device=q.device)[None].float()
        freqs = (self.inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        for _ in range(2):  # a layer: rotate q and k, then mix them through a linear
            q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
            q = self.proj(q + k)
        return q


def _rotary_inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    return torch.randn(2, 4, seq, 8, generator=g), torch.randn(2, 4, seq, 8, generator=g)


def _export_dynamic(model: nn.Module) -> torch.fx.GraphModule:
    return torch.export.export(model, _rotary_inputs(5), dynamic_shapes=({2: Dim("seq")}, {2: Dim("seq")})).module()


@pytest.mark.parametrize("device, dtype", [
    ("cpu", torch.float32), pytest.param("cuda", torch.float16, marks=pytest.mark.gpu)])
def test_llama_computes_its_rotary_tables_once(device: str, dtype: torch.dtype) -> None:
    """tkopt.compile's program for a tiny HF Llama: inductor computes cos and sin in one kernel each (without
    the barrier, in every layer's q/k kernel), and the logits equal eager's. On CUDA: Triton kernels, fp16."""
    model = tiny_model("llama", "AutoModelForCausalLM").to(device, dtype)
    ids = example_inputs(2, 8)[0].to(device)
    fast = tkopt.compile(model, (ids,), inductor=True, select="all")
    with torch.no_grad():
        out, code = run_and_get_code(fast, ids)
        want = model(ids).logits
    (program,) = [c for c in code if "torch.ops.tkopt." in c]  # inductor's code around the fused nodes
    assert (_kernels_computing(program, "cos"), _kernels_computing(program, "sin")) == (1, 1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.logits, want, rtol=tol, atol=tol)


def test_dynamic_sequence_tables_at_several_sizes() -> None:
    """An export with a symbolic sequence dim, compiled by compile_fx with symbolic fakes (as the torch.compile
    backend does): the barrier's strides are read from the value at run time, so one program serves every
    length, each equal to eager, with cos in one kernel."""
    model = TwoLayerRotary()
    gm = _export_dynamic(model)
    fakes = [p.meta["val"] for p in gm.graph.find_nodes(op="placeholder")]
    assert isinstance(fakes[0].shape[2], torch.SymInt)
    compiled, code = run_and_get_code(compile_graph, gm, fakes)
    assert _kernels_computing(code[0], "cos") == 1
    for seq in (5, 2, 17):
        q, k = _rotary_inputs(seq)
        torch.testing.assert_close(compiled(q, k), model(q, k), rtol=1e-5, atol=1e-5)


def test_dynamo_graph_tables_at_several_sizes() -> None:
    """torch.compile with compile_graph as its backend: Dynamo's graph of a module (Tensor.cos, strides read by
    Tensor.stride) gets the barrier too, and one program with the sequence dim symbolic serves every length."""
    model = TwoLayerRotary()
    compiled = torch.compile(model, backend=compile_graph, fullgraph=True, dynamic=True)
    with torch.no_grad():
        got, code = run_and_get_code(compiled, *_rotary_inputs(5))
        assert [_kernels_computing(c, "cos") for c in code] == [1]
        torch.testing.assert_close(got, model(*_rotary_inputs(5)), rtol=1e-5, atol=1e-5)
        for seq in (3, 17, 1):  # 1: Dynamo specializes it, a static recompile
            q, k = _rotary_inputs(seq)
            torch.testing.assert_close(compiled(q, k), model(q, k), rtol=1e-5, atol=1e-5)


def test_later_signatures_get_the_barrier_through_torch_compile() -> None:
    """InductorOrEager's other input signatures go through torch.compile, whose Dynamo graph of tkopt's exported
    program (aten's cos) gets the barrier as the first signature's compile_fx graph does."""
    model = TwoLayerRotary()
    run = InductorOrEager(_export_dynamic(model), dynamic=True)
    with torch.no_grad():
        run(*_rotary_inputs(5))
        q, k = _rotary_inputs(3)
        got, code = run_and_get_code(run, q, k)
        assert run.traced is not None and [_kernels_computing(c, "cos") for c in code] == [1]
        torch.testing.assert_close(got, model(q, k), rtol=1e-5, atol=1e-5)


def _barriers(module: nn.Module, *args: torch.Tensor) -> int:
    gm = torch.export.export(module, args).module()
    inserted = realize_broadcast_tables(gm, args)
    assert inserted == len(gm.graph.find_nodes(op="call_function", target=BARRIER))
    return inserted


class Elementwise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cos() * x + x.sin()


class BroadcastRsqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ReducedTable(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y * x.cos().sum()  # what is broadcast is the sum, not the table


class ConcatenatedAndGathered(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = x.cos()  # more elements downstream, but each read about once
        return torch.cat((table, x)), table[torch.arange(12) % 3]


def test_only_broadcast_trig_tables_get_a_barrier() -> None:
    x = torch.randn(3, 5)
    assert _barriers(Elementwise(), x) == 0
    assert _barriers(BroadcastRsqrt(), x) == 0  # a norm's rsqrt stays inside inductor's norm kernel
    assert _barriers(ReducedTable(), x, torch.randn(4, 3, 5)) == 0
    assert _barriers(ConcatenatedAndGathered(), x) == 0
    assert _barriers(TwoLayerRotary(), *_rotary_inputs(5)) == 2


class WrappedRotaryTable(nn.Module):
    """HF's rotary embedding as it runs on CUDA: a `@torch.no_grad()` forward with its table computed in an
    autocast-disabled region, scaled, then cast, which torch.export keeps as two nested higher-order ops."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(x.shape[2], device=x.device)[None].float()
        with torch.autocast(device_type="cuda", enabled=False):
            freqs = (self.inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * 0.5, emb.sin() * 0.5
        return cos.to(x.dtype), sin.to(x.dtype)


class WrappedRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = WrappedRotaryTable()

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        cos, sin = (t[:, None] for t in self.table(q))
        for _ in range(2):
            q, k = q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin
        return q + k


def test_tables_inside_higher_order_ops_get_the_barrier() -> None:
    """HF's rotary table inside torch.export's wrap_with_set_grad_enabled and wrap_with_autocast ops: found by
    following the ops' outputs back to cos/sin, realized where the graph broadcasts them (one barrier each),
    and inductor then computes each in one kernel, equal to eager."""
    model, args = WrappedRotary(), _rotary_inputs(5)
    gm = torch.export.export(model, args).module()
    hops = {n.target for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)}
    assert torch.ops.higher_order.wrap_with_set_grad_enabled in hops, hops
    assert _barriers(model, *args) == 2
    compiled, code = run_and_get_code(compile_graph, gm, args)
    assert (_kernels_computing(code[0], "cos"), _kernels_computing(code[0], "sin")) == (1, 1)
    torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-5)


class LearnedFrequencies(nn.Module):
    """A sinusoidal table from learned frequencies: autograd differentiates it."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=x.dtype)[:, None]
        return x * (pos * self.freq).cos()


def test_tables_that_autograd_records_are_left_alone() -> None:
    """The barrier has no autograd formula: a table that depends on a parameter that requires grad keeps no
    barrier while grad is enabled (it gets one under no_grad), and it trains through inductor as in eager."""
    model, x = LearnedFrequencies(), torch.randn(4, 5, 8)
    assert _barriers(model, x) == 0
    with torch.no_grad():
        assert _barriers(model, x) == 1
    compiled = torch.compile(model, backend=compile_graph, fullgraph=True)
    compiled(x).sum().backward()
    got = model.freq.grad.clone()
    model.freq.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(got, model.freq.grad)
