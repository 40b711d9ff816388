#!/usr/bin/env bash
# session-22 machine 3 (one H100): the whole tests/gpu folder on this session's final GPU code (per-layer decode and
# Quest's preferred pages of 32 on CUDA), then `vllm serve` in its default mode with no --block-size (so sparse_quest
# takes its new default pages of 32; the server log says so) against FLASH_ATTN in the same run: loads tpot128k,
# decode16 and A (Llama-3.1-8B shapes, random weights, 12.5%).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo22m && cp -r . /tmp/repo22m && cd /tmp/repo22m
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s22m; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_tests.sh $M/tests > $M/tests.out 2>&1; echo "gpu tests rc=$?" >> $M/status
python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads tpot128k,decode16,A --deadline 560 \
  --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quest" > $M/sb.log 2>&1
echo "serve rc=$?" >> $M/status
grep -h "Setting kv cache block size\|block_size" $M/sb/server_sparse_quest.log | head -5 > $M/quest_block_size.txt
echo done >> $M/status
