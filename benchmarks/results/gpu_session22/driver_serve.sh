#!/usr/bin/env bash
# session-22 machine 2 (one H100), issue 11 and 16:
# (1) `vllm serve` default mode + `vllm bench serve`, Llama-3.1-8B shapes, random weights, 12.5%, loads tpot128k and
#     decode16, FLASH_ATTN in the same run:
#     b32: Quest with pages of 32 tokens (`vllm serve --block-size 32`) in place of 16: half the pages to bound and
#          rank at decode, twice as long contiguous reads per page (issue 11's TPOT and decode16 gaps are selection
#          and scattered-page reads);
#     d8:  Quest decoding layers 8-15 of 32 dense (issue 16's per-layer `sparse_decode: false`, the share of the
#          1.5B's layers 7-13 of 28; every layer of a random model costs the same).
# (2) then the accuracy of Quest with pages of 32 on the 1.5B at 16K and 32K (the prompts of
#     eval_qwen_gpu_session21/eval15, paired with its dense run).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo22s && cp -r . /tmp/repo22s && cd /tmp/repo22s
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s22s; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
(bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg > $M/stage_model15.log 2>&1; echo "stage1.5 rc=$?" >> $M/status) &
STAGE=$!
D8=$(python3 -c "import json; print(json.dumps({'layers': {str(l): {'sparse_decode': False} for l in range(8, 16)}}))")
python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads tpot128k,decode16 --deadline 1100 \
  --repeat-baseline 1 --variant d8 "$D8" --variant b32 '{"server_args": ["--block-size", "32"]}' \
  --backends "FLASH_ATTN,sparse_quest,sparse_quest+b32,sparse_quest+d8" > $M/sb.log 2>&1
echo "serve rc=$?" >> $M/status
wait $STAGE
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
python3 benchmarks/eval_gpu_parallel.py $M/eval15 --dense-from benchmarks/results/eval_qwen_gpu_session21/eval15/g00 --groups quest:0.25+b32 --variant b32 "{}" -- \
  --model qwen2.5-coder-1.5b-instruct --tasks niah_multikey niah_multivalue vt code --contexts 16384 32768 --samples 20 \
  --block-size 32 --max-num-batched-tokens 8192 --max-num-seqs 16 --kv-cache-gib 5 --gpu-memory-utilization 0.12 \
  --sparse-config "{\"config\": \"$C15\"}" > $M/eval15.log 2>&1
echo "eval15 rc=$?" >> $M/status
echo done >> $M/status
