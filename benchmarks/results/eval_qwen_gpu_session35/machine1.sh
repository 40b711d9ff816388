#!/usr/bin/env bash
# session 35, machine 1 (4 H100s, one host), run from the repo root with .stage/drv carried.
# 1. Issue 16/13 accuracy variants, sparse only, paired with the dense runs of sessions 33-34 on the same prompts
#    (--dense-from; those folders' samples.json carried in .stage/drv/dense), groups on GPUs 0-2, host cores 0-47:
#    sum  = quest.gqa_reduce: sum (Quest, and Twilight's Quest candidates)
#    p98  = twilight.top_p: 0.98
#    s4   = kascade.tile_stride: 4
#    1.5B: seed 0 at 8K/16K/32K x 24 a task, seed 1 at 16K/32K x 16, seed 2 x 12 (session 34's prompts)
#    0.5B: seed 0 at 16K/32K x 32 (session 33's), seed 1 at 32K x 64 (session 34's)
# 2. Decode speed of quest.gqa_reduce sum against max and FLASH_ATTN (serve_bench decode16, Llama-3.1-8B shapes,
#    random weights, default mode), on GPU 3 alone, host cores 48-63, in the same window as the evals.
R=$(pwd); rm -rf /tmp/repo35 && cp -r "$R" /tmp/repo35 && cd /tmp/repo35
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s35; mkdir -p $S
D=/tmp/repo35/.stage/drv/dense
nvidia-smi > $S/nvidia_smi.txt; nproc >> $S/nvidia_smi.txt
(CUDA_VISIBLE_DEVICES=3 timeout 780 taskset -c 48-63 python3 benchmarks/serve_bench.py run --out $S/speed \
   --backends FLASH_ATTN,sparse_quest,sparse_quest+sum --loads decode16 --repeat-baseline 1 \
   --variant sum '{"quest": {"gqa_reduce": "sum"}}' > $S/speed.log 2>&1
 echo "speed rc=$? $(date +%T)" >> $S/status) &
(bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage_model15.log 2>&1
 echo "stage15 rc=$?" >> $S/status) & P15=$!
(bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg05 > $S/stage_model05.log 2>&1
 echo "stage05 rc=$?" >> $S/status) & P05=$!
wait $P15 $P05
echo "staged $(date +%T)" >> $S/status
TASKS="niah_single niah_multikey niah_multivalue vt code"
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
VARS=(--variant sum '{"quest": {"gqa_reduce": "sum"}}' --variant p98 '{"twilight": {"top_p": 0.98}}'
      --variant s4 '{"kascade": {"tile_stride": 4}}')
ev15() {  # NAME SEED SAMPLES CONTEXTS GPUS...
  local name=$1 seed=$2 n=$3 ctx=$4; shift 4
  (timeout 720 taskset -c 0-47 python3 benchmarks/eval_gpu_parallel.py $S/$name --stagger-s 2 --dense-from $D/$name \
     --gpus "$@" "${VARS[@]}" --groups quest:0.25+sum twilight:0.25+sum twilight:0.25+p98 kascade:0.25+s4 -- \
     --model qwen2.5-coder-1.5b-instruct --tasks $TASKS --contexts $ctx --samples $n --seed $seed \
     --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12 \
     --sparse-config "{\"config\": \"$C15\"}" > $S/$name.log 2>&1
   echo "$name rc=$? $(date +%T)" >> $S/status) &
}
ev05() {  # NAME SEED SAMPLES CONTEXTS GPUS...
  local name=$1 seed=$2 n=$3 ctx=$4; shift 4
  (timeout 720 taskset -c 0-47 python3 benchmarks/eval_gpu_parallel.py $S/$name --stagger-s 2 --dense-from $D/$name \
     --gpus "$@" "${VARS[@]}" --groups quest:0.25+sum kascade:0.25+s4 -- \
     --model qwen2.5-coder-0.5b-instruct --tasks $TASKS --contexts $ctx --samples $n --seed $seed \
     --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.08 \
     --sparse-config "{\"config\": \"$C05\"}" > $S/$name.log 2>&1
   echo "$name rc=$? $(date +%T)" >> $S/status) &
}
ev15 e15s0 0 24 "8192 16384 32768" 0 1 2 0
sleep 8
ev15 e15s1 1 16 "16384 32768" 1 2 0 1
sleep 8
ev15 e15s2 2 12 "16384 32768" 2 0 1 2
sleep 8
ev05 e05s0 0 32 "16384 32768" 0 1
sleep 4
ev05 e05s1 1 64 "32768" 2 0
wait
echo done >> $S/status
