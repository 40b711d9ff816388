#!/usr/bin/env bash
# session 28, second H100: Quest's decode selection over INT8 codes of the min/max planes (half the bytes, a scale per
# (page, KV head); `metadata/minmax_int8.py`) against today's bf16 planes, two launches and one, then the whole
# tests/gpu folder on this code. Run as `bash benchmarks/results/gpu_session28/int8.sh` after gpu_setup; results under
# /tmp/s28b.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo28b && cp -r . /tmp/repo28b && cd /tmp/repo28b
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s28b/micro; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
python3 benchmarks/bench_quest_select_gpu.py --out $O/quest_select_int8.json --page-size 32 --chain 8 --reps 30 \
  --cases 1:131072,16:16384,32:16384,64:4096 > $O/quest_select_int8.log 2>&1; echo "select rc=$?" >> $O/status
echo done >> $O/status
bash benchmarks/gpu_tests.sh /tmp/s28b/tests; echo "tests rc=$?" >> /tmp/s28b/tests/status
echo done >> /tmp/s28b/tests/status
