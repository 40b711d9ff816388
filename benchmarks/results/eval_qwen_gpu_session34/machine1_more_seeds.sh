#!/usr/bin/env bash
# session 34, machine 1, after machine1.sh on the same staged host (vLLM, both models and FlashInfer's JIT cache in
# place): two more shards of the 1.5B at its shipped config, on other prompts (seeds 1 and 2) at 16K and 32K, to pool
# with machine1.sh's seed-0 run (python -m vllm_sparse.eval.pool). Each ran under `timeout` so that the device time
# could not run out before its files were fetched.
cd /tmp/repo34 && source /tmp/env.sh && export PYTHONUNBUFFERED=1
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
TASKS="niah_single niah_multikey niah_multivalue vt code"
shard() {  # OUT SAMPLES SEED TIMEOUT
  timeout "$4" python3 benchmarks/eval_gpu_parallel.py "$1" --stagger-s 1 --gpus 0 1 2 3 2 \
    --groups quest:0.25 twilight:0.25 quoka:0.25 compact:0.25 kascade:0.25 -- \
    --model qwen2.5-coder-1.5b-instruct --tasks $TASKS --contexts 16384 32768 --samples "$2" --seed "$3" \
    --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12 \
    --sparse-config "{\"config\": \"$C15\"}"
}
shard /tmp/s34b/eval15s1 16 1 420 > /tmp/s34b_eval15s1.log 2>&1   # 277 s (stagger 2 s in the run)
shard /tmp/s34c/eval15s2 12 2 290 > /tmp/s34c_eval15s2.log 2>&1   # 221 s
