#!/usr/bin/env bash
# session-25 machine 4 (one H100): issue 18's loads A-C for sparse_twilight at its default pages of 32 (no --block-size)
# beside FLASH_ATTN in the same run (machine 3 ran Twilight's loads, then went back during FLASH_ATTN's).
cd "$(dirname "$0")/.." && rm -rf /tmp/repo25d && cp -r . /tmp/repo25d && cd /tmp/repo25d
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s25d; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $M/loads --workdir /tmp/sb0 --port 8125 --loads A,B,C --deadline 640 \
  --repeat-baseline 1 --backends "FLASH_ATTN,sparse_twilight" > $M/loads.log 2>&1; echo "loads rc=$?" >> $M/status
grep -h "Setting kv cache block size\|JIT compilation" $M/loads/server_*.log | head -20 > $M/loads_jit_and_block.txt
echo done >> $M/status
