#!/usr/bin/env bash
# session-13 machine 2: the 1.5B at 32K on the tasks that lose, larger budgets and a longer dense tail
cd "$(dirname "$0")/.." && rm -rf /tmp/repo13 && cp -r . /tmp/repo13 && cd /tmp/repo13
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s13c; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
git rev-parse HEAD > $M/tree.txt 2>/dev/null
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
CFG=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
python3 benchmarks/eval_gpu_parallel.py $M/eval --groups quoka:0.5 quoka:0.375 kascade:0.375 kascade:0.5 quest:0.5 quoka:0.25+tail256 \
  --variant tail256 '{"dense_tail_tokens": 256}' -- \
  --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code \
  --contexts 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\"}" \
  --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.13 \
  > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
echo done >> $M/status
