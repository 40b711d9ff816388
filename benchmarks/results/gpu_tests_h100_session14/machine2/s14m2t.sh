#!/usr/bin/env bash
# session-14 machine 2 (b): tests/gpu without the e2e file, and Kascade's decode-path and kernel tests on CUDA
cd "$(dirname "$0")/.." && rm -rf /tmp/repo14m2t && cp -r . /tmp/repo14m2t && cd /tmp/repo14m2t
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s14m2t; mkdir -p $M
python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py -p no:cacheprovider > $M/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $M/status
python3 -m pytest -q tests/test_decode_path.py -k kascade -p no:cacheprovider > $M/kascade_decode_path_cuda.log 2>&1; echo "kascade decode path (cuda) rc=$?" >> $M/status
echo done >> $M/status
