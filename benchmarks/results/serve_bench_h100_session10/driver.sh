#!/usr/bin/env bash
# session-10 machine-1: the decode writer on GPU (kernel + graph tests), then the serve bench of every
# backend on every load (window-64 default + one-launch decode write); logs under /tmp/m1
cd "$(dirname "$0")/.."
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/m1; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton_decode_write.py tests/gpu/test_decode_graph_gpu.py tests/gpu/test_quest_twilight_gpu.py tests/gpu/test_kernels_gpu.py > $M/write_tests.log 2>&1; echo "write tests rc=$?" >> $M/status
python3 benchmarks/serve_bench.py run --out $M/sb --repeat-baseline 1 --deadline 1150 \
  --backends "FLASH_ATTN,sparse_quest,sparse_twilight,sparse_quoka,sparse_quoka+sparse_decode@tpot128k/decode16/C,FLASHINFER" \
  > $M/sb.log 2>&1; echo "serve rc=$?" >> $M/status
echo done >> $M/status
