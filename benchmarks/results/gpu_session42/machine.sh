#!/usr/bin/env bash
# session 42 (planned in session 41), one nvidia-h200, branch fa-dense-decode checked out, vLLM staged in /tmp/stage,
# /tmp/gg15 carried; the package installed by the launching call (eval "$(bash benchmarks/gpu_setup.sh)", preflight).
#   1. exclusive: the real 1.5B's real32k_x16 (16 x 32.5K, 128 new tokens each): FLASH_ATTN, sparse_quoka (dense decode
#      through FlashAttention 3, the branch's default), sparse_quest (Triton sparse rows, FA3 dense layers 7-13),
#      sparse_quest+fa (VLLM_SPARSE_SPARSE_DECODE=flash: its selected rows through FA3 too), sparse_quoka+tri
#      (VLLM_SPARSE_DENSE_DECODE=triton: what main runs) last, as far as the deadline allows
#   2. the whole tests/gpu folder on the branch
#   3. with time left: Llama-8B shapes' decode16 for FLASH_ATTN, sparse_quest+fa, sparse_quest
R=$(pwd); rm -rf /tmp/repo42 && cp -r "$R" /tmp/repo42 && cd /tmp/repo42
source /tmp/env.sh
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 CUDA_VISIBLE_DEVICES=0
S=/tmp/s42; mkdir -p $S
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-1350}))
left() { echo $((END - $(date +%s))); }
nvidia-smi > $S/nvidia_smi.txt; nproc >> $S/nvidia_smi.txt
python3 benchmarks/gpu_preflight.py >> $S/status 2>&1 || { echo "preflight failed" >> $S/status; echo "done" >> $S/status; exit 2; }
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
TESTS_S=${TESTS_S:-660}
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage15.log 2>&1
echo "stage15 rc=$? $(date +%T)" >> $S/status
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 500 > $S/smi.csv 2>&1 &
SMI=$!
timeout $(($(left) - TESTS_S)) python3 benchmarks/serve_bench.py run --out $S/real15 --workdir /tmp/sb42 \
  --port 8142 --real-model qwen2.5-coder-1.5b-instruct --loads real32k_x16 --repeat-baseline 1 \
  --deadline $(($(left) - TESTS_S - 30)) --sparse-config "{\"config\": \"$C15\"}" \
  --variant fa '{"env": {"VLLM_SPARSE_SPARSE_DECODE": "flash"}}' \
  --variant tri '{"env": {"VLLM_SPARSE_DENSE_DECODE": "triton"}}' \
  --backends FLASH_ATTN,sparse_quoka,sparse_quest,sparse_quest+fa,sparse_quoka+tri > $S/real15.log 2>&1
echo "real15 rc=$? $(date +%T)" >> $S/status
kill $SMI; pkill -f "vllm.entrypoints"; sleep 3
timeout $(($(left) - 10)) bash benchmarks/gpu_tests.sh $S/tests > /dev/null 2>&1
echo "tests rc=$? $(date +%T)" >> $S/status
# 3. if time is left: Llama-3.1-8B shapes (random weights), issue 11's decode16, Quest's rows on Triton and on FA3
if [ $(left) -gt 420 ]; then
  timeout $(($(left) - 10)) python3 benchmarks/serve_bench.py run --out $S/llama --workdir /tmp/sb42l --port 8143 \
    --loads decode16 --repeat-baseline 1 --deadline $(($(left) - 20)) \
    --variant fa '{"env": {"VLLM_SPARSE_SPARSE_DECODE": "flash"}}' \
    --backends FLASH_ATTN,sparse_quest+fa,sparse_quest > $S/llama.log 2>&1
  echo "llama rc=$? $(date +%T)" >> $S/status
  pkill -f "vllm.entrypoints"
fi
echo "done $(date +%T)" >> $S/status
