#!/usr/bin/env bash
# session-17, one machine of two GPUs.
# GPU 0 (cores 0-15), issues 11/18: `vllm serve` default mode + `vllm bench serve` with today's defaults (QuoKA scores
#   every query since session 14, Quest ranks prefill chunks by exact scores since session 16, and its cost model
#   prices those chunks as QuoKA's): FLASH_ATTN, sparse_quest, sparse_quoka, FLASHINFER, then Quest with its old
#   bounds prefill on load A, all in one run (Llama-3.1-8B shapes, random weights, 12.5%).
# GPU 1 (cores 16-31): the whole tests/gpu folder (the e2e tiny run first feeds its tests), then issue 16: the 1.5B
#   model with Quest's exact prefill, Quest with dense decode, and Twilight with a 256-query estimate window, at
#   16K and 32K (the prompts of eval_qwen1.5b_gpu_h100, seed 0), paired with dense.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo17 && cp -r . /tmp/repo17 && cd /tmp/repo17
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s17; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
(
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 python3 benchmarks/serve_bench.py run --out $M/sb --loads tpot128k,A,B,C --repeat-baseline 1 \
    --deadline 1000 --variant bounds '{"quest": {"prefill_scores": "bounds"}}' \
    --backends "FLASH_ATTN,sparse_quest,sparse_quoka,FLASHINFER@tpot128k/A,sparse_quest+bounds@A" \
    > $M/sb.log 2>&1; echo "serve rc=$?" >> $M/status
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
  bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
  CFG=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
  taskset -c 16-31 python3 benchmarks/eval_gpu_parallel.py $M/eval --groups quest:0.25 quest:0.25+dd twilight:0.25+w256 \
    --variant dd '{"sparse_decode": false}' --variant w256 '{"chunk_query_window": 256}' -- \
    --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code \
    --contexts 16384 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\"}" \
    --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.13 \
    > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
  echo "gpu1 done" >> $M/status
) &
wait
echo done >> $M/status
