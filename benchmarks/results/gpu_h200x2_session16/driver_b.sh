#!/usr/bin/env bash
# session-16 machine 2 (two GPUs): Quest ranking prefill chunks by QuoKA's exact scores (quest.prefill_scores: exact,
# the new default, also Twilight's candidates). GPU 0 (cores 0-15): the 0.5B eval of the new defaults beside dense
# (same prompts as driver.sh), then TTFT at 130K with the exact scores against the bounds (Llama-3.1-8B shapes,
# random weights, 12.5%, eager, same run). GPU 1 (cores 16-31): the GPU tests, then the e2e tiny run and its tests.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo16b && cp -r . /tmp/repo16b && cd /tmp/repo16b
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s16b; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
CFG=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
EVAL=(--model qwen2.5-coder-0.5b-instruct --tasks niah_multikey niah_multivalue vt code --contexts 16384 32768
      --samples 20 --sparse-config "{\"config\": \"$CFG\"}" --block-size 16 --max-num-batched-tokens 8192
      --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12)
(
  export CUDA_VISIBLE_DEVICES=0
  bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
  taskset -c 0-15 python3 benchmarks/eval_gpu_parallel.py $M/eval --groups quest:0.25 twilight:0.25 quest:0.25+sum \
    --variant sum '{"quest": {"gqa_reduce": "sum"}}' -- "${EVAL[@]}" > $M/eval.log 2>&1
  echo "eval rc=$?" >> $M/status
  taskset -c 0-15 python3 benchmarks/e2e_gpu.py perf --out $M/perf --contexts 130560 --decode-tokens 16 \
    --backends sparse_quest,sparse_quest+bounds > $M/perf.out 2>&1; echo "perf rc=$?" >> $M/status
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
