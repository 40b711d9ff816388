#!/usr/bin/env bash
# session-14 machine 1 (a): the whole tests/gpu folder on this tree (Kascade: anchor kernels unspecialised, one top-k per anchor)
cd "$(dirname "$0")/.." && rm -rf /tmp/repo14t && cp -r . /tmp/repo14t && cd /tmp/repo14t
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s14t; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
( time python3 benchmarks/e2e_gpu.py tiny --out $M/e2e --parallel ) > $M/e2e.out 2>&1; echo "e2e rc=$?" >> $M/status
VLLM_SPARSE_E2E_TINY_JSON=$M/e2e/e2e_gpu_tiny.json python3 -m pytest -q -rxX tests/gpu/test_vllm_e2e_gpu.py -p no:cacheprovider > $M/gpu_e2e_tests.log 2>&1; echo "e2e pytest rc=$?" >> $M/status
python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py -p no:cacheprovider > $M/gpu_tests.log 2>&1; echo "gpu tests rc=$?" >> $M/status
python3 -m pytest -q tests/test_decode_path.py -k kascade -p no:cacheprovider > $M/kascade_decode_path_cuda.log 2>&1; echo "kascade decode path (cuda) rc=$?" >> $M/status
echo done >> $M/status
