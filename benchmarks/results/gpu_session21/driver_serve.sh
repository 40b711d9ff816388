#!/usr/bin/env bash
# session-21 machine 2 (one H100; machine 1 ran the whole tests/gpu folder after its eval, driver_tests.sh): issue 18's loads A, B and C for every backend with shipped defaults
# (`vllm serve` default mode + `vllm bench serve`, Llama-3.1-8B shapes, random weights, 12.5%, FLASH_ATTN twice,
# FLASHINFER last, all in the same run on the same GPU).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo21s && cp -r . /tmp/repo21s && cd /tmp/repo21s
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s21s; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads A,B,C --deadline 1200 \
  --repeat-baseline 2 --backends "FLASH_ATTN,sparse_quest,sparse_quoka,sparse_twilight,FLASHINFER" > $M/sb.log 2>&1
echo "serve rc=$?" >> $M/status
python3 benchmarks/serve_targets.py --out $M/sb/targets.json --run $M/sb/serve_bench.json > $M/targets.log 2>&1
echo done >> $M/status
