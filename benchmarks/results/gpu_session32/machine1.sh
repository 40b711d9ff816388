#!/usr/bin/env bash
# session 32, machine 1 (one H100): the host-columns branch (decode columns looked up in tables made at start,
# numpy slicing in build(), persistent pinned staging). Issue 11's decode16 and tpot128k unprofiled, then the
# 16 x 16K decode traced (prof16x16k), for FLASH_ATTN and sparse_quest (serve_bench's config), one server each;
# decode_trace.py splits each step's idle into host gaps and in-graph launch gaps. Then the whole tests/gpu folder.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo32a && cp -r . /tmp/repo32a && cd /tmp/repo32a
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s32a; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt; lscpu > $S/lscpu.txt
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb32a --port 8135 \
  --loads decode16,tpot128k,prof16x16k --deadline 1200 --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quest" \
  > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
python3 benchmarks/decode_trace.py $S/loads/profile_flash_attn $S/loads/profile_sparse_quest --top 30 \
  --json $S/decode_trace.json > $S/decode_trace.txt 2>&1
echo "trace rc=$?" >> $S/status
rm -rf $S/loads/profile_*
bash benchmarks/gpu_tests.sh $S/tests > /dev/null 2>&1
echo "tests rc=$?" >> $S/status
echo done >> $S/status
