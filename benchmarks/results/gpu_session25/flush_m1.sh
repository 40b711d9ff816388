#!/usr/bin/env bash
# session-25 machine 1: does the L2 flush by a 512 MiB write (dirty lines the timed kernel writes back) inflate the
# per-layer decode numbers? One decode layer (Quest, Twilight) at pages of 32 and the attention alone, each with the
# L2 emptied by a write, by a read, and not at all.
cd "$(dirname "$0")/.." && rm -rf /tmp/repo25f && cp -r . /tmp/repo25f && cd /tmp/repo25f
source /tmp/env.sh
export PYTHONUNBUFFERED=1
O=/tmp/s25a/flush; mkdir -p $O
for f in write read none; do
  python3 benchmarks/step_breakdown_gpu.py --out $O/sbd_$f --prefill-chunks "" --methods quest \
    --decode 1:131072,16:16384 --profile --page-size 32 --flush $f > $O/sbd_$f.log 2>&1; echo "sbd_$f rc=$?" >> $O/status
  python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $O/attn_$f.json --page-size 32 --reps 20 --grid default \
    --flush $f --cases 1:131072:0.125,16:16384:0.125,1:16384:1 > $O/attn_$f.log 2>&1; echo "attn_$f rc=$?" >> $O/status
done
echo done >> $O/status
