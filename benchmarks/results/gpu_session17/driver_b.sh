#!/usr/bin/env bash
# session-17 machine 2 (two GPUs), after Twilight's prefill chunks stopped pruning their candidates
# (twilight.prune_prefill, default off; its Quest candidates then rank a chunk's pages by exact scores).
# GPU 0 (cores 0-15): the whole tests/gpu folder on this code (the e2e tiny run first feeds its tests).
# GPU 1 (cores 16-31): issue 16, the 1.5B model at 16K and 32K (the prompts of eval_qwen1.5b_gpu_h100, seed 0):
#   Twilight's new default and, in the same run, its old pruned prefill, paired with dense.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo17b && cp -r . /tmp/repo17b && cd /tmp/repo17b
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s17b; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
(
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py --ignore=tests/gpu/test_tp_e2e_gpu.py \
    tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py \
    -p no:cacheprovider > $M/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $M/status
  taskset -c 0-15 python3 benchmarks/e2e_gpu.py tiny --out $M/e2e --parallel > $M/e2e.out 2>&1; echo "e2e rc=$?" >> $M/status
  VLLM_SPARSE_E2E_TINY_JSON=$M/e2e/e2e_gpu_tiny.json taskset -c 0-15 python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py \
    -p no:cacheprovider > $M/gpu_e2e_tests.log 2>&1; echo "e2e pytest rc=$?" >> $M/status
  echo "gpu0 done" >> $M/status
) &
(
  export CUDA_VISIBLE_DEVICES=1
  bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
  CFG=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
  taskset -c 16-31 python3 benchmarks/eval_gpu_parallel.py $M/eval --groups twilight:0.25 twilight:0.25+prune \
    --variant prune '{"twilight": {"prune_prefill": true}}' -- \
    --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code \
    --contexts 16384 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\"}" \
    --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.13 \
    > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
  echo "gpu1 done" >> $M/status
) &
wait
echo done >> $M/status
