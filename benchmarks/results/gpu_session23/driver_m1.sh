#!/usr/bin/env bash
# session-23 machine 1 (one H100), issues 11 and 18: `vllm serve` default mode + `vllm bench serve`, Llama-3.1-8B
# shapes, random weights, 12.5%, FLASH_ATTN and FLASHINFER in the same run.
#   sparse_quest with no --block-size: its new GPU default, pages of 32 (SparseQuestBackend.gpu_page_tokens; the impl
#     now reads the block size vLLM settles after load_model, so the start-up warm-up compiles for pages of 32 and
#     vLLM's JIT monitor must see nothing compile during inference); loads tpot128k, decode16, A.
#   sparse_twilight at pages of 16 and 32 (`--block-size 32`), side by side: is 32 Twilight's default too?
cd "$(dirname "$0")/.." && rm -rf /tmp/repo23a && cp -r . /tmp/repo23a && cd /tmp/repo23a
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s23a; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads tpot128k,decode16,A --deadline 1500 \
  --repeat-baseline 1 --variant b32 '{"server_args": ["--block-size", "32"]}' \
  --backends "FLASH_ATTN,FLASHINFER@tpot128k/decode16,sparse_quest,sparse_twilight@tpot128k/decode16,sparse_twilight+b32@tpot128k/decode16" > $M/sb.log 2>&1
echo "serve rc=$?" >> $M/status
grep -h "Setting kv cache block size\|block_size=" $M/sb/server_sparse_quest*.log | head -5 > $M/quest_block_size.txt
grep -h "JIT\|jit" $M/sb/server_*.log | head -20 > $M/jit_lines.txt
echo done >> $M/status
