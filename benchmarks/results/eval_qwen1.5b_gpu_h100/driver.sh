#!/usr/bin/env bash
# session-12 machine 1: convert the carried 1.5B GGUF, then the accuracy eval in 6 parallel groups (issue 16)
cd "$(dirname "$0")/.."
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/m1; mkdir -p $M
ls -la /tmp/gg > $M/gg.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
CFG=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
python3 benchmarks/eval_gpu_parallel.py $M/eval --groups compact:0.25 quoka:0.125 quoka:0.25 quest:0.125,0.25 twilight:0.25 kascade:0.125,0.25 -- \
  --model qwen2.5-coder-1.5b-instruct --tasks niah_single niah_multikey niah_multivalue vt code \
  --contexts 8192 16384 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\"}" \
  --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.13 \
  > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
echo done >> $M/status
