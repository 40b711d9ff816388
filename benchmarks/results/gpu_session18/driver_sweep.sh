#!/usr/bin/env bash
# session-18, GPU 0 after the profiles: the decode attention kernel's launch settings on dense rows (every page:
# QuoKA's default decode, the break-even's dense rows) and on 1/8 rows, against FA3 over the same context.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo18s && cp -r . /tmp/repo18s && cd /tmp/repo18s
source /tmp/env.sh
M=/tmp/s18
while ! grep -q "gpu0 done" $M/status 2>/dev/null; do sleep 5; done
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $M/sweep/decode_tuning_dense.json \
  --grid wide --cases 1:131072:1.0,1:32768:1.0,4:16384:1.0,1:131072:0.125,16:16384:0.125 > $M/sweep.log 2>&1
echo "sweep rc=$?" >> $M/status
