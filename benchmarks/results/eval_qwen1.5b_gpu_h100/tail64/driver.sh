#!/usr/bin/env bash
# session-12 machine 2: the 1.5B eval again at 16K and 32K on the tasks that lost, every method with dense_tail_tokens 64
cd "$(dirname "$0")/.."
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/m2; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
CFG=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
python3 benchmarks/eval_gpu_parallel.py $M/eval --groups quoka:0.25 quoka:0.125 quest:0.25 twilight:0.25 kascade:0.25 compact:0.25 -- \
  --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code \
  --contexts 16384 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\", \"dense_tail_tokens\": 64}" \
  --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.13 \
  > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
echo done >> $M/status
