#!/usr/bin/env bash
# Every GPU test, or every GPU benchmark, in one go on a GPU machine that has torch, triton, onnx and
# TileLang (on our device: `source .device/setup.sh` first) but no registry, so tkopt cannot be
# pip-installed there: it runs from the checkout, on PYTHONPATH.
#   bash benchmarks/gpu_session.sh tests  OUTDIR   # pytest -m gpu over $TEST_PATHS (default: tests), 12 workers
#   bash benchmarks/gpu_session.sh bench  OUTDIR   # gemm, attention, norm/softmax/conv, model benchmarks
#                                                   # (BENCHES=gemm_fp32: the fp32 precision comparison only;
#                                                   # gemm_epilogues: the projection shapes' epilogues only;
#                                                   # gemm_persistent: one block per tile against persistent;
#                                                   # attention_short: the whole models' attention nodes, SHORT_ARGS)
# Env: TEST_PATHS, TESTS_TIMEOUT, WORKERS (tests); BENCHES (whole: benchmarks/whole_models.py with WHOLE_ARGS,
# WHOLE_TIMEOUT, and its selection decisions copied to OUTDIR for benchmarks/ship_decisions.py; tuning: benchmarks/tuning_db.py, the shipped tuning winners into tkopt/kernels/tuned/, with TUNING_ARGS,
# TUNING_TIMEOUT; compile: benchmarks/compile_time.py, cold and warm compile time against torch.compile, with
# COMPILE_ARGS, COMPILE_TIMEOUT; overhead: benchmarks/call_overhead.py, each variant's host cost per call, with
# OVERHEAD_ARGS, OVERHEAD_TIMEOUT), MODELS_ARGS, MODELS_TIMEOUT (bench); ORT_GPU_WHEEL: an
# onnxruntime-gpu wheel (CUDA 13) installed into a temporary folder ahead of the image's CPU onnxruntime, so the
# CUDA-target op libraries run in ORT (tests/ort/test_cuda_session.py; skipped without it).
# Logs go to OUTDIR (few files: the device returns at most 8).
set -uo pipefail
phase=${1:?tests or bench}
out=$(mkdir -p "${2:?output dir}" && cd "$2" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${ORT_GPU_WHEEL:-}" ]; then
  ortdir=$(mktemp -d)
  python -m pip install -q --no-index --no-deps --no-compile --target "$ortdir" "$ORT_GPU_WHEEL" || exit 1
  export PYTHONPATH="$ortdir${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TKOPT_CACHE_DIR=${TKOPT_CACHE_DIR:-$(mktemp -d)}
cd "$root"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c 'import torch; print("torch", torch.__version__)'
  python -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())'; } > "$out/env.txt"
t0=$(date +%s)
case "$phase" in
  tests)
    # Heuristic tile configs in tests: tuning is the benchmarks' business. SIGINT at the time limit makes
    # pytest print its summary of what ran (a plain kill would lose it). Inductor compiles in-process: its
    # compile-worker pool's shutdown at exit hung pytest's workers until the limit, losing the summary.
    TORCHINDUCTOR_COMPILE_THREADS=1 TKOPT_AUTOTUNE=0 TKOPT_BUILD_WORKERS=1 timeout -s INT -k 20 "${TESTS_TIMEOUT:-420}" python -m pytest -q -m gpu -n "${WORKERS:-12}" -p no:cacheprovider \
      -rfE ${TEST_PATHS:-tests} > "$out/gpu_tests.log" 2>&1
    echo "pytest rc=$? in $(( $(date +%s) - t0 ))s"; tail -n 40 "$out/gpu_tests.log"
    ;;
  bench)
    for b in ${BENCHES:-gemm attention norm models}; do
      s=$(date +%s)
      case "$b" in
        gemm) timeout 120 python benchmarks/bench_gemm.py --out "$out" ;;
        gemm_fp32) timeout 150 python benchmarks/bench_gemm.py --fp32 --out "$out" ;;
        gemm_epilogues) timeout 200 python benchmarks/bench_gemm.py --epilogues --out "$out" ;;
        gemm_persistent) timeout 300 python benchmarks/bench_gemm.py --persistent --out "$out" ;;
        whole) timeout "${WHOLE_TIMEOUT:-500}" python benchmarks/whole_models.py --out "$out" ${WHOLE_ARGS:-}
               cp "$TKOPT_CACHE_DIR"/select-*.json "$out"/ 2>/dev/null ;;  # for benchmarks/ship_decisions.py
        tuning) timeout "${TUNING_TIMEOUT:-400}" python benchmarks/tuning_db.py ${TUNING_ARGS:-} ;;
        compile) timeout "${COMPILE_TIMEOUT:-500}" python benchmarks/compile_time.py --out "$out" ${COMPILE_ARGS:-} ;;
        overhead) timeout "${OVERHEAD_TIMEOUT:-300}" python benchmarks/call_overhead.py --out "$out" ${OVERHEAD_ARGS:-} ;;
        attention) timeout 120 python benchmarks/bench_attention.py --out "$out" --prewarm 8 ;;
        attention_short) timeout 200 python benchmarks/bench_attention.py --short --out "$out" --prewarm 11 ${SHORT_ARGS:-} ;;
        norm) timeout 60 python benchmarks/bench_norm.py --phase compile --jobs 12 --out "$out" > /dev/null 2>&1
              timeout 60 python benchmarks/bench_norm.py --phase measure --out "$out" ;;
        models) timeout "${MODELS_TIMEOUT:-200}" python benchmarks/bench_models.py --out "$out" --budget-s 150 ${MODELS_ARGS:-} ;;
      esac > "$out/bench_$b.log" 2>&1
      echo "$b rc=$? in $(( $(date +%s) - s ))s"; grep -v INFO "$out/bench_$b.log" | tail -n 30
    done
    ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
