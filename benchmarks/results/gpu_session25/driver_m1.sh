#!/usr/bin/env bash
# session-25 machine 1 (one H100): (a) the decode attention kernel with and without prefetched page ids, at pages of
# 32, scattered and consecutive selections; (b) a served 1 x 130K decode step traced (prof128k) for FLASH_ATTN and
# sparse_quest; (c) issue 18's loads A-C for sparse_twilight at its default pages of 32 beside FLASH_ATTN and FLASHINFER.
cd "$(dirname "$0")/.." && rm -rf /tmp/repo25a && cp -r . /tmp/repo25a && cd /tmp/repo25a
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s25a; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $M/kern/prefetch32.json --page-size 32 --reps 20 --grid prefetch \
  --cases 1:131072:0.125,16:16384:0.125,16:16384:0.25 > $M/kern_prefetch32.log 2>&1; echo "prefetch32 rc=$?" >> $M/status
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $M/kern/first32.json --page-size 32 --reps 20 --grid prefetch \
  --selection first --cases 1:131072:0.125,16:16384:0.125 > $M/kern_first32.log 2>&1; echo "first32 rc=$?" >> $M/status
touch $M/kern_done
python3 benchmarks/serve_bench.py run --out $M/prof --workdir /tmp/sb0 --port 8123 --loads prof128k --deadline 700 \
  --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quest" > $M/prof.log 2>&1; echo "prof rc=$?" >> $M/status
python3 benchmarks/decode_trace.py $M/prof/profile_flash_attn $M/prof/profile_sparse_quest --top 30 \
  --json $M/prof/decode_trace.json > $M/prof/decode_trace.txt 2>&1; echo "trace rc=$?" >> $M/status
rm -rf $M/prof/profile_* 2>/dev/null
touch $M/prof_done
python3 benchmarks/serve_bench.py run --out $M/loads --workdir /tmp/sb0 --port 8124 --loads A,B,C --deadline 900 \
  --repeat-baseline 2 --backends "FLASH_ATTN,sparse_twilight,FLASHINFER" > $M/loads.log 2>&1; echo "loads rc=$?" >> $M/status
grep -h "Setting kv cache block size\|JIT compilation" $M/loads/server_*.log | head -20 > $M/loads_jit_and_block.txt
echo done >> $M/status
