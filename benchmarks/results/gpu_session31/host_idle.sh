#!/usr/bin/env bash
# session 31, machine 5 (one H100): issue 11's decode16 load unprofiled, then the same 16 x 16K decode with vLLM's
# torch profiler (prof16x16k), for FLASH_ATTN and sparse_quest (serve_bench's config: 12.5%, layer 0 dense, Quest's
# pages of 32), one server each, same machine: how much of each decode step the GPU spends idle (the median ITL minus
# the traced GPU time per step). Results under /tmp/s31e.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo31e && cp -r . /tmp/repo31e && cd /tmp/repo31e
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s31e; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb31e --port 8135 --loads decode16,prof16x16k \
  --deadline 1000 --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quest" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
python3 benchmarks/decode_trace.py $S/loads/profile_flash_attn $S/loads/profile_sparse_quest --top 30 \
  --json $S/decode_trace.json > $S/decode_trace.txt 2>&1
echo "trace rc=$?" >> $S/status
rm -rf $S/loads/profile_*
echo done >> $S/status
