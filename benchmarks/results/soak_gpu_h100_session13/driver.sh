#!/usr/bin/env bash
# The session-13 GPU driver (after the wheels were installed, benchmarks/gpu_setup.sh): the soak's two phases,
# then the e2e tiny run and its tests (benchmarks/results/gpu_tests_h100_session13/).
COMMON="--model tiny-gpu --dtype float16 --max-model-len 8192 --block-size 16 --max-num-batched-tokens 1000 --max-num-seqs 16 --concurrency 16 --kv-cache-bytes 67108864 --requests 500 --max-new 32 --request-timeout 600 --gpu-memory-utilization 0.1"
B=sparse_quoka,sparse_quest,sparse_twilight,sparse_kascade,sparse_compact
python3 benchmarks/soak.py equal $COMMON --dense-backend FLASH_ATTN --second-dense FLASHINFER --backends $B --parallel 7 --log-dir $M/eq_logs --out $M/soak_equal.json
python3 benchmarks/soak.py run $COMMON --no-enforce-eager --budget real --sparse-prefill --backend $B --parallel 5 --log-dir $M/real_logs --out $M/soak_real.json
python3 benchmarks/e2e_gpu.py tiny --out $M/e2e --parallel
VLLM_SPARSE_E2E_TINY_JSON=$M/e2e/e2e_gpu_tiny.json python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py
python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py
