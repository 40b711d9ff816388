#!/usr/bin/env bash
# session 28, third H100: the one-program-a-row top-k with a row of one tile searched in registers
# (`_select_in_registers`, `topk_registers/topk_registers.diff`) against the same code without it, same machine,
# then the whole tests/gpu folder on the new code. (As run, the base was a copy of page_topk.py kept next to this
# script; it is the repository's file, so the script now applies the diff for "new" instead.) Run as `bash benchmarks/results/gpu_session28/topk_registers.sh` after gpu_setup;
# results under /tmp/s28c.
cd "$(dirname "$0")/../../.." && R=$(pwd)
source /tmp/env.sh
export PYTHONUNBUFFERED=1
O=/tmp/s28c/micro; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
for v in base new; do
  rm -rf /tmp/repo28$v && cp -r $R /tmp/repo28$v && cd /tmp/repo28$v
  [ $v = new ] && patch -s -p1 < benchmarks/results/gpu_session28/topk_registers/topk_registers.diff
  python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
  python3 benchmarks/bench_quest_select_gpu.py --out $O/quest_select_$v.json --page-size 32 --chain 8 --reps 20 \
    --cases 16:16384,32:16384 > $O/quest_select_$v.log 2>&1; echo "select $v rc=$?" >> $O/status
done
echo done >> $O/status
cd /tmp/repo28new && bash benchmarks/gpu_tests.sh /tmp/s28c/tests; echo "tests rc=$?" >> /tmp/s28c/tests/status
echo done >> /tmp/s28c/tests/status
