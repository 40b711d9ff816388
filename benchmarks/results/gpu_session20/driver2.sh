#!/usr/bin/env bash
# session-20 machine 2 (one H100): issue 16 on the 1.5B model at 16K and 32K (the prompts of eval_qwen1.5b_gpu_h100,
# seed 0, 20 samples per task and context): Twilight with candidates of 50% of the context (was 25%) and Quest with
# the `sum` GQA rule, each paired with the same run's dense; then the whole tests/gpu folder on the final code.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo20b && cp -r . /tmp/repo20b && cd /tmp/repo20b
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s20b; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model.log 2>&1; echo "stage rc=$?" >> $M/status
CFG=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
python3 benchmarks/eval_gpu_parallel.py $M/eval --groups twilight:0.25+cf50 quest:0.25+sum \
  --variant cf50 '{"twilight": {"candidate_fraction": 0.5}}' --variant sum '{"quest": {"gqa_reduce": "sum"}}' -- \
  --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code \
  --contexts 16384 32768 --samples 20 --sparse-config "{\"config\": \"$CFG\"}" \
  --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.13 \
  > $M/eval.log 2>&1; echo "eval rc=$?" >> $M/status
bash benchmarks/gpu_tests.sh $M/tests > $M/tests.out 2>&1; echo "gpu tests rc=$?" >> $M/status
echo done >> $M/status
