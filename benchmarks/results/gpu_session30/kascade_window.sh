#!/usr/bin/env bash
# session 30, one H100: the GPU tests stage of tests/gpu on this tree (Kascade's anchors honour an explicit
# chunk_query_window), then issue 13's 128K load for FLASH_ATTN and sparse_kascade with the shipped Llama-3.1-8B
# config at 10%, its anchors scoring each prefill chunk with the chunk's last 64 queries (variant k10w64), one server
# each, same machine; then the end-to-end stages of tests/gpu. Run as
# `bash benchmarks/results/gpu_session30/kascade_window.sh` after gpu_setup; results under /tmp/s30.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo30 && cp -r . /tmp/repo30 && cd /tmp/repo30
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s30; mkdir -p $S/tests
nvidia-smi > $S/nvidia_smi.txt
python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py --ignore=tests/gpu/test_tp_e2e_gpu.py \
  tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py \
  -p no:cacheprovider > $S/tests/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $S/status
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb30 --port 8130 --loads tpot128k \
  --deadline 900 --repeat-baseline 1 \
  --variant k10w64 '{"config": "/tmp/repo30/configs/llama-3.1-8b-instruct.yaml", "budget": {"fraction": 0.1}, "chunk_query_window": 64}' \
  --backends "FLASH_ATTN,sparse_kascade+k10w64" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
grep -h "JIT compilation\|cudagraph_mode" $S/loads/server_*.log | head -30 > $S/jit_and_graphs.txt
python3 benchmarks/e2e_gpu.py tiny --out $S/tests/e2e --parallel > $S/tests/e2e.out 2>&1
echo "e2e rc=$?" >> $S/status
VLLM_SPARSE_E2E_TINY_JSON=$S/tests/e2e/e2e_gpu_tiny.json python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py \
  -p no:cacheprovider > $S/tests/gpu_e2e_tests.log 2>&1
echo "e2e pytest rc=$?" >> $S/status
echo done >> $S/status
