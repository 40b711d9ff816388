#!/usr/bin/env bash
# session-24 machine 2 (one H100): the whole tests/gpu folder on this session's code (Twilight preferring pages of 32,
# the e2e run with no block size, the 0.5B config's layers 6-11 decoding dense), and beside it issue 16's last cell of
# that config: Kascade on the 0.5B (pages of 16, its default) with layers 6-11 decoding dense (the shipped config now)
# and without them (`nod6`), on eval_qwen_gpu_session21/eval05's prompts, joined with its dense run.
cd "$(dirname "$0")/.." && rm -rf /tmp/repo24b && cp -r . /tmp/repo24b && cd /tmp/repo24b
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s24b; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
(bash benchmarks/gpu_tests.sh $M/tests > $M/tests.out 2>&1; echo "gpu tests rc=$?" >> $M/status) &
T=$!
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg05 > $M/stage_model05.log 2>&1; echo "stage0.5 rc=$?" >> $M/status
C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
NOD6=$(python3 -c "import json; print(json.dumps({'layers': {str(l): {'sparse_decode': None} for l in range(6, 12)}}))")
python3 benchmarks/eval_gpu_parallel.py $M/evalk --dense-from drv24/dense05 --groups kascade:0.25 kascade:0.25+nod6 \
  --variant nod6 "$NOD6" -- --model qwen2.5-coder-0.5b-instruct --tasks niah_multikey niah_multivalue vt code \
  --contexts 16384 32768 --samples 20 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 \
  --gpu-memory-utilization 0.08 --sparse-config "{\"config\": \"$C05\"}" > $M/evalk.log 2>&1; echo "evalk rc=$?" >> $M/status
wait $T
echo done >> $M/status
