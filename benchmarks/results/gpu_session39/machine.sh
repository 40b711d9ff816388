#!/usr/bin/env bash
# session 39 (second machine, after the first was lost idle): one nvidia-h200, vLLM staged, /tmp/gg15 and /tmp/gg05 carried.
# Together: the whole tests/gpu folder; issue 16 evals: Quest 1.5B at 37.5% on seed 0 (dense from session 34's
# eval15_seed0) and compact 0.5B 16K seed 1 at alpha 0.04 (the shipped config; dense from session 37's e05s1_16k).
R=$(pwd); rm -rf /tmp/repo39 && cp -r "$R" /tmp/repo39 && cd /tmp/repo39
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 CUDA_VISIBLE_DEVICES=0
S=/tmp/s39; mkdir -p $S
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-600}))
left() { echo $((END - $(date +%s))); }
nvidia-smi > $S/nvidia_smi.txt; nproc >> $S/nvidia_smi.txt; git log --oneline -1 >> $S/nvidia_smi.txt 2>/dev/null
TASKS="niah_single niah_multikey niah_multivalue vt code"
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml; C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
(timeout $(($(left) - 10)) bash benchmarks/gpu_tests.sh $S/tests > /dev/null 2>&1
 echo "tests rc=$? $(date +%T)" >> $S/status) &
(bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage15.log 2>&1
 echo "stage15 rc=$? $(date +%T)" >> $S/status
 timeout $(($(left) - 20)) python3 benchmarks/eval_gpu_parallel.py $S/e15s0_q375 --stagger-s 2 \
  --dense-from $(pwd)/.stage/drv39c/dense15 --gpus 0 --groups quest:0.375 -- \
  --model qwen2.5-coder-1.5b-instruct --tasks $TASKS --contexts 8192 16384 32768 --samples 24 --seed 0 \
  --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.12 \
  --sparse-config "{\"config\": \"$C15\"}" > $S/e15s0_q375.log 2>&1
 echo "e15 rc=$? $(date +%T)" >> $S/status) &
wait
echo "done $(date +%T)" >> $S/status
