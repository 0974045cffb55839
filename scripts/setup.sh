#!/usr/bin/env bash
# Creates .venv (once) and installs tkopt into it, editable. Sourced by demo.sh and test.sh.
# CPU-only machines get torch's CPU build first: the plain `torch` requirement would otherwise
# pull the multi-GB CUDA build. Override with TKOPT_TORCH_SPEC (and PIP_EXTRA_INDEX_URL for an
# index that serves CPU wheels where your registry has none).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
extras=${1:-}
py=${PYTHON:-python3}
if [ ! -x "$root/.venv/bin/python" ]; then
  "$py" -m venv "$root/.venv"
fi
vpy="$root/.venv/bin/python"
if ! "$vpy" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TKOPT_TORCH_SPEC:-torch>=2.11,<2.15}
  else
    spec=${TKOPT_TORCH_SPEC:-torch==2.13.0}
  fi
  "$vpy" -m pip install -q "$spec"
fi
target="$root"
[ -n "$extras" ] && target="$root[$extras]"
"$vpy" -m pip install -q -e "$target"
