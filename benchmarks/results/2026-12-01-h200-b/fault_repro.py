"""Reproduces the H200 fault of 2026-12-01 (see README.md here): tkopt.compile on nn.TransformerEncoderLayer
8x512 fp16 with torch.compile(mode="reduce-overhead") put back among the whole-graph race's alternatives.
Every timed call is synchronized, so the first call that faults is named. Run from the repository root on
the GPU machine with the gpu_session.sh shim on PYTHONPATH:

    python benchmarks/results/2026-12-01-h200-b/fault_repro.py [with-reduce-overhead|without]
"""

import sys
import traceback

import torch
from torch import nn

import tkopt
import tkopt.targets.torch_target as target_module
import tkopt.torch_compile as torch_compile

where: dict[str, str] = {}
real_race = target_module.race


def checked_race(fns, device, **kwargs):
    def checked(name, fn):
        def call():
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception:
                where.setdefault("fault", f"race: {name}")  # the pipeline catches it and goes on
                raise
            return out
        return call
    return real_race({name: checked(name, fn) for name, fn in fns.items()}, device, **kwargs)


target_module.race = checked_race
if sys.argv[1:] == ["with-reduce-overhead"]:
    plain = torch_compile.CompiledModule._alternatives

    def with_reduce_overhead(self, device):
        alternatives = plain(self, device)
        alternatives["inductor+cudagraphs"] = lambda: torch.compile(self.module, mode="reduce-overhead")
        return alternatives

    torch_compile.CompiledModule._alternatives = with_reduce_overhead

torch.manual_seed(0)
model = nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True).cuda().half().eval()
x = torch.randn(8, 512, 1024, device="cuda", dtype=torch.half)
with torch.no_grad():
    try:
        fast = tkopt.compile(model, (x,))
        torch.cuda.synchronize()
        for _ in range(10):
            fast(x)
        torch.cuda.synchronize()
        print(fast.tkopt_report)
        print("no fault")
    except Exception:
        traceback.print_exc()
        print("fault, first seen at:", where.get("fault", "after the race"))
        sys.exit(1)
