#!/usr/bin/env bash
# session 28, one H100 (stopped after the micro-benchmark; see README.md): Quest's decode selection with the bounds scored by several programs per row (the last to finish
# ranks the row) against one program a row and the two launches; the whole tests/gpu folder on that code; then issue
# 11's 16 x 16K decode load for FLASH_ATTN, FLASHINFER, sparse_quest and sparse_twilight (whose candidates come from
# the same Quest selection), one server each, same machine. Run as `bash benchmarks/results/gpu_session28/all.sh`
# after gpu_setup; results under /tmp/s28.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo28 && cp -r . /tmp/repo28 && cd /tmp/repo28
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s28/micro; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
python3 benchmarks/bench_quest_select_gpu.py --out $O/quest_select.json --page-size 32 --chain 8 --reps 30 \
  --cases 1:131072,16:16384,32:16384,64:4096 > $O/quest_select.log 2>&1; echo "select rc=$?" >> $O/status
echo done >> $O/status
bash benchmarks/gpu_tests.sh /tmp/s28/tests; echo "tests rc=$?" >> /tmp/s28/tests/status
echo done >> /tmp/s28/tests/status
S=/tmp/s28/serve; mkdir -p $S
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb28 --port 8128 --loads decode16 \
  --deadline 900 --repeat-baseline 1 --backends "${1:-FLASH_ATTN,FLASHINFER,sparse_quest,sparse_twilight}" \
  > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
grep -h "Setting kv cache block size\|JIT compilation\|cudagraph_mode" $S/loads/server_*.log | head -30 > $S/jit_and_graphs.txt
echo done >> $S/status
