#!/usr/bin/env bash
# session 37, one nvidia-h100-x2 (run from the repo root, branch few-rows-env, vLLM staged, /tmp/gg15 and /tmp/gg05).
# Question of issue 11 item 4: do 32 decode rows at 4 programs per SM (FEW_ROWS=32) cost the real 1.5B's dense decode
# its 12% against FLASH_ATTN (session 36: 8.39 against 7.34 ms a step at 16 x 32K)? VLLM_SPARSE_DECODE_FEW_ROWS=0
# gives every batch 2 programs per SM (variant fr0).
#   GPU 0 (cores 0-15):  kernel per_sm grid on both shapes; Llama shapes decode16,tpot128k: FA, Quest, Quest+fr0;
#                        then issue 16: 0.5B 16K seed 1 (160 prompts), dense + every method; 1.5B 32K seed 3 (100)
#   GPU 1 (cores 16-31): real 1.5B real32k_x16: FA, QuoKA, QuoKA+fr0, Quest+fr0, Quest; then tests/gpu with FEW_ROWS=0
R=$(pwd); rm -rf /tmp/repo37 && cp -r "$R" /tmp/repo37 && cd /tmp/repo37
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
S=/tmp/s37; mkdir -p $S
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-1260}))
left() { echo $((END - $(date +%s))); }
nvidia-smi > $S/nvidia_smi.txt; nproc >> $S/nvidia_smi.txt; git log --oneline -1 >> $S/nvidia_smi.txt 2>&1
TASKS="niah_single niah_multikey niah_multivalue vt code"
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml; C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
FR0=(--variant fr0 '{"env": {"VLLM_SPARSE_DECODE_FEW_ROWS": "0"}}')
(taskset -c 16-31 bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage15.log 2>&1
 echo "stage15 rc=$? $(date +%T)" >> $S/status
 taskset -c 16-31 bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg05 > $S/stage05.log 2>&1
 echo "stage05 rc=$? $(date +%T)" >> $S/status) &
# GPU 0
(export CUDA_VISIBLE_DEVICES=0
 B="taskset -c 0-15 python3 benchmarks/bench_decode_attention_tuning_gpu.py --grid per_sm --selection first --chain 16 --flush read --reps 20 --page-size 16"
 $B --heads 12:2 --cases 16:32768:1,16:16384:1,4:32768:1 --out $S/kern_qwen15b.json > $S/kern.log 2>&1
 $B --heads 32:8 --cases 1:131072:1,4:16384:1,1:131072:0.125,16:16384:0.125 --out $S/kern_llama8b.json >> $S/kern.log 2>&1
 echo "kern rc=$? $(date +%T)" >> $S/status
 timeout $(($(left) - 500)) taskset -c 0-15 python3 benchmarks/serve_bench.py run --out $S/llama --workdir /tmp/sb37a \
   --port 8140 --loads decode16,tpot128k --repeat-baseline 1 --deadline $(($(left) - 560)) "${FR0[@]}" \
   --backends FLASH_ATTN,sparse_quest,sparse_quest+fr0 > $S/llama.log 2>&1
 echo "llama rc=$? $(date +%T)" >> $S/status
 while ! grep -q stage05 $S/status; do sleep 2; done
 timeout $(($(left) - 250)) taskset -c 0-15 python3 benchmarks/eval_gpu_parallel.py $S/e05s1_16k --stagger-s 2 \
   --gpus 0 0 0 0 0 --groups quest:0.25 twilight:0.25 kascade:0.25 quoka:0.25 compact:0.25 -- \
   --model qwen2.5-coder-0.5b-instruct --tasks $TASKS --contexts 16384 --samples 32 --seed 1 \
   --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.08 \
   --sparse-config "{\"config\": \"$C05\"}" > $S/e05s1_16k.log 2>&1
 echo "e05s1_16k rc=$? $(date +%T)" >> $S/status
 timeout $(($(left) - 10)) taskset -c 0-15 python3 benchmarks/eval_gpu_parallel.py $S/e15s3_32k --stagger-s 2 \
   --gpus 0 0 0 --groups kascade:0.25 quest:0.25 twilight:0.25 -- \
   --model qwen2.5-coder-1.5b-instruct --tasks $TASKS --contexts 32768 --samples 20 --seed 3 \
   --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12 \
   --sparse-config "{\"config\": \"$C15\"}" > $S/e15s3_32k.log 2>&1
 echo "e15s3_32k rc=$? $(date +%T)" >> $S/status) &
# GPU 1
(while ! grep -q stage15 $S/status; do sleep 2; done
 export CUDA_VISIBLE_DEVICES=1
 timeout $(($(left) - 420)) taskset -c 16-31 python3 benchmarks/serve_bench.py run --out $S/real15 --workdir /tmp/sb37b \
   --port 8141 --real-model qwen2.5-coder-1.5b-instruct --loads real32k_x16 --repeat-baseline 1 \
   --deadline $(($(left) - 480)) --sparse-config "{\"config\": \"$C15\"}" "${FR0[@]}" \
   --backends FLASH_ATTN,sparse_quoka,sparse_quoka+fr0,sparse_quest+fr0,sparse_quest > $S/real15.log 2>&1
 echo "real15 rc=$? $(date +%T)" >> $S/status
 VLLM_SPARSE_DECODE_FEW_ROWS=0 timeout $(($(left) - 10)) taskset -c 16-31 bash benchmarks/gpu_tests.sh $S/tests_fr0 > /dev/null 2>&1
 echo "tests_fr0 rc=$? $(date +%T)" >> $S/status) &
wait
echo "done $(date +%T)" >> $S/status
