#!/usr/bin/env bash
# session 40, one nvidia-h200 (run from the repo root, vLLM staged, /tmp/gg05 and /tmp/gg15 carried).
#   1. together: the whole tests/gpu folder (benchmarks/gpu_tests.sh); issue 16: compact on the 0.5B at its shipped
#      alpha 0.04 over the prompts its README cells hold at 0.08 (seed 0 16K+32K x32, seed 1 32K x64, seed 1 16K x32),
#      each paired with the dense run of the same prompts from sessions 33, 34 and 37
#   2. exclusive: the real 1.5B's prof_real32k_x16 for FLASH_ATTN and sparse_quoka -> decode_trace.py (issue 11:
#      where QuoKA's dense decode loses its 8-16% to FLASH_ATTN on this model)
R=$(pwd); rm -rf /tmp/repo40 && cp -r "$R" /tmp/repo40 && cd /tmp/repo40
source /tmp/env.sh
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 CUDA_VISIBLE_DEVICES=0
S=/tmp/s40; mkdir -p $S
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-1300}))
left() { echo $((END - $(date +%s))); }
nvidia-smi > $S/nvidia_smi.txt; nproc >> $S/nvidia_smi.txt; git log --oneline -1 >> $S/nvidia_smi.txt 2>/dev/null
TASKS="niah_single niah_multikey niah_multivalue vt code"
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml; C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
D=$(pwd)/.stage/drv40
COMMON05="--model qwen2.5-coder-0.5b-instruct --tasks $TASKS --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.08"
PROF_S=560   # what stage 2 needs
(timeout $(($(left) - PROF_S)) bash benchmarks/gpu_tests.sh $S/tests > /dev/null 2>&1
 echo "tests rc=$? $(date +%T)" >> $S/status) &
(bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage15.log 2>&1
 echo "stage15 rc=$? $(date +%T)" >> $S/status) &
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg05 > $S/stage05.log 2>&1
echo "stage05 rc=$? $(date +%T)" >> $S/status
ev() {  # NAME DENSE ARGS...
  local name=$1 dense=$2; shift 2
  timeout $(($(left) - PROF_S)) python3 benchmarks/eval_gpu_parallel.py $S/$name --stagger-s 2 \
    --dense-from $dense --gpus 0 --groups compact:0.25 -- $COMMON05 "$@" \
    --sparse-config "{\"config\": \"$C05\"}" > $S/$name.log 2>&1
  echo "$name rc=$? $(date +%T)" >> $S/status
}
ev c05s1_16k $D/d05s1_16k --contexts 16384 --samples 32 --seed 1 &
sleep 20; ev c05s0 $D/d05s0 --contexts 16384 32768 --samples 32 &
sleep 20; ev c05s1_32k $D/d05s1_32k --contexts 32768 --samples 64 --seed 1 &
wait
echo "stage1 done $(date +%T)" >> $S/status
pkill -f "vllm.entrypoints"; pkill -f "vllm_sparse.eval"; pkill -f e2e_gpu.py; sleep 3
nvidia-smi --query-gpu=memory.used --format=csv >> $S/status
timeout $(($(left) - 60)) python3 benchmarks/serve_bench.py run --out $S/prof15 --workdir /tmp/sb40 \
  --port 8140 --real-model qwen2.5-coder-1.5b-instruct --loads prof_real32k_x16 --repeat-baseline 1 \
  --deadline $(($(left) - 120)) --sparse-config "{\"config\": \"$C15\"}" \
  --backends FLASH_ATTN,sparse_quoka > $S/prof15.log 2>&1
echo "prof15 rc=$? $(date +%T)" >> $S/status
pkill -f "vllm.entrypoints"; sleep 2
python3 benchmarks/decode_trace.py $S/prof15/profile_flash_attn $S/prof15/profile_sparse_quoka \
  --json $S/prof15/decode_trace.json > $S/prof15/decode_trace.txt 2>&1
echo "trace rc=$? $(date +%T)" >> $S/status
echo "done $(date +%T)" >> $S/status
