#!/usr/bin/env bash
# session-15, one machine of two H100s: GPU 1 Kascade's decode per layer and the serve bench (FLASH_ATTN and
# Kascade at 10% on tpot128k and decode16); GPU 0 the GPU tests and the e2e tiny run; then both GPUs the
# tensor-parallel run. Logs under /tmp/s15 (copied to $OUT by the polls). The timed work (GPU 1) has CPU cores
# 0-7 to itself, the tests (GPU 0) cores 8-31, so that engine start-ups of the tests do not slow the servers.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo15 && cp -r . /tmp/repo15 && cd /tmp/repo15
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s15; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
CFG=$(pwd)/configs/llama-3.1-8b-instruct.yaml
(
  export CUDA_VISIBLE_DEVICES=1
  taskset -c 0-7 python3 benchmarks/bench_kascade_decode_gpu.py --out $M/kdec > $M/kdec.log 2>&1; echo "kdec rc=$?" >> $M/status
  taskset -c 0-7 python3 benchmarks/serve_bench.py run --out $M/serve --loads tpot128k,decode16 --repeat-baseline 1 \
    --backends FLASH_ATTN,sparse_kascade+k10 \
    --variant k10 "{\"config\": \"$CFG\", \"budget\": {\"fraction\": 0.1}}" > $M/serve.out 2>&1
  echo "serve rc=$?" >> $M/status
  echo "gpu1 done" >> $M/status
) &
(
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 8-31 python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py --ignore=tests/gpu/test_tp_e2e_gpu.py \
    tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py \
    -p no:cacheprovider > $M/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $M/status
  taskset -c 8-31 python3 -m pytest -q tests/test_decode_path.py -k kascade -p no:cacheprovider > $M/kascade_decode_path_cuda.log 2>&1
  echo "kascade decode path (cuda) rc=$?" >> $M/status
  taskset -c 8-31 python3 benchmarks/e2e_gpu.py tiny --out $M/e2e --parallel > $M/e2e.out 2>&1; echo "e2e rc=$?" >> $M/status
  VLLM_SPARSE_E2E_TINY_JSON=$M/e2e/e2e_gpu_tiny.json taskset -c 8-31 python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py \
    -p no:cacheprovider > $M/gpu_e2e_tests.log 2>&1; echo "e2e pytest rc=$?" >> $M/status
  echo "gpu0 done" >> $M/status
) &
wait
python3 benchmarks/e2e_gpu.py tp --out $M/tp --parallel > $M/tp.out 2>&1; echo "tp rc=$?" >> $M/status
VLLM_SPARSE_E2E_TP_JSON=$M/tp/e2e_gpu_tp.json python3 -m pytest -q tests/gpu/test_tp_e2e_gpu.py \
  -p no:cacheprovider > $M/tp_tests.log 2>&1; echo "tp pytest rc=$?" >> $M/status
echo done >> $M/status
