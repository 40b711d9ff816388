#!/usr/bin/env bash
# session 34, machine 1 (4 H100s, one host): issue 16 on real weights, every method on shared prompts.
# 1. Qwen2.5-Coder-1.5B-Instruct (GGUF carried in 18 pieces to /tmp/gg15): dense and every method at 25% (the
#    shipped config) and 12.5%, tasks niah_single niah_multikey niah_multivalue vt code at 8K, 16K and 32K, 24
#    samples each (120 prompts per context and backend), seed 0, pages of 32: ten groups over the four GPUs
#    (eval_gpu_parallel.py --gpus; GPU 0 holds only the dense groups: this one and the 0.5B's).
# 2. Qwen2.5-Coder-0.5B-Instruct (8 pieces to /tmp/gg05): dense and every method at its shipped config at 32K,
#    64 samples per task with seed 1 (320 prompts), to pool with session 33's seed-0 run
#    (python -m vllm_sparse.eval.pool) for 480 prompts at 32K.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo34 && cp -r . /tmp/repo34 && cd /tmp/repo34
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s34; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
nproc >> $S/nvidia_smi.txt
(bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage_model15.log 2>&1
 echo "stage15 rc=$?" >> $S/status) &
(bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg05 > $S/stage_model05.log 2>&1
 echo "stage05 rc=$?" >> $S/status) &
wait
echo "staged $(date +%T)" >> $S/status
TASKS="niah_single niah_multikey niah_multivalue vt code"
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
(python3 benchmarks/eval_gpu_parallel.py $S/eval15 --gpus 0 1 2 3 1 2 3 1 2 3 \
  --groups quest:0.25 twilight:0.25 quoka:0.25 compact:0.25 kascade:0.25 \
           quest:0.125 twilight:0.125 quoka:0.125 compact:0.125 kascade:0.125 -- \
  --model qwen2.5-coder-1.5b-instruct --tasks $TASKS --contexts 8192 16384 32768 --samples 24 \
  --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12 \
  --sparse-config "{\"config\": \"$C15\"}" > $S/eval15.log 2>&1
 echo "eval15 rc=$? $(date +%T)" >> $S/status) &
sleep 20
(python3 benchmarks/eval_gpu_parallel.py $S/eval05 --gpus 0 1 2 3 1 \
  --groups quest:0.25 twilight:0.25 quoka:0.25 compact:0.25 kascade:0.25 -- \
  --model qwen2.5-coder-0.5b-instruct --tasks $TASKS --contexts 32768 --samples 64 --seed 1 \
  --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.08 \
  --sparse-config "{\"config\": \"$C05\"}" > $S/eval05.log 2>&1
 echo "eval05 rc=$? $(date +%T)" >> $S/status) &
wait
echo done >> $S/status
