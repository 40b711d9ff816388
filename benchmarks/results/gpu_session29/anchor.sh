#!/usr/bin/env bash
# session 29, third H100: Kascade's prefill anchor scoring on one layer (8K chunk after 64K and 120K tokens), pass 2's
# sum over a tile's rows reduced across warps against a product with ones on the tensor cores, beside FlashAttention
# over the same chunk. Needs `anchor_row_sum/anchor_row_sum.diff` applied (`git apply`; the variant was measured slower and
# reverted). Run as `bash benchmarks/results/gpu_session29/anchor.sh` after gpu_setup; results under /tmp/s29a.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo29a && cp -r . /tmp/repo29a && cd /tmp/repo29a
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s29a; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
python3 benchmarks/bench_anchor_mass_gpu.py --out $O --reps 5 --contexts 65536,122880 \
  --settings 16:4:reduce,16:4:dot,64:4:dot,16:8:dot > $O/anchor.log 2>&1; echo "anchor rc=$?" >> $O/status
echo done >> $O/status
