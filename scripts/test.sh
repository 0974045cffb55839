#!/usr/bin/env bash
# Sets up (once, with the test extra) and runs lint and the tests. GPU tests skip without a GPU.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh" test
cd "$root"
.venv/bin/ruff check .
# The repository root must not be on sys.path: its kernels/ (installed as tkopt.kernels) would shadow the hub's
# `kernels` package, which transformers >= 5 imports. pytest's own script (not `python -m pytest`) keeps the working
# directory off it, and its import mode (pyproject) appends the tests' rootdir after site-packages.
.venv/bin/pytest -q "$@"
