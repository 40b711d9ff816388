#!/usr/bin/env bash
# session 36, machine 1 (4 H100s, one host), run from the repo root with .stage/drv36 carried.
# Stage A, at once:
#   GPUs 0-1 (host cores 0-39): issue 16, the 1.5B at 8K: Quest's budget floor (budget.min_tokens 3072 / 4096, the
#     variants min3k / min4k: 37.5% / 50% of an 8K prompt, 25% from 12K / 16K on) on session 34's seed-0 prompts
#     (sparse only, --dense-from), and two new seeds at 8K (32 prompts a task) with dense and every method.
#   GPU 2 (cores 40-51) and GPU 3 (52-63): issue 16's "buys in speed" on real weights: the plain 1.5B served in
#     default mode, every method with its shipped config, loads real32k (9 prompts one at a time) and real32k_x16
#     (16 at once, 128 new tokens), FLASH_ATTN on each GPU; Twilight also at top_p 0.95 (the 0.98 it ships).
# Stage B, on GPUs 2-3 once their serving is done: the YaRN twin (1.5B@yarn4) at 64K and 128K, served (GPU 2) and
#   evaluated (GPU 3, 64K), until the deadline.
R=$(pwd); rm -rf /tmp/repo36 && cp -r "$R" /tmp/repo36 && cd /tmp/repo36
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
S=/tmp/s36; mkdir -p $S
D=/tmp/repo36/.stage/drv36/dense
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-1080}))
nvidia-smi > $S/nvidia_smi.txt; nproc >> $S/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage_model15.log 2>&1
echo "stage15 rc=$? $(date +%T)" >> $S/status
TASKS="niah_single niah_multikey niah_multivalue vt code"
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
SC="{\"config\": \"$C15\"}"
VARS=(--variant min3k '{"budget": {"min_tokens": 3072}}' --variant min4k '{"budget": {"min_tokens": 4096}}')
EARGS=(--max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12)
left() { echo $((END - $(date +%s))); }
serve() {  # NAME GPU CORES MODEL LOADS BACKENDS
  local name=$1 gpu=$2 cores=$3 model=$4 loads=$5 backends=$6
  (CUDA_VISIBLE_DEVICES=$gpu timeout $(($(left) - 20)) taskset -c $cores python3 benchmarks/serve_bench.py run \
     --out $S/$name --port $((8100 + gpu)) --real-model $model --loads $loads --repeat-baseline 1 \
     --deadline $(($(left) - 60)) --sparse-config "$SC" --backends $backends \
     --variant p95 '{"twilight": {"top_p": 0.95}}' > $S/$name.log 2>&1
   echo "$name rc=$? $(date +%T)" >> $S/status)
}
# stage A: evals
(timeout $(($(left) - 10)) taskset -c 0-39 python3 benchmarks/eval_gpu_parallel.py $S/e15s0_8k --stagger-s 2 \
   --dense-from $D/e15s0 --gpus 0 1 "${VARS[@]}" --groups quest:0.25+min3k quest:0.25+min4k -- \
   --model qwen2.5-coder-1.5b-instruct --tasks $TASKS --contexts 8192 --samples 24 --seed 0 "${EARGS[@]}" \
   --sparse-config "$SC" > $S/e15s0_8k.log 2>&1
 echo "e15s0_8k rc=$? $(date +%T)" >> $S/status) &
for seed in 1 2; do
  sleep 6
  (timeout $(($(left) - 10)) taskset -c 0-39 python3 benchmarks/eval_gpu_parallel.py $S/e15s${seed}_8k --stagger-s 2 \
     --gpus $((seed - 1)) $((2 - seed)) "${VARS[@]}" \
     --groups quest:0.25 quest:0.25+min3k quest:0.25+min4k quoka,twilight:0.25 kascade,compact:0.25 -- \
     --model qwen2.5-coder-1.5b-instruct --tasks $TASKS --contexts 8192 --samples 32 --seed $seed "${EARGS[@]}" \
     --sparse-config "$SC" > $S/e15s${seed}_8k.log 2>&1
   echo "e15s${seed}_8k rc=$? $(date +%T)" >> $S/status) &
done
# stage A: serving, then stage B on the same GPUs
(serve real15_a 2 40-51 qwen2.5-coder-1.5b-instruct real32k,real32k_x16 \
   FLASH_ATTN,sparse_quest,sparse_quoka,sparse_kascade
 serve yarn15 2 40-51 qwen2.5-coder-1.5b-instruct@yarn4 real64k,real128k \
   FLASH_ATTN,sparse_compact,sparse_quoka,sparse_quest,sparse_twilight,sparse_kascade) &
(serve real15_b 3 52-63 qwen2.5-coder-1.5b-instruct real32k,real32k_x16 \
   FLASH_ATTN,sparse_twilight,sparse_twilight+p95,sparse_compact
 timeout $(($(left) - 10)) taskset -c 52-63 python3 benchmarks/eval_gpu_parallel.py $S/yarn64k --stagger-s 2 \
   --gpus 3 --groups quest:0.25 quoka:0.25 twilight:0.25 kascade:0.25 compact:0.25 -- \
   --model qwen2.5-coder-1.5b-instruct@yarn4 --tasks $TASKS --contexts 65536 --samples 6 --seed 0 \
   --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 6 --gpu-memory-utilization 0.15 \
   --sparse-config "$SC" > $S/yarn64k.log 2>&1
 echo "yarn64k rc=$? $(date +%T)" >> $S/status) &
wait
echo "done $(date +%T)" >> $S/status
