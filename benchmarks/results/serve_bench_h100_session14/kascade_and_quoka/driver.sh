#!/usr/bin/env bash
# session-14 machine 2: Kascade's anchor kernel sweep; serving (Kascade at 10%, QuoKA's new default window); then tests/gpu
cd "$(dirname "$0")/.." && rm -rf /tmp/repo14m2 && cp -r . /tmp/repo14m2 && cd /tmp/repo14m2
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s14m2; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/bench_anchor_mass_gpu.py --out $M/anchor --settings 1:4,4:4,16:4,64:4,16:8,64:8 > $M/anchor.log 2>&1; echo "anchor rc=$?" >> $M/status
CFG=$(pwd)/configs/llama-3.1-8b-instruct.yaml
( time python3 benchmarks/serve_bench.py run --out $M/serve --loads tpot128k,decode16,A,B --repeat-baseline 1 \
  --backends FLASH_ATTN,sparse_kascade+k10@tpot128k/decode16,sparse_quoka@A/B \
  --variant k10 "{\"config\": \"$CFG\", \"budget\": {\"fraction\": 0.1}}" ) > $M/serve.out 2>&1; echo "serve rc=$?" >> $M/status
( time python3 benchmarks/e2e_gpu.py tiny --out $M/e2e --parallel ) > $M/e2e.out 2>&1; echo "e2e rc=$?" >> $M/status
VLLM_SPARSE_E2E_TINY_JSON=$M/e2e/e2e_gpu_tiny.json python3 -m pytest -q tests/gpu/test_vllm_e2e_gpu.py -p no:cacheprovider > $M/gpu_e2e_tests.log 2>&1; echo "e2e pytest rc=$?" >> $M/status
echo done >> $M/status
