#!/usr/bin/env bash
# session-18 machine 2 (two GPUs), after the decode attention kernel takes 4 programs per SM for at most 32 rows.
# GPU 0 (cores 0-15): `vllm serve` default mode + `vllm bench serve`, Llama-3.1-8B shapes, random weights, 12.5%:
#   tpot128k, decode16 and C for FLASH_ATTN, sparse_quoka, sparse_quest, sparse_twilight, in one run.
# GPU 1 (cores 16-31): the whole tests/gpu folder (the e2e tiny run first feeds its tests).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo18b && cp -r . /tmp/repo18b && cd /tmp/repo18b
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s18b; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
(
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads tpot128k,decode16,C \
    --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quoka,sparse_quest,sparse_twilight" > $M/sb.log 2>&1; echo "serve rc=$?" >> $M/status
  echo "gpu0 done" >> $M/status
) &
(
  export CUDA_VISIBLE_DEVICES=1
  taskset -c 16-31 python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py --ignore=tests/gpu/test_tp_e2e_gpu.py \
    tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py \
    -p no:cacheprovider > $M/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $M/status
  taskset -c 16-31 python3 benchmarks/e2e_gpu.py tiny --out $M/e2e --parallel > $M/e2e.out 2>&1; echo "e2e rc=$?" >> $M/status
  VLLM_SPARSE_E2E_TINY_JSON=$M/e2e/e2e_gpu_tiny.json taskset -c 16-31 python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py \
    -p no:cacheprovider > $M/gpu_e2e_tests.log 2>&1; echo "e2e pytest rc=$?" >> $M/status
  echo "gpu1 done" >> $M/status
) &
wait
echo done >> $M/status
