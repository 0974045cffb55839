"""python -m tkopt.fuzz: run a fuzzing campaign and write its result as JSON (see --help)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from .campaign import Campaign, Plan, write_json


def _seeds(text: str) -> range:
    lo, _, hi = text.partition(":")
    return range(int(lo), int(hi)) if hi else range(int(lo), int(lo) + 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tkopt.fuzz", description=__doc__)
    ap.add_argument("--seeds", type=_seeds, default=range(0, 100), help="START:STOP (default 0:100) or one seed")
    ap.add_argument("--kernels-every", type=int, default=20, help="also run fx on TileLang CPU kernels every N seeds")
    ap.add_argument("--onnx-every", type=int, default=10, help="also run both ONNX exporters every N seeds")
    ap.add_argument("--native-every", type=int, default=100, help="also run the native CPU op library every N")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per graph and path")
    ap.add_argument("--shrink-budget", type=float, default=1800.0, help="seconds for shrinking, all failures")
    ap.add_argument("--out", type=Path, help="write the result JSON here")
    ap.add_argument("--repro-dir", type=Path, help="write each shrunk failure's reproducer script here")
    args = ap.parse_args(argv)
    plan = Plan(kernels_every=args.kernels_every, onnx_every=args.onnx_every, native_every=args.native_every,
                timeout_s=args.timeout, shrink_total_s=args.shrink_budget)
    campaign = Campaign(plan, repro_dir=args.repro_dir)
    start = time.monotonic()
    campaign.run(args.seeds, log=lambda line: print(line, flush=True))
    result = campaign.to_dict("python -m tkopt.fuzz " + shlex.join(argv if argv is not None else sys.argv[1:]),
                              time.monotonic() - start)
    for path, counts in result["totals"].items():
        print(f"{path}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for c in result["classes"]:
        print(f"{c['count']:4d}  {c['status']} {c['error']} {c['where']}  {'; '.join(c['minimal_graph'])}")
    if args.out is not None:
        write_json(args.out, result)
    return 1 if campaign.failures else 0


if __name__ == "__main__":
    sys.exit(main())
