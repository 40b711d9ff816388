#!/usr/bin/env bash
# session-21 machine 1 (one H100): issue 16 accuracy, the prompts of the earlier runs (seed 0, 20 per task and context).
# (a) the 1.5B at 16K and 32K: Twilight with the shipped config (candidates at 50%), and Quest and Twilight with its
#     last two layers dense besides layer 0 (`dense_layers: [0, 26, 27]`, where the recall measure found Quest's
#     decode bounds ranking worst); (b) the 0.5B at 16K and 32K: Twilight with candidates at 50%. (a) and (b) run
#     side by side (eager engines leave the GPU mostly idle); each group is paired with its run's dense.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo21e && cp -r . /tmp/repo21e && cd /tmp/repo21e
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s21e; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model15.log 2>&1; echo "stage1.5 rc=$?" >> $M/status
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/g05 > $M/stage_model05.log 2>&1; echo "stage0.5 rc=$?" >> $M/status
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
COMMON="--tasks niah_multikey niah_multivalue vt code --contexts 16384 32768 --samples 20 --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.12"
python3 benchmarks/eval_gpu_parallel.py $M/eval15 --groups twilight:0.25 quest:0.25+dl twilight:0.25+dl \
  --variant dl '{"dense_layers": [0, 26, 27]}' -- \
  --model qwen2.5-coder-1.5b-instruct $COMMON --sparse-config "{\"config\": \"$C15\"}" \
  > $M/eval15.log 2>&1 &
P1=$!
sleep 20
python3 benchmarks/eval_gpu_parallel.py $M/eval05 --groups twilight:0.25+cf50 \
  --variant cf50 '{"twilight": {"candidate_fraction": 0.5}}' -- \
  --model qwen2.5-coder-0.5b-instruct $COMMON --sparse-config "{\"config\": \"$C05\"}" \
  > $M/eval05.log 2>&1 &
P2=$!
wait $P1; echo "eval15 rc=$?" >> $M/status
wait $P2; echo "eval05 rc=$?" >> $M/status
echo done >> $M/status
