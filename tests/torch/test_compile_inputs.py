"""What tkopt.compile accepts as example inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tkopt


def test_a_bare_tensor_is_the_one_positional_input() -> None:
    """tuple(tensor) would split it along dim 0 into many arguments (issue 8: 'too many positional arguments')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval()
    x = torch.randn(3, 5, 8)
    compiled = tkopt.compile(model, x)
    assert compiled.tkopt_report.fusions["gemm"] == 1
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x[:1]), model(x[:1]))


def test_without_example_inputs_the_export_waits_for_the_first_call() -> None:
    """`tkopt.compile(module)` then `module(x)`, as torch.compile is used: it exported with no arguments and
    failed inside torch.export ("forward() missing 1 required positional argument")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval()
    compiled = tkopt.compile(model, select="all")
    with pytest.raises(RuntimeError, match="nothing is compiled yet: the module exports at its first call"):
        compiled.tkopt_report  # noqa: B018 - the property is the check
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(compiled(x), model(x))
    assert compiled.tkopt_report.fusions["gemm"] == 1 and len(compiled.specializations) == 1
    torch.testing.assert_close(compiled(x[:1]), model(x[:1]))  # another size: exported again, dynamic
    assert len(compiled.specializations) == 2


def test_an_empty_example_is_a_module_without_arguments() -> None:
    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self) -> torch.Tensor:
            return torch.relu(self.w @ self.w)

    model = Constant().eval()
    compiled = tkopt.compile(model, ())
    assert len(compiled.specializations) == 1
    torch.testing.assert_close(compiled(), model())


def test_a_size_the_exports_guards_refuse_gets_its_own_specialization(monkeypatch) -> None:
    """torch.export's range can admit a size its guards refuse: GPT-2's causal mask is sliced from a 128-row
    buffer, so seq is in [2, 128] and seq != 128. A call there raised "Guard failed" from the program; it is
    exported and optimized anew, as any size outside the range is."""
    from tkopt.models import blocks

    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    torch.manual_seed(0)
    model = blocks.GPT2Block(blocks.GPT2BlockConfig(hidden=64, heads=4, max_seq=128)).eval()
    compiled = tkopt.compile(model, model.example_inputs(batch=2, seq=77), select="all", dynamic=True)
    with torch.no_grad():
        for seq, programs in ((100, 1), (128, 2), (90, 2)):
            inputs = model.example_inputs(batch=2, seq=seq)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
            assert len(compiled.specializations) == programs


def test_a_program_decides_once_per_input_shape_whether_it_serves_a_call(monkeypatch) -> None:
    """Binding a call's sizes to the export's symbols and ranges took ~100 us of host time on every call, on the
    H200 more than a CUDA-graph replay of an encoder layer leaves to spare; it is decided once per shape."""
    from tkopt.models import blocks
    from tkopt.torch_compile import Specialization

    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    decided = []
    real = Specialization._accepts
    monkeypatch.setattr(Specialization, "_accepts",
                        lambda self, flat: decided.append(flat[0].shape) or real(self, flat))
    torch.manual_seed(0)
    model = blocks.GPT2Block(blocks.GPT2BlockConfig(hidden=64, heads=4, max_seq=128)).eval()
    compiled = tkopt.compile(model, model.example_inputs(batch=2, seq=77), select="all", dynamic=True)
    with torch.no_grad():
        for seq in (77, 77, 100, 100, 77):
            inputs = model.example_inputs(batch=2, seq=seq)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert [s[1] for s in decided] == [77, 100] and len(compiled.specializations) == 1


def test_the_export_records_no_stack_traces(monkeypatch) -> None:
    """Recording each node's Python stack was ~10% of exporting BERT-base, and nothing reads them: the export
    skips it where torch can (torch.fx.config.do_not_emit_stack_traces), and leaves the setting as it was."""
    from torch.fx import config

    if not hasattr(config, "do_not_emit_stack_traces"):
        pytest.skip("this torch always records stack traces")
    monkeypatch.setenv("TKOPT_KERNELS", "reference")
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval()
    compiled = tkopt.compile(model, torch.randn(3, 8), select="all")
    exported = compiled.specializations[0].graph.meta["exported_program"]
    traced = [n for n in exported.graph.nodes if n.op == "call_function"]
    assert traced and not any(n.meta.get("stack_trace") for n in traced)
    assert config.do_not_emit_stack_traces is False


class DataDependent(nn.Module):
    """A branch on a tensor's value: torch.export cannot export it (a guard on data), Dynamo breaks the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        if h.sum() > 0:
            return self.down(h) * 2
        return self.down(h) - 1


def test_a_module_torch_export_cannot_export_runs_through_the_backend() -> None:
    """Longformer and LED (padding to the attention window) failed inside torch.export with its multi-page
    GuardOnDataDependentSymNode error; they run through torch.compile(backend="tkopt") with a one-line warning."""
    torch.manual_seed(0)
    model = DataDependent().eval()
    x = torch.randn(3, 5, 8)
    with pytest.warns(UserWarning, match=r"torch.export cannot export DataDependent \(\w+: .*\); compiling it with "
                      r"torch.compile\(backend=\"tkopt\"\) instead"):
        compiled = tkopt.compile(model, x, select="all")
    with torch.no_grad():
        for inputs in (x, -x, x[:1]):  # both branches, another size
            torch.testing.assert_close(compiled(inputs), model(inputs))
    assert not compiled.specializations and compiled.export_error.startswith("GuardOnDataDependentSymNode: ")
    assert sum(r.fusions["gemm"] for r in compiled.backend_reports) >= 1
    assert compiled.tkopt_report is compiled.backend_reports[-1]
    assert compiled.state_dict().keys() == {f"module.{k}" for k in model.state_dict()}


def test_check_accuracy_needs_an_exported_program() -> None:
    with pytest.raises(RuntimeError, match="torch.export cannot export DataDependent .*check_accuracy needs an "
                       "exported program"):
        tkopt.compile(DataDependent().eval(), torch.randn(2, 8), check_accuracy=True)


def test_plain_tensor_arguments_flatten_as_the_boxed_path_does() -> None:
    """Calls of plain tensors skip boxing and pytree (their host time outran a small model's CUDA graph); the
    program must still get exactly what boxing gives it, positional and keyword, and any other call boxes."""
    import torch.utils._pytree as pytree

    from tkopt.object_trees import Boxer
    from tkopt.torch_compile import CompiledModule

    compiled = CompiledModule(nn.Identity(), (), None, True, None, "all")
    x, y, z = torch.randn(3, 2), torch.randn(3), torch.randn(4)
    for args, kwargs in (((x,), {}), ((x, y), {"mask": z}), ((), {"b": y, "a": x})):
        boxer = Boxer()
        boxed = boxer.box((args, kwargs))
        want_flat, want_spec = pytree.tree_flatten((boxed, {}))
        for _ in range(2):  # the spec computed, then remembered
            objects, got_boxed, flat, spec = compiled._flatten(args, kwargs)
            assert objects == [] and got_boxed == boxed and spec == want_spec
            assert all(a is b for a, b in zip(flat, want_flat, strict=True))
    holder = type("Holder", (), {})()
    holder.t = x
    objects, _, flat, _ = compiled._flatten((holder, nn.Parameter(y)), {})
    assert objects == [holder] and len(flat) == 2  # an object is boxed; a Parameter is not a plain tensor
    model = nn.Sequential(nn.Linear(2, 2)).eval()
    compiled = tkopt.compile(model, (x,), select="all")
    assert compiled.specializations[0].in_spec is compiled._flatten((x,), {})[3]  # compared by identity per call
