#!/usr/bin/env bash
# session 41 (planned in session 40), one nvidia-h200, branch fa-dense-decode checked out, vLLM staged, /tmp/gg15 carried.
#   1. exclusive: the real 1.5B's real32k_x16 (16 x 32.5K, 128 new tokens each) for FLASH_ATTN, sparse_quoka with its
#      dense decode through FlashAttention 3 (the branch's default), the same with the Triton kernel
#      (VLLM_SPARSE_DENSE_DECODE=triton, what main runs), sparse_quest (its layers 7-13 decode dense: FA3 now) and
#      FLASHINFER last (another dense kernel and cache layout on the same model and load)
#   2. the whole tests/gpu folder on the branch
R=$(pwd); rm -rf /tmp/repo41 && cp -r "$R" /tmp/repo41 && cd /tmp/repo41
source /tmp/env.sh
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 CUDA_VISIBLE_DEVICES=0
S=/tmp/s41; mkdir -p $S
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-1350}))
left() { echo $((END - $(date +%s))); }
nvidia-smi > $S/nvidia_smi.txt; nproc >> $S/nvidia_smi.txt; git log --oneline -1 >> $S/nvidia_smi.txt 2>/dev/null
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
TESTS_S=640
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage15.log 2>&1
echo "stage15 rc=$? $(date +%T)" >> $S/status
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 200 > $S/smi.csv 2>&1 &
SMI=$!
timeout $(($(left) - TESTS_S)) python3 benchmarks/serve_bench.py run --out $S/real15 --workdir /tmp/sb41 \
  --port 8141 --real-model qwen2.5-coder-1.5b-instruct --loads real32k_x16 --repeat-baseline 1 \
  --deadline $(($(left) - TESTS_S - 60)) --sparse-config "{\"config\": \"$C15\"}" \
  --variant tri '{"env": {"VLLM_SPARSE_DENSE_DECODE": "triton"}}' \
  --backends FLASH_ATTN,sparse_quoka,sparse_quoka+tri,sparse_quest,FLASHINFER > $S/real15.log 2>&1
echo "real15 rc=$? $(date +%T)" >> $S/status
kill $SMI; pkill -f "vllm.entrypoints"; sleep 3
(timeout $(($(left) - 15)) bash benchmarks/gpu_tests.sh $S/tests > /dev/null 2>&1
 echo "tests rc=$? $(date +%T)" >> $S/status) &
wait
echo "done $(date +%T)" >> $S/status
