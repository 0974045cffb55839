#!/usr/bin/env bash
# Sets up (once) and runs the main job on the bundled example model: export it to ONNX, optimize
# it, print the fusion report and fused-vs-unfused accuracy.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/tkopt" demo "$@"
