#!/usr/bin/env bash
# session-18, one machine of two GPUs (issues 11/18: where dense decode rows lose time against FLASH_ATTN).
# GPU 0 (cores 0-15): `vllm serve` default mode, Llama-3.1-8B shapes, random weights, 12.5%: one 16K request with
#   vLLM's torch profiler over 24 decode steps (prof16k), then load C, for FLASH_ATTN, sparse_quoka, sparse_quest;
#   decode_trace.py splits each traced step into GPU busy / idle and kernels.
# GPU 1 (cores 16-31): per-layer decode at 1 x 128K and 1 x 16K (ours over every page against FA3, CUDA-graph
#   replays), then Twilight's serving with today's default (unpruned prefill) beside FLASH_ATTN: tpot128k, A, B.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo18 && cp -r . /tmp/repo18 && cd /tmp/repo18
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s18; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
(
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 python3 benchmarks/serve_bench.py run --out $M/prof --workdir /tmp/sb0 --port 8123 --loads prof16k,C \
    --repeat-baseline 1 --backends "FLASH_ATTN,sparse_quoka,sparse_quest" > $M/prof.log 2>&1; echo "prof rc=$?" >> $M/status
  python3 benchmarks/decode_trace.py $M/prof/profile_flash_attn $M/prof/profile_sparse_quoka $M/prof/profile_sparse_quest \
    --json $M/prof/decode_trace.json > $M/decode_trace.txt 2>&1; echo "trace rc=$?" >> $M/status
  echo "gpu0 done" >> $M/status
) &
(
  export CUDA_VISIBLE_DEVICES=1
  taskset -c 16-31 python3 benchmarks/step_breakdown_gpu.py --out $M/sbd --prefill-chunks "" --methods quoka,quest \
    --decode 1:131072,1:16384 > $M/step_breakdown.log 2>&1; echo "breakdown rc=$?" >> $M/status
  taskset -c 16-31 python3 benchmarks/serve_bench.py run --out $M/tw --workdir /tmp/sb1 --port 8124 --loads tpot128k,A,B \
    --repeat-baseline 1 --backends "FLASH_ATTN,sparse_twilight" > $M/tw.log 2>&1; echo "twilight rc=$?" >> $M/status
  echo "gpu1 done" >> $M/status
) &
wait
echo done >> $M/status
