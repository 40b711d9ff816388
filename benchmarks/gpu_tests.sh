#!/usr/bin/env bash
# The whole tests/gpu folder on a lent GPU, as a session that changed GPU code runs it (after
# `eval "$(bash benchmarks/gpu_setup.sh)"`), logs and one status line per stage under OUT_DIR:
#   bash benchmarks/gpu_tests.sh OUT_DIR
# 1. every GPU test but the engine ones, and the Triton kernel tests that run compiled where CUDA is (the decode
#    path's too);
# 2. the engines of the end-to-end test (`benchmarks/e2e_gpu.py tiny --parallel`), their JSON and logs kept;
# 3. the end-to-end test, on what 2 wrote (`python -m pytest tests/gpu` runs 1-3 in one go, keeping less).
# `tests/gpu/test_tp_e2e_gpu.py` needs two GPUs and is left to `benchmarks/e2e_gpu.py tp`. Exits non-zero when a stage failed; every stage runs regardless.
set -uo pipefail
OUT=${1:?usage: gpu_tests.sh OUT_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
# the plugin must be installed (entry point) before any stage spends device time
python3 benchmarks/gpu_preflight.py > "$OUT/preflight.log" 2>&1 || { cat "$OUT/preflight.log" >&2; echo "preflight rc=2" >> "$OUT/status"; exit 2; }
rc=0
stage() {  # NAME LOG COMMAND...
  local name=$1 log=$2
  shift 2
  "$@" > "$OUT/$log" 2>&1
  local r=$?
  echo "$name rc=$r" >> "$OUT/status"
  [ "$r" -eq 0 ] || rc=1
}
stage "gpu tests" gpu_tests.log python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py \
  --ignore=tests/gpu/test_tp_e2e_gpu.py tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py \
  tests/test_kernels_triton_kascade.py tests/test_decode_path.py -p no:cacheprovider --durations=30
stage "e2e" e2e.out python3 benchmarks/e2e_gpu.py tiny --out "$OUT/e2e" --parallel
VLLM_SPARSE_E2E_TINY_JSON="$OUT/e2e/e2e_gpu_tiny.json" stage "e2e pytest" gpu_e2e_tests.log \
  python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py -p no:cacheprovider
exit "$rc"
