#!/usr/bin/env bash
# session-16, one machine of two GPUs. Issue 16: where do Quest, Twilight and Kascade lose at 16K-32K, prefill or
# decode, and do other GQA rules or top-p recover it? Qwen2.5-Coder-0.5B-Instruct (real weights), shipped config,
# 25%, every group paired on the same prompts (seed 0) with its GPU's dense run. GPU 0 (cores 0-15) and GPU 1
# (cores 16-31) each run six `vllm-sparse eval` processes side by side; then both GPUs the tensor-parallel run
# (the warm-up's second pass, session 15). Logs under /tmp/s16 (copied to $OUT by the polls).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo16 && cp -r . /tmp/repo16 && cd /tmp/repo16
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s16; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
CFG=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
VARS=(--variant dd '{"sparse_decode": false}' --variant sum '{"quest": {"gqa_reduce": "sum"}}'
      --variant union '{"quest": {"gqa_reduce": "union"}}' --variant p99 '{"twilight": {"top_p": 0.99}}')
EVAL=(--model qwen2.5-coder-0.5b-instruct --tasks niah_multikey niah_multivalue vt code --contexts 16384 32768
      --samples 20 --sparse-config "{\"config\": \"$CFG\"}" --block-size 16 --max-num-batched-tokens 8192
      --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12)
(
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 python3 benchmarks/eval_gpu_parallel.py $M/eval0 --groups quest:0.25 quest:0.25+dd quest:0.25+sum \
    quest:0.25+union twilight:0.25 twilight:0.25+dd "${VARS[@]}" -- "${EVAL[@]}" > $M/eval0.log 2>&1
  echo "eval0 rc=$?" >> $M/status
) &
(
  sleep 20
  export CUDA_VISIBLE_DEVICES=1
  taskset -c 16-31 python3 benchmarks/eval_gpu_parallel.py $M/eval1 --groups kascade:0.25 kascade:0.25+dd \
    twilight:0.25+sum twilight:0.25+p99 quoka:0.25 compact:0.25 "${VARS[@]}" -- "${EVAL[@]}" > $M/eval1.log 2>&1
  echo "eval1 rc=$?" >> $M/status
) &
wait
python3 benchmarks/e2e_gpu.py tp --out $M/tp --parallel > $M/tp.out 2>&1; echo "tp rc=$?" >> $M/status
VLLM_SPARSE_E2E_TP_JSON=$M/tp/e2e_gpu_tp.json python3 -m pytest -q tests/gpu/test_tp_e2e_gpu.py \
  -p no:cacheprovider > $M/tp_tests.log 2>&1; echo "tp pytest rc=$?" >> $M/status
echo done >> $M/status
