#!/usr/bin/env bash
# session-22 machine 1 (one H100): issue 16, then tests/gpu. Issue 16: on the 1.5B at 16K and 32K (seed 0, 20 prompts per task and context, the
# prompts of eval_qwen_gpu_session21/eval15), sparse engines only, paired with that run's dense (--dense-from).
# The CPU probe (decode_tail_probe, vt sample 2 at 32K) lost a chain link under every sparse decode and found it again
# with layers 7-13 decoding dense (layer 7 alone for the oracle). Per-layer `sparse_decode: false` (this session) on:
#   d7:  layers 7-13 decode dense (prefill unchanged): Quest, Twilight, Kascade, and QuoKA with sparse decode;
#   d1:  layers 1-13 decode dense (half the model): Quest.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo22e && cp -r . /tmp/repo22e && cd /tmp/repo22e
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s22e; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model15.log 2>&1; echo "stage1.5 rc=$?" >> $M/status
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
dd() { python3 -c "import json,sys; a,b=map(int,sys.argv[1:3]); print(json.dumps({'layers': {str(l): {'sparse_decode': False} for l in range(a, b + 1)}}))" "$@"; }
D7=$(dd 7 13); D1=$(dd 1 13)
D7SD=$(python3 -c "import json,sys; d=json.loads(sys.argv[1]); d['sparse_decode']=True; print(json.dumps(d))" "$D7")
COMMON="--tasks niah_multikey niah_multivalue vt code --contexts 16384 32768 --samples 20 --block-size 16 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.12"
python3 benchmarks/eval_gpu_parallel.py $M/eval15 --dense-from benchmarks/results/eval_qwen_gpu_session21/eval15/g00 \
  --groups quest:0.25+d7 twilight:0.25+d7 kascade:0.25+d7 quoka:0.25+d7sd quest:0.25+d1 \
  --variant d7 "$D7" --variant d1 "$D1" --variant d7sd "$D7SD" -- \
  --model qwen2.5-coder-1.5b-instruct $COMMON --sparse-config "{\"config\": \"$C15\"}" \
  > $M/eval15.log 2>&1
echo "eval15 rc=$?" >> $M/status
# then the whole tests/gpu folder on this tree (the per-layer decode switch touches the policy every GPU path reads)
bash benchmarks/gpu_tests.sh $M/tests > $M/tests.out 2>&1; echo "gpu tests rc=$?" >> $M/status
echo done >> $M/status
