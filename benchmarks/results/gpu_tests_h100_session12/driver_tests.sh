#!/usr/bin/env bash
# session-12 machine 1, started right after the wheels are installed: the tests/gpu folder (its e2e file runs later)
cd "$(dirname "$0")/.."
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/m1; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
git rev-parse HEAD > $M/tree.txt 2>/dev/null
python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py -p no:cacheprovider > $M/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $M/status
