#!/usr/bin/env bash
# session-20 machine 1 (one H100): the whole tests/gpu folder on the final GPU code (the top-k counters in the
# decode step, Quest's decode bounds by request), then serving after 128K and 16 x 16K (`vllm serve` default mode +
# `vllm bench serve`, Llama-3.1-8B shapes, random weights, 12.5%, FLASH_ATTN in the same run).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo20a && cp -r . /tmp/repo20a && cd /tmp/repo20a
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s20a; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_tests.sh $M/tests > $M/tests.out 2>&1; echo "gpu tests rc=$?" >> $M/status
python3 benchmarks/serve_bench.py run --out $M/sb --workdir /tmp/sb0 --port 8123 --loads tpot128k,decode16 --deadline 900 \
  --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quest,sparse_twilight,sparse_quoka+sparse_decode" > $M/sb.log 2>&1
echo "serve rc=$?" >> $M/status
echo done >> $M/status
