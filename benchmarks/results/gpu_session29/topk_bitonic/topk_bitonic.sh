#!/usr/bin/env bash
# session 29, fourth H100: the decode top-k with rows of one tile ranked by a bitonic sort of packed 64-bit keys
# (`page_topk.py` patched with `page_topk_bitonic.diff` into /tmp, loaded by bench_topk_gpu.py's --baseline and timed
# beside today's register radix select in the same process). Run as `bash benchmarks/results/gpu_session29/topk_bitonic/topk_bitonic.sh` after gpu_setup;
# results under /tmp/s29b.
cd "$(dirname "$0")/../../../.." && rm -rf /tmp/repo29b && cp -r . /tmp/repo29b && cd /tmp/repo29b
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s29b; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
cp vllm_sparse/kernels/page_topk.py /tmp/page_topk_bitonic.py
patch -s /tmp/page_topk_bitonic.py < benchmarks/results/gpu_session29/topk_bitonic/page_topk_bitonic.diff
python3 benchmarks/bench_topk_gpu.py --out $O/topk_bitonic.json --page-size 32 --chain 16 --reps 30 \
  --baseline /tmp/page_topk_bitonic.py --variants default \
  --cases 16:16384,32:16384,64:4096,4:32768 > $O/topk_bitonic.log 2>&1; echo "topk rc=$?" >> $O/status
echo done >> $O/status
