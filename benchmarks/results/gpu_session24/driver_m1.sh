#!/usr/bin/env bash
# session-24 machine 1 (one H100): issue 16, session 23 machine 2's accuracy runs without its tests (see
# ../gpu_session23/driver_m2.sh for the reasons): the 0.5B layer search for Quest and Twilight at pages of 32
# (d6: layers 6-11, d1: 1-11, d12: 12-23 decoding dense), Twilight's shipped 0.5B config at pages of 32, and
# the 1.5B shipped config for Quest and Twilight at pages of 32, paired with eval_qwen_gpu_session21's dense runs.
cd "$(dirname "$0")/.." && rm -rf /tmp/repo24a && cp -r . /tmp/repo24a && cd /tmp/repo24a
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s24a; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg05 > $M/stage_model05.log 2>&1; echo "stage0.5 rc=$?" >> $M/status
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $M/stage_model15.log 2>&1; echo "stage1.5 rc=$?" >> $M/status
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
C05=$(pwd)/configs/qwen2.5-coder-0.5b-instruct.yaml
dd() { python3 -c "import json,sys; a,b=map(int,sys.argv[1:3]); print(json.dumps({'layers': {str(l): {'sparse_decode': False} for l in range(a, b + 1)}}))" "$@"; }
D6=$(dd 6 11); D1=$(dd 1 11); D12=$(dd 12 23)
COMMON="--tasks niah_multikey niah_multivalue vt code --contexts 16384 32768 --samples 20 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 4 --gpu-memory-utilization 0.08"
VARS=(--variant d6 "$D6" --variant d1 "$D1" --variant d12 "$D12")
python3 benchmarks/eval_gpu_parallel.py $M/evalq --dense-from drv24/dense05 \
  --groups quest:0.25 quest:0.25+d6 quest:0.25+d1 quest:0.25+d12 twilight:0.25 "${VARS[@]}" -- \
  --model qwen2.5-coder-0.5b-instruct $COMMON --block-size 32 --sparse-config "{\"config\": \"$C05\"}" > $M/evalq.log 2>&1 &
P1=$!
sleep 20
python3 benchmarks/eval_gpu_parallel.py $M/evalt --dense-from drv24/dense05 \
  --groups twilight:0.25+d6 twilight:0.25+d1 twilight:0.25+d12 "${VARS[@]}" -- \
  --model qwen2.5-coder-0.5b-instruct $COMMON --block-size 32 --sparse-config "{\"config\": \"$C05\"}" > $M/evalt.log 2>&1 &
P2=$!
sleep 20
python3 benchmarks/eval_gpu_parallel.py $M/eval15 --dense-from drv24/dense15 --groups quest:0.25 twilight:0.25 -- \
  --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code --contexts 16384 32768 --samples 20 \
  --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.11 --block-size 32 \
  --sparse-config "{\"config\": \"$C15\"}" > $M/eval15.log 2>&1 &
P3=$!
wait $P1; echo "evalq rc=$?" >> $M/status
wait $P2; echo "evalt rc=$?" >> $M/status
wait $P3; echo "eval15 rc=$?" >> $M/status
echo done >> $M/status
