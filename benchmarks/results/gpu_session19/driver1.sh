#!/usr/bin/env bash
# session-19 machine 1: the one-launch split top-k, tested and timed; where a decode layer's selection goes (profile).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo19 && cp -r . /tmp/repo19 && cd /tmp/repo19
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s19; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
timeout 300 python3 -m pytest -q tests/gpu/test_page_topk_gpu.py -p no:cacheprovider > $M/topk_tests.log 2>&1; echo "topk tests rc=$?" >> $M/status
timeout 300 python3 benchmarks/bench_topk_gpu.py --out $M/topk.json > $M/topk.log 2>&1; echo "topk bench rc=$?" >> $M/status
timeout 500 python3 benchmarks/step_breakdown_gpu.py --out $M/sbd --prefill-chunks "" --methods quest,twilight \
  --decode 16:16384,1:131072 --profile > $M/sbd.log 2>&1; echo "sbd rc=$?" >> $M/status
echo done >> $M/status
