#!/usr/bin/env bash
# session-25 machine 2 (one H100; machine 1 went back before its trace): the L2-flush probe, then a served 1 x 130K
# decode step traced (prof128k) for FLASH_ATTN and sparse_quest, then issue 18's loads A-C for sparse_twilight at its
# default pages of 32 beside FLASH_ATTN and FLASHINFER (as far as the device time goes).
cd "$(dirname "$0")/.." && rm -rf /tmp/repo25b && cp -r . /tmp/repo25b && cd /tmp/repo25b
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s25a; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash drv25/flush_m1.sh > $M/flush.out 2>&1; echo "flush rc=$?" >> $M/status
python3 benchmarks/serve_bench.py run --out $M/prof --workdir /tmp/sb0 --port 8123 --loads prof128k --deadline 600 \
  --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quest" > $M/prof.log 2>&1; echo "prof rc=$?" >> $M/status
python3 benchmarks/decode_trace.py $M/prof/profile_flash_attn $M/prof/profile_sparse_quest --top 40 \
  --json $M/prof/decode_trace.json > $M/prof/decode_trace.txt 2>&1; echo "trace rc=$?" >> $M/status
rm -rf $M/prof/profile_* 2>/dev/null
python3 benchmarks/serve_bench.py run --out $M/loads --workdir /tmp/sb0 --port 8124 --loads A,B,C --deadline 660 \
  --repeat-baseline 1 --backends "sparse_twilight,FLASH_ATTN,FLASHINFER" > $M/loads.log 2>&1; echo "loads rc=$?" >> $M/status
grep -h "Setting kv cache block size\|JIT compilation" $M/loads/server_*.log | head -20 > $M/loads_jit_and_block.txt
echo done >> $M/status
