#!/usr/bin/env bash
# session 27, machine 4: one served decode step of 16 x 16K with sparse_quest, traced (vLLM's torch profiler over 24
# decode steps, `serve_bench.py --loads prof16x16k`), and where its time goes (`decode_trace.py`). FLASH_ATTN was not
# traced: too little device time was left. Run as `bash benchmarks/results/gpu_session27/prof.sh` after gpu_setup.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo27p && cp -r . /tmp/repo27p && cd /tmp/repo27p
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s27/prof; mkdir -p $O
python3 benchmarks/serve_bench.py run --out $O/run --workdir /tmp/sb27 --port 8127 --loads prof16x16k --deadline 400 \
  --backends sparse_quest > $O/serve.log 2>&1
echo "serve rc=$?" >> $O/status
python3 benchmarks/decode_trace.py $O/run/profile_sparse_quest --top 30 --json $O/decode_trace.json > $O/decode_trace.txt 2>&1
echo "trace rc=$?" >> $O/status
echo done >> $O/status
