#!/usr/bin/env bash
# session 30, the decode attention with its merge done by each row's last program, against the merge launch
# (after a fix of the first run's compile error in the shared merge helper). Results under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .microwheels/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/pydeps:$PWD PYTHONUNBUFFERED=1
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $OUT/attn_merge.json --grid default --page-size 32 \
  --chain 16 --reps 30 > $OUT/attn_merge.log 2>&1; echo "attn rc=$?" >> $OUT/status
