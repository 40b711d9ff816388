#!/usr/bin/env bash
# session 29, second H100: issue 13's serving targets re-measured on today's tree (last measured in session 15): one
# 130K prompt and 16 x 16K decode, FLASH_ATTN and sparse_kascade with the shipped Llama-3.1-8B config (the paper's
# anchors 0, 2, 8, 13, 14) at a 10% budget, one server each, same machine. Run as
# `bash benchmarks/results/gpu_session29/kascade.sh` after gpu_setup; results under /tmp/s29k.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo29k && cp -r . /tmp/repo29k && cd /tmp/repo29k
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s29k; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb29k --port 8130 --loads tpot128k,decode16 \
  --deadline 1200 --repeat-baseline 1 \
  --variant k10 '{"config": "/tmp/repo29k/configs/llama-3.1-8b-instruct.yaml", "budget": {"fraction": 0.1}}' \
  --backends "${1:-FLASH_ATTN,sparse_kascade+k10}" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
grep -h "Setting kv cache block size\|JIT compilation\|cudagraph_mode" $S/loads/server_*.log | head -30 > $S/jit_and_graphs.txt
echo done >> $S/status
