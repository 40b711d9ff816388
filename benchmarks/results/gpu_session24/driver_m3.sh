#!/usr/bin/env bash
# session-24 machine 3 (one H100), issue 11: Twilight served with no --block-size (its new GPU default, pages of 32)
# beside FLASH_ATTN: `vllm serve` default mode + `vllm bench serve`, Llama-3.1-8B shapes, random weights, 12.5%.
cd "$(dirname "$0")/.." && rm -rf /tmp/repo24c && cp -r . /tmp/repo24c && cd /tmp/repo24c
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s24c; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads tpot128k,decode16 --deadline 720 \
  --repeat-baseline 1 --backends "FLASH_ATTN,sparse_twilight" > $M/sb.log 2>&1
echo "serve rc=$?" >> $M/status
grep -h "Setting kv cache block size\|block_size=" $M/sb/server_sparse_twilight*.log | head -5 > $M/twilight_block_size.txt
grep -h "JIT\|jit" $M/sb/server_*.log | head -20 > $M/jit_lines.txt
echo done >> $M/status
