#!/usr/bin/env bash
# Sets up (once, with the test extra) and runs lint and the tests. GPU tests skip without a GPU.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh" test
cd "$root"
.venv/bin/ruff check .
.venv/bin/pytest -q "$@"
