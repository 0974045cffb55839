"""The shipped tuning winners (tkopt/kernels/tuned/): tune every kernel the benchmark models' fused nodes run, at the
shapes selection runs them at, on this GPU, and merge the winners into a folder.

    python benchmarks/tuning_db.py [--models gpt2_8x1024 ...] [--ops FusedAttention ...] [--db tkopt/kernels/tuned]

For each model (benchmarks/whole_models.py's table, fp16) and each size it is compiled or served at: export it as
tkopt.compile does (every input dim dynamic), run the passes, build every fused node's kernels in one parallel
wave (tuning candidates included), then call each node's kernel on seeded random inputs at its example shapes
and at the larger size selection also measures it at (TorchTarget.sizes). Each call tunes
(tkopt.kernels.tuning: every candidate timed with CUDA events) in a fresh cache, the shipped winners ignored
(TKOPT_SHIPPED_TUNING=0). The fresh cache's winners for this GPU's arch are then merged into --db: a key
measured again replaces the old record. Run it on a quiet GPU and commit the folder with the date and device
(the records carry both).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tune_model(name: str, ops: Sequence[str] = ()) -> dict[str, int]:
    """Tune the kernels of one model's fused nodes (module docstring), or of those whose op is one of `ops`;
    returns per op how many nodes ran."""
    import torch
    import whole_models as wm  # run as a script, its folder is on sys.path

    from tkopt.frontends.fx import import_fx
    from tkopt.fused_ops import run_kernel
    from tkopt.passes.pipeline import run_passes
    from tkopt.targets.kernel_builds import example_specs, load, prebuild, probe_inputs, probe_specs
    from tkopt.targets.torch_target import TorchTarget
    from tkopt.torch_compile import _export

    m = wm.MODELS[name]
    torch.manual_seed(0)
    module = m.module()
    ran: dict[str, int] = {}
    for inputs in [m.cast_inputs()] + ([m.cast(m.compile_inputs())] if m.compile_inputs else []):
        with torch.no_grad():
            graph = import_fx(_export(module, inputs, {}, True))
            run_passes(graph, ())
            nodes = [n for n in graph.nodes if n.is_fused and (not ops or n.op in ops)]
            target = TorchTarget(inputs)
            sizes = [size.dims for size in target.sizes(graph.meta["fx_module"])[1:]]
            load(prebuild(nodes, target.device, target.fingerprint(), sizes))
            for n in nodes:
                for at in (None, *sizes):
                    try:
                        specs = probe_specs(n) if at is None else example_specs(n, at)
                        run_kernel(n.op, probe_inputs(specs, target.device), n.attrs)
                    except Exception as e:  # noqa: BLE001 - a node its kernel refuses is not tuned; say which
                        print(f"  {name}: {n.name} ({n.op}) at {at or 'the example'}: {type(e).__name__}: {e}"[:300])
                        continue
                    ran[n.op] = ran.get(n.op, 0) + 1
            torch.cuda.synchronize()
    return ran


def merge_records(target: Path, fresh: dict) -> int:
    """Merge `fresh` records into the shipped JSON file `target` (a key measured again replaces the old record),
    written all or nothing; returns how many keys it now holds. benchmarks/ship_decisions.py writes this way too."""
    from tkopt.files import write_atomic

    known = json.loads(target.read_text()) if target.exists() else {}
    known.update(fresh)
    write_atomic(target, (json.dumps(known, indent=1, sort_keys=True) + "\n").encode())
    return len(known)


def merge(cache: Path, db: Path, arch: str, device: str) -> dict[str, int]:
    """Merge the winners `cache` holds for `arch` into `db`, each record naming the `device` it was measured on;
    returns per file how many keys it now holds."""
    return {path.name: merge_records(db / path.name, {key: {**record, "device": device}
                                                       for key, record in json.loads(path.read_text()).items()})
            for path in sorted(cache.glob(f"tune-*-{arch}.json"))}


def main() -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import whole_models as wm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(wm.MODELS), default=list(wm.MODELS))
    p.add_argument("--ops", nargs="+", default=(), help="only nodes of these fused ops (FusedAttention, ...)")
    p.add_argument("--db", type=Path, default=ROOT / "tkopt" / "kernels" / "tuned",
                   help="the winners folder to merge into")
    args = p.parse_args()
    os.environ["TKOPT_SHIPPED_TUNING"] = "0"
    os.environ["TKOPT_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="tkopt-tuning-db-")
    import torch

    from tkopt.kernels.arch import Build

    if not torch.cuda.is_available():
        print("tuning_db.py needs a CUDA GPU", file=sys.stderr)
        return 2
    arch = Build.here(torch.device("cuda")).arch
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(f"{device} ({arch})", flush=True)
    for name in args.models:
        t = time.perf_counter()
        try:
            ran = tune_model(name, args.ops)
        except Exception as e:  # noqa: BLE001 - one model that fails must not lose the others' winners
            print(f"{name}: FAILED {type(e).__name__}: {e}"[:400], flush=True)
            continue
        print(f"{name}: {ran} in {time.perf_counter() - t:.0f} s", flush=True)
        print("  db:", merge(Path(cache), args.db, arch, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
