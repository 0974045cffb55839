#!/usr/bin/env bash
# Creates .venv (once) and installs tkopt into it, editable. Called by demo.sh and test.sh.
#
# torch comes first, chosen for the machine: plain PyPI serves only CUDA builds of torch for Linux
# (several GB), so on a machine without an NVIDIA GPU we ask for the CPU build, torch==2.13.0+cpu,
# from PyTorch's CPU wheel index (added as an extra index when it answers) or from whatever index or
# wheel folder pip is already configured with (a mirror, a local find-links folder).
# Overrides: TKOPT_TORCH_SPEC (the requirement, e.g. "torch==2.13.0" or "torch>=2.11,<2.15"),
# TKOPT_TORCH_INDEX (the CPU wheel index; empty: don't add one), PYTHON (the interpreter, 3.10+).
# Missing prerequisites are one line each: Python 3.10+ with venv stops the set-up; a C++ compiler and npm
# (needed later, to build op libraries) are noted.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
extras=${1:-}
py=${PYTHON:-python3}
if [ ! -x "$root/.venv/bin/python" ]; then
  if ! command -v "$py" >/dev/null 2>&1; then
    echo "setup: $py not found: tkopt needs Python 3.10 or newer (PYTHON=/path/to/python3.X picks one)" >&2
    exit 1
  fi
  if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "setup: $py is Python $("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])'): tkopt needs 3.10 or" \
      "newer (PYTHON=/path/to/python3.X picks another)" >&2
    exit 1
  fi
  if ! "$py" -m venv "$root/.venv" >/dev/null 2>&1; then
    rm -rf "$root/.venv"
    echo "setup: $py cannot make a virtual environment: install its venv module (Debian/Ubuntu: apt install" \
      "python3-venv)" >&2
    exit 1
  fi
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
# What building op libraries needs later: said now, once, so the first `tkopt optimize` is no surprise.
if ! command -v "${CXX:-g++}" >/dev/null 2>&1; then
  echo "setup: note: no C++ compiler (${CXX:-g++}): tkopt's ONNX Runtime op library (--target cpu, the default" \
    "without a GPU) and TileLang's CPU kernels need one (Debian/Ubuntu: apt install g++)" >&2
fi
if [ -z "${TKOPT_ORT_INCLUDE:-}" ] && ! command -v npm >/dev/null 2>&1 \
    && ! "$vpy" -c 'from tkopt.ort.headers import include_dir; include_dir(fetch=False)' 2>/dev/null; then
  echo "setup: note: no npm: the first op library build fetches ONNX Runtime's C API headers with it (Debian/" \
    "Ubuntu: apt install npm), or set TKOPT_ORT_INCLUDE to a folder holding them" >&2
fi
