#!/usr/bin/env bash
# session-25 machine 3, after the loads: the decode attention timed four ways (L2 emptied by a write, a read, or not;
# one call per graph replay or 16 chained in one graph) at pages of 32, and the decode top-k (chained and flushed).
cd "$(dirname "$0")/.." && rm -rf /tmp/repo25m && cp -r . /tmp/repo25m && cd /tmp/repo25m
source /tmp/env.sh
export PYTHONUNBUFFERED=1
O=/tmp/s25c/micro; mkdir -p $O
for f in read write; do
  python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $O/attn_${f}_chain1.json --page-size 32 --reps 20 --grid default \
    --flush $f --cases 1:131072:0.125,16:16384:0.125,1:16384:1 > $O/attn_${f}_chain1.log 2>&1; echo "attn_${f}_chain1 rc=$?" >> $O/status
done
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $O/attn_write_chain16.json --page-size 32 --reps 20 --grid default \
  --flush write --chain 16 --cases 1:131072:0.125,16:16384:0.125,1:16384:1 > $O/attn_write_chain16.log 2>&1; echo "attn_write_chain16 rc=$?" >> $O/status
python3 benchmarks/bench_topk_gpu.py --out $O/topk.json --cases 1:131072,16:16384 > $O/topk.log 2>&1; echo "topk rc=$?" >> $O/status
echo done >> $O/status
