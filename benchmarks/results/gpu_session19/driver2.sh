#!/usr/bin/env bash
# session-19 machine 2 (one H100): serving after the one-launch top-k and the wider Twilight estimate tiles
# (`vllm serve` default mode + `vllm bench serve`, Llama-3.1-8B shapes, random weights, 12.5%, FLASH_ATTN in the
# same run), then the whole tests/gpu folder on the same code.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo19b && cp -r . /tmp/repo19b && cd /tmp/repo19b
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s19b; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads tpot128k,decode16 --deadline 1100 \
  --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quest,sparse_twilight,sparse_quoka+sparse_decode@decode16" > $M/sb.log 2>&1
echo "serve rc=$?" >> $M/status
bash benchmarks/gpu_tests.sh $M/tests > $M/tests.out 2>&1; echo "gpu tests rc=$?" >> $M/status
echo done >> $M/status
