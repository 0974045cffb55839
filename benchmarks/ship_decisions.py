"""Merge the declines of benchmark runs into the decisions shipped with tkopt (tkopt/selected/, tkopt.decisions).

    python benchmarks/ship_decisions.py RUN_DIR ... [--db tkopt/selected]

Each RUN_DIR holds a whole-model benchmark run's whole_models.json (its date and device) and its decisions files
(`select-<target>.json`, which `BENCHES=whole benchmarks/gpu_session.sh bench` copies there). A key measured again
replaces the old record. Commit the folder with the run's results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    from tuning_db import merge_records  # run as a script, its folder is on sys.path

    from tkopt.decisions import shippable

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--db", type=Path, default=ROOT / "tkopt" / "selected")
    args = p.parse_args()
    for run in args.runs:
        meta = json.loads((run / "whole_models.json").read_text())["meta"]
        measured_on = f"{meta['device']}, {meta['date'][:10]}"
        for path in sorted(run.glob("select-*.json")):
            fresh = shippable(path, measured_on)
            held = merge_records(args.db / path.name, fresh)
            print(f"{path}: {len(fresh)} declines; {args.db / path.name} holds {held}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
