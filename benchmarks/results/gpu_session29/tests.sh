#!/usr/bin/env bash
# session 29, first H100: the whole tests/gpu folder on this tree (INT8 codes of the min/max planes written by the
# engine and read by Quest's decode selection under `quest.decode_planes: int8`; the register top-k), then Quest's
# decode selection micro-benchmark (bf16 and INT8 planes, two launches and one). Run as
# `bash benchmarks/results/gpu_session29/tests.sh` after gpu_setup; results under /tmp/s29.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo29 && cp -r . /tmp/repo29 && cd /tmp/repo29
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/s29/tests /tmp/s29/micro
nvidia-smi > /tmp/s29/nvidia_smi.txt
bash benchmarks/gpu_tests.sh /tmp/s29/tests; echo "tests rc=$?" >> /tmp/s29/tests/status
echo done >> /tmp/s29/tests/status
O=/tmp/s29/micro
python3 benchmarks/bench_quest_select_gpu.py --out $O/quest_select.json --page-size 32 --chain 8 --reps 30 \
  --cases 16:16384,32:16384,1:131072 > $O/quest_select.log 2>&1; echo "select rc=$?" >> $O/status
echo done >> $O/status
