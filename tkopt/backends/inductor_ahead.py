"""Inductor's compile of a program in a child process, ahead of its first call, to fill inductor's FX graph cache.

tkopt.compile on CUDA races its fused program against the same program unfused under inductor (it stands in for
torch.compile, tkopt.pipeline), and both compiled here, one after the other: inductor's compile is Python under
one GIL. The unfused one, as long as torch.compile's own, was the longest stage of a cold compile (a Llama-style
model, profiled: 24.8 of 51 s, then the fused program's 13.5). Compiled in a child while this process builds
kernels, selects and compiles the fused program, its first call here finds inductor's code in the FX graph
cache and only traces (AOTAutograd).

The cache's key is the graph after AOTAutograd, whose parameters and buffers are inputs (their values play no
part), the inputs' metadata, inductor's config and the matmul settings. So the child needs no real tensor:
parameters, buffers and example inputs travel as fakes (shapes, strides, dtypes, devices: no device memory but
the child's CUDA context),
other constants by value (inductor hashes what it inlines). It compiles the copy `inductor.inductor_copy` made
here, under this process's inductor config and matmul settings. A child that fails, or computes another key,
costs only its CPU time: the first call compiles here as it would have, and says nothing wrong.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

log = logging.getLogger(__name__)

# Node meta the child does without: stacks that hold unpicklable objects, and the traced values (a view's fake
# keeps its base's fake mode, which does not pickle); the child traces the values again.
_DROPPED_META = ("source_fn_stack", "nn_module_stack", "fwd_source_fn_stack", "val", "tensor_meta", "example_value",
                 "unbacked_bindings")
# The matmul settings the key reads (torch.backends.cuda.matmul), as they are: setting the precision through
# torch.set_float32_matmul_precision would turn "none" into "ieee", another key.
_MATMUL = ("fp32_precision", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
WAIT_SECONDS = 900.0  # what a first call waits for the child at most, before it compiles here
_DONE = "compiled; seconds since the start:"  # the child's last line
_CHILD = """\
import json, sys
sys.path[:] = json.loads(sys.argv[1])
from tkopt.backends.inductor_ahead import main
main(sys.argv[2:])
"""


def _settings() -> dict[str, Any]:
    """What the FX graph cache's key reads besides the graph and inputs, as this process has it, and the grad mode
    (AOTAutograd makes an inference graph only without grad)."""
    from torch._inductor import config

    matmul = torch.backends.cuda.matmul
    return {"inductor": config.save_config_portable(),
            "matmul": {k: getattr(matmul, k) for k in _MATMUL if hasattr(matmul, k)},
            "deterministic": torch.are_deterministic_algorithms_enabled(), "grad": torch.is_grad_enabled()}


def _apply(settings: dict[str, Any]) -> None:
    from torch._inductor import config

    config.load_config(settings["inductor"])
    for k, v in settings["matmul"].items():
        setattr(torch.backends.cuda.matmul, k, v)
    torch.use_deterministic_algorithms(settings["deterministic"])
    torch.set_grad_enabled(settings["grad"])  # an inference graph, or a training one, as the first call's


def _as_parameter(data: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(data, requires_grad)


def dumps(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bytes:
    """`gm` and its flat example inputs (fakes) as the child loads them: its parameters and buffers as fakes."""
    from torch._guards import detect_fake_mode
    from torch.fx import _graph_pickler
    from torch.fx._graph_pickler import GraphPickler, Options

    mode = detect_fake_mode(list(example_inputs))
    if mode is None:
        raise ValueError("the example inputs are not fakes")
    lifted = {id(t) for t in (*gm.parameters(), *gm.buffers())}

    class Pickler(GraphPickler):
        def reducer_override(self, obj: object) -> Any:
            if isinstance(obj, torch.Tensor) and id(obj) in lifted:
                fake = mode.from_tensor(obj.detach(), static_shapes=True)
                if isinstance(obj, torch.nn.Parameter):
                    return _as_parameter, (fake, obj.requires_grad)
                return super().reducer_override(fake)
            return super().reducer_override(obj)

    options = Options(ops_filter=None, node_metadata_key_filter=lambda key: key not in _DROPPED_META)
    # GraphPickler.dumps's own setting, where the torch has it (2.13: slices in node args as pytrees)
    slices = getattr(_graph_pickler, "patch_pytree_map_over_slice", contextlib.nullcontext)
    with slices(), io.BytesIO() as stream:
        Pickler(stream, options).dump((gm, list(example_inputs), _settings()))
        return stream.getvalue()


def compile_loaded(data: bytes) -> None:
    """The child's work: load what `dumps` wrote, trace the node values again, and compile (filling the cache)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    import tkopt.backends.torch_ops  # noqa: F401 - the tkopt:: ops a fused program calls

    mode = FakeTensorMode(shape_env=ShapeEnv())
    gm, example_inputs, settings = GraphPickler.loads(data, mode)
    _apply(settings)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*example_inputs)
    compile_fx(gm, example_inputs)


class AheadCompile:
    """One child compiling one program; `wait` before compiling it here."""

    running: list[AheadCompile] = []

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        fd, name = tempfile.mkstemp(prefix="tkopt-ahead-", suffix=".pkl")
        self.path = Path(name)
        with os.fdopen(fd, "wb") as f:
            f.write(dumps(gm, example_inputs))
        self.log = tempfile.TemporaryFile()
        self.started = time.monotonic()
        # this process's sys.path, as the kernel workers get it (tkopt.kernels.workers): the same tkopt and torch
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path), str(self.path),
                                      repr(self.started)], stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.running.append(self)
        self.seconds: float | None = None  # from the start to the child's end, once waited for
        self.ok = False
        self.stopped = False
        self.here_seconds: float | None = None  # the compile here after the child's (`then_here`)
        self.found = False  # whether that compile found the child's code in the FX graph cache

    @contextlib.contextmanager
    def then_here(self) -> Iterator[None]:
        """Around the compile here: waits for the child first, then times the block and notes whether it found
        the child's code in the cache."""
        from torch._dynamo.utils import counters

        self.wait()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        t0 = time.perf_counter()
        yield
        self.here_seconds = time.perf_counter() - t0
        self.found = counters["inductor"]["fxgraph_cache_hit"] > hits

    def stop(self) -> None:
        """Stop the child, whose code no program will read: it would only take cores from the compiles here."""
        if self.seconds is None:
            self.proc.kill()
            self.stopped = True
            self.wait()

    def wait(self, timeout: float = WAIT_SECONDS) -> bool:
        """Wait for the child (at most `timeout` s, then stop it); whether it compiled. A failure is logged."""
        if self.seconds is None:
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
            self.running.remove(self)
            self.path.unlink(missing_ok=True)
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").strip().splitlines()
            self.log.close()
            self.ok = rc == 0 and bool(lines) and lines[-1].startswith(_DONE)
            # the child's own end, where it said (the wait may begin long after it)
            self.seconds = float(lines[-1].split()[-1]) if self.ok else time.monotonic() - self.started
            if not self.ok and not self.stopped:
                log.info("tkopt: inductor's compile ahead failed (rc %s): %s; it compiles at the first call", rc,
                         lines[-1] if lines else "no output")
        return self.ok


@atexit.register
def _stop_children() -> None:
    """A child still compiling when this process ends is stopped: nothing would read what it writes soon."""
    for ahead in AheadCompile.running:
        ahead.proc.kill()
        ahead.path.unlink(missing_ok=True)


def main(argv: Sequence[str]) -> None:
    """The child: compile what `dumps` wrote to the file `argv[0]`; say when it ended (`argv[1]`: the start)."""
    compile_loaded(Path(argv[0]).read_bytes())
    print(_DONE, time.monotonic() - float(argv[1]), flush=True)  # one clock for every process
