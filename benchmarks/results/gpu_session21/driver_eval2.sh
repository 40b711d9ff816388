#!/usr/bin/env bash
# session-21 machine 3 (one H100): issue 16 on the 1.5B at 16K and 32K (the prompts of the earlier runs, seed 0,
# 20 per task and context), sparse engines only, to be joined with the dense run of driver_eval.sh
# (eval_qwen_gpu_session21/eval15/g00, same prompts): QuoKA with sparse decode steps (`sparse_decode: true`; its
# default decodes dense) and Quest at a 37.5% budget (what Quest needs to answer as dense does at 32K).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo21f && cp -r . /tmp/repo21f && cd /tmp/repo21f
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s21f; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model15.log 2>&1; echo "stage1.5 rc=$?" >> $M/status
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
COMMON="--model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code --contexts 16384 32768 --samples 20 --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.12 --sparse-only --no-progress"
python3 -m vllm_sparse.eval.cli $COMMON --methods quoka --budgets 0.25 --label-suffix +sd \
  --sparse-config "{\"config\": \"$C15\", \"sparse_decode\": true}" --out $M/quoka_sd > $M/quoka_sd.log 2>&1 &
P1=$!
sleep 10
python3 -m vllm_sparse.eval.cli $COMMON --methods quest --budgets 0.375 \
  --sparse-config "{\"config\": \"$C15\"}" --out $M/quest375 > $M/quest375.log 2>&1 &
P2=$!
wait $P1; echo "quoka_sd rc=$?" >> $M/status
wait $P2; echo "quest375 rc=$?" >> $M/status
echo done >> $M/status
