#!/usr/bin/env bash
# session-24 machine 1, after the evals: where Quest's and Twilight's decode layer goes at pages of 32 (Quest's GPU
# default) against 16, and the decode attention kernel's launch settings swept at pages of 32.
cd "$(dirname "$0")/.." && rm -rf /tmp/repo24k && cp -r . /tmp/repo24k && cd /tmp/repo24k
source /tmp/env.sh
export PYTHONUNBUFFERED=1
O=${1:-/tmp/s24k}; mkdir -p $O
for n in 32 16; do
  python3 benchmarks/step_breakdown_gpu.py --out $O/sbd$n --prefill-chunks "" --methods quest,twilight \
    --decode 1:131072,16:16384 --profile --page-size $n > $O/sbd$n.log 2>&1; echo "sbd$n rc=$?" >> $O/status
done
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $O/tune32.json --page-size 32 --reps 20 \
  --cases 1:131072:0.125,16:16384:0.125,16:16384:0.25 > $O/tune32.log 2>&1; echo "tune32 rc=$?" >> $O/status
echo done >> $O/status
