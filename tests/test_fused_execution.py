"""Fused graphs run on the TileLang kernels: tkopt.compile and torch.compile(backend="tkopt") on CPU
(TileLang's C backend) and, marked gpu, on the GPU for each arch variant."""

from __future__ import annotations

import warnings

import pytest
import torch

import tkopt
from tkopt.backends.dynamo import make_backend
from tkopt.models import blocks
from tkopt.models.blocks import EXPECTED_FUSIONS, REFERENCE_MODELS


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("name", ["bert_layer", "llama_block"])
def test_compile_runs_cpu_kernels_and_matches_eager(name: str, monkeypatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no kernel may fall back here
        fast = tkopt.compile(model, inputs, select="all")
    report = fast.tkopt_report
    assert report.decided("kernel_failed") == []
    assert {k: report.fusions.get(k, 0) for k in EXPECTED_FUSIONS[name]} == EXPECTED_FUSIONS[name]
    ops = {str(n.target) for n in fast.graph_module.graph.nodes if n.op == "call_function"}
    assert any(op.startswith("tkopt.") for op in ops)
    with torch.no_grad():
        assert _rel(fast(*inputs), model(*inputs)) < 1e-5
        assert fast.uncaptured_reason == "inputs are not all CUDA tensors"  # CUDA graphs are for GPU calls
        # Another batch and sequence length (not tile multiples): the dynamic kernels serve it.
        bigger = tuple(
            t.repeat(3, *([1] * (t.dim() - 1)))[:, : t.shape[1] - 1] if t.dim() >= 2 else t for t in inputs
        )
        assert _rel(fast(*bigger), model(*bigger)) < 1e-5


def test_compile_with_inductor_for_the_rest(monkeypatch) -> None:
    """inductor=True: inductor compiles what tkopt left unfused and calls the tkopt:: ops as extern kernels."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS["gpt2_block_sdpa"]()
    fast = tkopt.compile(model, inputs, inductor=True, select="all")
    assert fast.specializations[-1].run is not fast.graph_module  # calls go through torch.compile
    assert fast.tkopt_report.total_fused > 0
    with torch.no_grad():
        assert _rel(fast(*inputs), model(*inputs)) < 1e-5


def test_inductor_compiles_the_first_signature_without_dynamo(monkeypatch) -> None:
    """tkopt.compile's program is compiled by inductor directly at its first input signature: Dynamo traces
    nothing there (it would trace again what the export traced). A new signature goes through torch.compile
    with its guards, and both match eager."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS["gpt2_block_sdpa"]()
    fast = tkopt.compile(model, inputs, inductor=True, select="all", dynamic=True)
    run = fast.specializations[-1].run
    bigger = tuple(torch.randn(x.shape[0] + 1, *x.shape[1:]) if x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        traced = counters["stats"]["unique_graphs"]
        assert _rel(fast(*inputs), model(*inputs)) < 1e-5
        assert counters["stats"]["unique_graphs"] == traced and run.traced is None
        assert _rel(fast(*bigger), model(*bigger)) < 1e-5
        assert counters["stats"]["unique_graphs"] > traced and run.traced is not None
        again = counters["stats"]["unique_graphs"]
        assert _rel(fast(*inputs), model(*inputs)) < 1e-5  # the first signature's code, still
        assert counters["stats"]["unique_graphs"] == again


def test_inductor_failure_falls_back_to_the_fused_graph() -> None:
    """If inductor cannot compile the remainder, the fused graph runs as it is, after one warning."""
    from tkopt.backends.inductor import InductorOrEager

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 3))
    run = InductorOrEager(gm, dynamic=False)

    def broken(*args):
        raise RuntimeError("inductor lowering failed")

    run.compiled = broken
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="inductor failed on the unfused remainder .*lowering failed"):
        assert torch.equal(run(x), gm(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(run(x), gm(x))  # warned once; eager from then on


def test_kernel_failure_falls_back_to_the_unfused_subgraph(monkeypatch) -> None:
    """The CPU kernels take float32/float64: a float16 module keeps every node unfused, with a warning
    naming each, and still runs (matching eager exactly, since it is eager's own graph). The report counts
    none of them as fused (it once counted what the passes fused, whatever ran)."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS["mlp"]()
    model = model.half()
    inputs = tuple(t.half() for t in inputs)
    with pytest.warns(UserWarning, match=r"FusedGemm_\d+ \(FusedGemm\) runs unfused on cpu: its kernel failed"):
        fast = tkopt.compile(model, inputs, select="all")
    report = fast.tkopt_report
    assert report.total_fused == 0 and not any(report.fusions.values()) and "fused: 0 of 3 candidates" in str(report)
    fallbacks = report.decided("kernel_failed")
    assert len(fallbacks) == report.passes.fusions["gemm"] == EXPECTED_FUSIONS["mlp"]["gemm"]
    assert all("float16" in d.reason for d in fallbacks)
    ops = {str(n.target) for n in fast.graph_module.graph.nodes if n.op == "call_function"}
    assert not any(op.startswith("tkopt.") for op in ops)
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), model(*inputs), rtol=0, atol=0)


def test_torch_compile_backend_runs_cpu_kernels(monkeypatch) -> None:
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    model, inputs = REFERENCE_MODELS["gpt2_block_sdpa"]()
    fast = torch.compile(model, backend=make_backend(select="all"))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a kernel falling back (e.g. probed under fake mode) fails
        assert _rel(fast(*inputs), model(*inputs)) < 1e-5


# The same blocks on the GPU kernels at head dim 64 (the CPU blocks above use 16), sequence 77 (no tile
# multiple), GQA for Llama; and at the head dims of MiniLM (32), Phi (80) and Gemma (256).
GPU_MODELS = {
    "bert_layer": lambda: blocks.BertLayer(blocks.BertLayerConfig(hidden=256, heads=4, ffn=512)),
    "gpt2_block": lambda: blocks.GPT2Block(blocks.GPT2BlockConfig(hidden=256, heads=4, max_seq=128)),
    "llama_block": lambda: blocks.LlamaBlock(blocks.LlamaBlockConfig(hidden=256, heads=4, kv_heads=2, ffn=512)),
    "vit_block": lambda: blocks.ViTBlock(blocks.ViTBlockConfig(hidden=256, heads=4, ffn=512)),
    "bert_layer_d32": lambda: blocks.BertLayer(blocks.BertLayerConfig(hidden=128, heads=4, ffn=512)),
    "llama_block_d80": lambda: blocks.LlamaBlock(blocks.LlamaBlockConfig(hidden=320, heads=4, kv_heads=2, ffn=640)),
    "gpt2_block_d256": lambda: blocks.GPT2Block(blocks.GPT2BlockConfig(hidden=512, heads=2, max_seq=128)),
}
_SAME_FUSIONS_AS = {"bert_layer_d32": "bert_layer", "llama_block_d80": "llama_block", "gpt2_block_d256": "gpt2_block"}
GPU_EXPECTED = {name: EXPECTED_FUSIONS[_SAME_FUSIONS_AS.get(name, name)] for name in GPU_MODELS}
GPU_CASES = [(name, dtype, arch) for name in GPU_MODELS for dtype in (torch.float16, torch.bfloat16)
             for arch in ("sm90", "sm80")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype,arch", GPU_CASES)
def test_compile_on_gpu_matches_eager(name: str, dtype: torch.dtype, arch: str, monkeypatch) -> None:
    """Every reference block on the GPU, on each arch's kernels (sm80 runs on Hopper too), against
    eager in float32 on the same weights: the fp16/bf16 bound of the kernels' tests (1e-2)."""
    if arch == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 kernels need a Hopper GPU")
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TKOPT_ARCH", arch)
    torch.manual_seed(0)
    model = GPU_MODELS[name]().eval().cuda()
    inputs = tuple(t.cuda() for t in model.example_inputs(batch=3, seq=77))
    with torch.no_grad():
        want = model(*inputs)
    model = model.to(dtype)
    cast = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    fast = tkopt.compile(model, cast, select="all")
    assert fast.tkopt_report.decided("kernel_failed") == []
    assert {k: fast.tkopt_report.fusions.get(k, 0) for k in GPU_EXPECTED[name]} == GPU_EXPECTED[name]
    with torch.no_grad():
        assert _rel(fast(*cast), want) < 1e-2


@pytest.mark.gpu
def test_cuda_graph_replay_matches_uncaptured_calls(monkeypatch) -> None:
    """tkopt.compile replays CUDA graphs: fresh inputs are copied in (not the captured ones reused), a new
    shape gets its own graph, results held from an earlier call are not overwritten, and the answers are
    bit-identical to running the same fused module without graphs."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    torch.manual_seed(0)
    model = GPU_MODELS["gpt2_block"]().eval().cuda().half()
    first = tuple(t.cuda().half() if t.is_floating_point() else t.cuda() for t in model.example_inputs(batch=2, seq=77))
    fast = tkopt.compile(model, first, select="all")
    calls = [first, tuple(torch.randn_like(t) for t in first),
             tuple(t.cuda().half() for t in model.example_inputs(batch=3, seq=50))]
    with torch.no_grad():
        graphed = [fast(*x) for x in calls]
        assert fast.uncaptured_reason is None
        assert len(fast.graphs.graphs) == 2  # one per input signature, not per call
        fast.cuda_graphs = False
        plain = [fast(*x) for x in calls]
        for g, p, x in zip(graphed, plain, calls, strict=True):
            assert torch.equal(g, p)
            assert _rel(g, model(*x)) < 1e-2
        assert not torch.equal(graphed[0], graphed[1])
    # inductor for the rest, inside the same CUDA graph
    hybrid = tkopt.compile(model, first, inductor=True, select="all")
    with torch.no_grad():
        for x in calls:
            assert _rel(hybrid(*x), model(*x)) < 1e-2
        assert hybrid.uncaptured_reason is None
    fast.cuda_graphs = True
    out = fast(*first)  # autograd on and the weights require grad: no graph (it would drop autograd)
    assert fast.uncaptured_reason is not None and "autograd" in fast.uncaptured_reason
    assert torch.equal(out.detach(), plain[0])


@pytest.mark.gpu
def test_torch_compile_backend_replays_cuda_graphs(monkeypatch) -> None:
    """torch.compile(backend=tkopt) on the GPU: the optimized forward replays a CUDA graph (parameters are
    captured in place, activations copied in), fresh inputs give fresh answers, held results survive."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    torch.manual_seed(0)
    model = GPU_MODELS["gpt2_block"]().eval().cuda().half()
    x1 = model.example_inputs(batch=2, seq=77)[0].cuda().half()
    x2 = torch.randn_like(x1)
    backend = make_backend(select="all")
    fast = torch.compile(model, backend=backend)
    with torch.no_grad():
        y1, y2 = fast(x1), fast(x2)
        gm = backend.graph_modules[-1]
        assert gm.tkopt_report.total_fused > 0 and gm.tkopt_uncaptured_reason is None
        assert len(gm.tkopt_graphs.graphs) == 1
        assert _rel(y1, model(x1)) < 1e-2 and _rel(y2, model(x2)) < 1e-2
        for p in model.parameters():  # rebinding parameters: the graph read the old addresses, so recapture
            p.data = p.data * 0.5
        assert _rel(fast(x1), model(x1)) < 1e-2


def test_packed_gated_mlp_kernel_halves_weight_and_bias_as_chunk_does() -> None:
    """FusedGatedMLP packed=1 on the TileLang kernel: [Wg | Wu] and [bg | bu] split as torch.chunk(2) splits
    the projection's output (Phi-3's gate_up_proj), against the unfused arithmetic."""
    from tkopt.fused_ops import schema

    op = schema("FusedGatedMLP")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    gate, up = torch.nn.functional.linear(x, w, b).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    attrs = op.full_attrs({"trans_b": 1, "activation": "silu", "packed": 1})
    for run in (op.kernel, op.reference):
        assert _rel(run([x, w, None, b, None], attrs)[0], want) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_packed_gate_up_mlp_on_gpu(arch: str, monkeypatch) -> None:
    """Phi-3's packed gate_up_proj through tkopt.compile on each arch's kernels, fp16, against float32
    arithmetic on the same weights; then a weight update after compiling is seen (halves sliced per call)."""
    if arch == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 kernels need a Hopper GPU")
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setenv("TKOPT_ARCH", arch)
    torch.manual_seed(0)

    class PackedMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up, self.down = torch.nn.Linear(256, 2 * 512, bias=False), torch.nn.Linear(512, 256, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g, u = self.gate_up(x).chunk(2, dim=-1)
            return self.down(torch.nn.functional.silu(g) * u)

    model = PackedMLP().cuda().half()
    x = torch.randn(3, 77, 256, device="cuda")
    fast = tkopt.compile(model, (x.half(),), select="all")
    assert fast.tkopt_report.decided("kernel_failed") == [] and fast.tkopt_report.fusions["gated_mlp"] == 1
    with torch.no_grad():
        for _ in range(2):
            g, u = (x @ model.gate_up.weight.float().T).chunk(2, dim=-1)
            want = (torch.nn.functional.silu(g) * u) @ model.down.weight.float().T
            assert _rel(fast(x.half()), want) < 1e-2
            model.gate_up.weight.mul_(-0.5)
