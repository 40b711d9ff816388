#!/usr/bin/env bash
# session 33, machine 2 (one H100): issues 16 and 14 on real weights. Qwen2.5-Coder-0.5B-Instruct (GGUF carried in
# pieces to /tmp/gg05), every backend at its shipped 0.5B config and default page size, on the same prompts: tasks
# niah_single, niah_multikey, niah_multivalue, vt and code at 16K and 32K, 32 samples each (160 prompts per context,
# twice session 24's 80), seed 0. Groups run side by side (eval_gpu_parallel.py): dense + Quest, Twilight, QuoKA,
# compact (never evaluated on real weights on a GPU before), Kascade, and Quest with session 32's per-layer budgets
# (quest_pl_layers.json, the shipped layers 6-11 dense at decode kept).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo33b && cp -r . /tmp/repo33b && cd /tmp/repo33b
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s33b; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg05 > $S/stage_model05.log 2>&1
echo "stage rc=$?" >> $S/status
C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
PL=$(cat benchmarks/results/eval_qwen0.5b_gpu_session33/quest_pl_layers.json)
python3 benchmarks/eval_gpu_parallel.py $S/eval05 \
  --groups quest:0.25 twilight:0.25 quoka:0.25 compact:0.25 kascade:0.25 quest:0.25+pl --variant pl "$PL" -- \
  --model qwen2.5-coder-0.5b-instruct --tasks niah_single niah_multikey niah_multivalue vt code \
  --contexts 16384 32768 --samples 32 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 \
  --gpu-memory-utilization 0.08 --sparse-config "{\"config\": \"$C05\"}" > $S/eval05.log 2>&1
echo "eval rc=$?" >> $S/status
echo done >> $S/status
