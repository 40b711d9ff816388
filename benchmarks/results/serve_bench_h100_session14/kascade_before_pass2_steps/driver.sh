#!/usr/bin/env bash
# session-14 machine 1 (c): the decode graph test again (Kascade's pick voided by new anchor scores), then
# Kascade served in vLLM's default mode beside FLASH_ATTN (issue 13's targets: 10% budget, the paper's 5 anchors)
cd "$(dirname "$0")/.." && rm -rf /tmp/repo14s && cp -r . /tmp/repo14s && cd /tmp/repo14s
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s14s; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 -m pytest -q tests/gpu/test_decode_graph_gpu.py -p no:cacheprovider > $M/decode_graph.log 2>&1; echo "decode graph rc=$?" >> $M/status
CFG=$(pwd)/configs/llama-3.1-8b-instruct.yaml
( time python3 benchmarks/serve_bench.py run --out $M/serve --backends FLASH_ATTN,sparse_kascade --loads tpot128k,decode16 \
  --sparse-config "{\"config\": \"$CFG\", \"budget\": {\"fraction\": 0.1}}" ) > $M/serve.out 2>&1; echo "serve rc=$?" >> $M/status
echo done >> $M/status
