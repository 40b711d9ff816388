#!/usr/bin/env bash
# session-18 machine 3 (one H100), the final code (the split rule, Twilight's unpruned chunks at the budget):
# the decode kernel's launch sweep on this GPU kind (the rule was tuned on an H200), then the whole tests/gpu folder.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo18c && cp -r . /tmp/repo18c && cd /tmp/repo18c
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s18c; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $M/decode_tuning_h100.json --grid wide \
  --cases 1:131072:1.0,4:16384:1.0,8:16384:1.0,16:16384:0.125 > $M/sweep.log 2>&1; echo "sweep rc=$?" >> $M/status
python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py --ignore=tests/gpu/test_tp_e2e_gpu.py \
  tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py \
  -p no:cacheprovider > $M/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $M/status
python3 benchmarks/e2e_gpu.py tiny --out $M/e2e --parallel > $M/e2e.out 2>&1; echo "e2e rc=$?" >> $M/status
VLLM_SPARSE_E2E_TINY_JSON=$M/e2e/e2e_gpu_tiny.json python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py \
  -p no:cacheprovider > $M/gpu_e2e_tests.log 2>&1; echo "e2e pytest rc=$?" >> $M/status
echo done >> $M/status
