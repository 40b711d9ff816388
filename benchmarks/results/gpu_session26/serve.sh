#!/usr/bin/env bash
# session 26: issue 11's decode loads (TPOT after 130K, 16 x 16K decode) for FLASH_ATTN and the sparse backends whose
# decode path changed (top-k early stop, splits merged in the attention launch), one server each, same machine.
# Run as `bash benchmarks/results/gpu_session26/serve.sh BACKENDS` after gpu_setup.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo26s && cp -r . /tmp/repo26s && cd /tmp/repo26s
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s26/serve; mkdir -p $O
python3 benchmarks/serve_bench.py run --out $O/loads --workdir /tmp/sb26 --port 8126 --loads tpot128k,decode16 \
  --deadline 1500 --repeat-baseline 1 --backends "${1:-FLASH_ATTN,sparse_quest}" > $O/serve.log 2>&1; echo "serve rc=$?" >> $O/status
grep -h "Setting kv cache block size\|JIT compilation\|cudagraph_mode" $O/loads/server_*.log | head -30 > $O/jit_and_graphs.txt
echo done >> $O/status
