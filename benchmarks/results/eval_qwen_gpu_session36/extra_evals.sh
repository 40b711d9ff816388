#!/usr/bin/env bash
# session 36: started by hand on GPUs 0 and 1 once the 8K evals of machine1.sh had finished (06:15), in its
# environment (source /tmp/env.sh; VLLM_USE_FLASHINFER_SAMPLER=0), from /tmp/repo36: the YaRN twin of the 1.5B
# (`@yarn4`: 131,072 positions) with dense and every method at its shipped config, at 64K (6 prompts a task) and
# 128K (4 a task). machine1.sh's stage B ran the same 64K eval again on GPU 3 (yarn64k/).
S=/tmp/s36; C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
TASKS="niah_single niah_multikey niah_multivalue vt code"
timeout 590 taskset -c 0-19 python3 benchmarks/eval_gpu_parallel.py $S/yarn64k_early --stagger-s 2 --gpus 1 \
  --groups quest:0.25 quoka:0.25 twilight:0.25 kascade:0.25 compact:0.25 -- \
  --model qwen2.5-coder-1.5b-instruct@yarn4 --tasks $TASKS --contexts 65536 --samples 6 --seed 0 \
  --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 6 --gpu-memory-utilization 0.15 \
  --sparse-config "{\"config\": \"$C15\"}" > $S/yarn64k_early.log 2>&1 &
sleep 3
timeout 580 taskset -c 20-39 python3 benchmarks/eval_gpu_parallel.py $S/yarn128k --stagger-s 2 --gpus 0 \
  --groups quest:0.25 quoka:0.25 twilight:0.25 kascade:0.25 compact:0.25 -- \
  --model qwen2.5-coder-1.5b-instruct@yarn4 --tasks $TASKS --contexts 131072 --samples 4 --seed 0 \
  --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 8 --gpu-memory-utilization 0.15 \
  --sparse-config "{\"config\": \"$C15\"}" > $S/yarn128k.log 2>&1 &
wait
