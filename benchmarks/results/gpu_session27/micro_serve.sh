#!/usr/bin/env bash
# session 27, machine 1: Quest's decode selection with the bounds scored inside the top-k (one launch) against the
# bounds kernel then the top-k (two launches), then issue 11's decode loads (TPOT after 130K, 16 x 16K decode) for
# FLASH_ATTN, sparse_quest and sparse_twilight (whose candidates come from the same Quest selection), one server each,
# same machine. Run as `bash benchmarks/results/gpu_session27/micro_serve.sh` after gpu_setup.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo27 && cp -r . /tmp/repo27 && cd /tmp/repo27
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s27/micro; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
python3 benchmarks/bench_quest_select_gpu.py --out $O/quest_select.json --page-size 32 --chain 8 --reps 30 \
  --cases 1:131072,2:65536,4:32768,16:16384,32:16384,64:4096 > $O/quest_select.log 2>&1; echo "select rc=$?" >> $O/status
echo done >> $O/status
S=/tmp/s27/serve; mkdir -p $S
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb27 --port 8127 --loads tpot128k,decode16 \
  --deadline 1000 --repeat-baseline 1 --backends "${1:-FLASH_ATTN,sparse_quest,sparse_twilight}" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
grep -h "Setting kv cache block size\|JIT compilation\|cudagraph_mode" $S/loads/server_*.log | head -30 > $S/jit_and_graphs.txt
echo done >> $S/status
