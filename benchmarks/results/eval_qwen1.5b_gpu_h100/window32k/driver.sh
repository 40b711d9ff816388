#!/usr/bin/env bash
# session-14 machine 1 (b): the 1.5B at 32K, every chunk scoring pages with all its queries (chunk_query_window 0)
cd "$(dirname "$0")/.." && rm -rf /tmp/repo14e && cp -r . /tmp/repo14e && cd /tmp/repo14e
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s14e; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
CFG=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
python3 benchmarks/eval_gpu_parallel.py $M/eval --groups quoka:0.25+w0 quest:0.25+w0 twilight:0.25+w0 \
  --variant w0 '{"chunk_query_window": 0}' -- \
  --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code \
  --contexts 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\"}" \
  --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.13 \
  > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
echo done >> $M/status
