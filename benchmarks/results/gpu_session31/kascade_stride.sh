#!/usr/bin/env bash
# session 31, one H100: the GPU tests stage of tests/gpu on this tree (Kascade's anchors take kascade.tile_stride),
# the anchor scoring micro-benchmark at tile strides 1, 4, 8 and 16, then issue 13's 128K load for FLASH_ATTN and
# sparse_kascade with the shipped Llama-3.1-8B config at 10% with tile_stride 8 (k10s8) and 4 (k10s4), one server
# each, same machine; then the end-to-end stages of tests/gpu. Run as
# `bash benchmarks/results/gpu_session31/kascade_stride.sh` after gpu_setup; results under /tmp/s31.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo31 && cp -r . /tmp/repo31 && cd /tmp/repo31
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s31; mkdir -p $S/tests
nvidia-smi > $S/nvidia_smi.txt
python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_vllm_e2e_gpu.py --ignore=tests/gpu/test_tp_e2e_gpu.py \
  tests/test_kernels_triton_compact.py tests/test_kernels_triton_decode_write.py tests/test_kernels_triton_kascade.py \
  -p no:cacheprovider > $S/tests/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $S/status
python3 benchmarks/bench_anchor_mass_gpu.py --out $S/anchor --contexts 65536,122880 --settings 16:4 \
  --strides 1,4,8,16 --reps 5 > $S/anchor.log 2>&1
echo "anchor rc=$?" >> $S/status
C=/tmp/repo31/configs/llama-3.1-8b-instruct.yaml
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb31 --port 8131 --loads tpot128k \
  --deadline 1000 --repeat-baseline 1 \
  --variant k10s8 "{\"config\": \"$C\", \"budget\": {\"fraction\": 0.1}, \"kascade\": {\"tile_stride\": 8}}" \
  --variant k10s4 "{\"config\": \"$C\", \"budget\": {\"fraction\": 0.1}, \"kascade\": {\"tile_stride\": 4}}" \
  --backends "FLASH_ATTN,sparse_kascade+k10s8,sparse_kascade+k10s4" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
grep -h "JIT compilation\|cudagraph_mode" $S/loads/server_*.log | head -30 > $S/jit_and_graphs.txt
python3 benchmarks/e2e_gpu.py tiny --out $S/tests/e2e --parallel > $S/tests/e2e.out 2>&1
echo "e2e rc=$?" >> $S/status
VLLM_SPARSE_E2E_TINY_JSON=$S/tests/e2e/e2e_gpu_tiny.json python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py \
  -p no:cacheprovider > $S/tests/gpu_e2e_tests.log 2>&1
echo "e2e pytest rc=$?" >> $S/status
echo done >> $S/status
