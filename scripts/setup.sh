#!/usr/bin/env bash
# Creates .venv (once) and installs tkopt into it, editable. Called by demo.sh and test.sh.
#
# torch comes first, chosen for the machine: plain PyPI serves only CUDA builds of torch for Linux
# (several GB), so on a machine without an NVIDIA GPU we ask for the CPU build, torch==2.13.0+cpu,
# from PyTorch's CPU wheel index (added as an extra index when it answers) or from whatever index or
# wheel folder pip is already configured with (a mirror, a local find-links folder).
# Overrides: TKOPT_TORCH_SPEC (the requirement, e.g. "torch==2.13.0" or "torch>=2.11,<2.15"),
# TKOPT_TORCH_INDEX (the CPU wheel index; empty: don't add one), PYTHON (the interpreter, 3.10+).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
extras=${1:-}
py=${PYTHON:-python3}
if [ ! -x "$root/.venv/bin/python" ]; then
  "$py" -m venv "$root/.venv"
fi
vpy="$root/.venv/bin/python"
if ! "$vpy" -c 'import torch' 2>/dev/null; then
  index_args=()
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TKOPT_TORCH_SPEC:-torch>=2.11,<2.15}
  else
    spec=${TKOPT_TORCH_SPEC:-torch==2.13.0+cpu}
    index=${TKOPT_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
    if [ -n "$index" ] && "$vpy" - "$index" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/", timeout=10)
PY
    then
      index_args=(--extra-index-url "$index")
    else
      echo "setup: ${index:-no CPU wheel index} not reachable; taking $spec from pip's configured index" >&2
    fi
  fi
  echo "setup: installing $spec (first run only)" >&2
  "$vpy" -m pip install -q "${index_args[@]}" "$spec"
fi
target="$root"
[ -n "$extras" ] && target="$root[$extras]"
"$vpy" -m pip install -q -e "$target"
