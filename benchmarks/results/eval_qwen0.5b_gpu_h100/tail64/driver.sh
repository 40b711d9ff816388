#!/usr/bin/env bash
# session-12 machine 3: the 0.5B eval at 16K and 32K, QuoKA, Quest and Twilight at the shipped 25% with and without dense_tail_tokens 64
cd "$(dirname "$0")/.."
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/m3; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
CFG=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
python3 benchmarks/eval_gpu_parallel.py $M/eval --variant tail64 '{"dense_tail_tokens": 64}' \
  --groups quoka:0.25 quoka:0.25+tail64 quest:0.25 quest:0.25+tail64 twilight:0.25 twilight:0.25+tail64 -- \
  --model qwen2.5-coder-0.5b-instruct --tasks niah_single niah_multikey niah_multivalue vt code \
  --contexts 16384 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\"}" \
  --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12 \
  > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
echo done >> $M/status
