#!/usr/bin/env bash
# session 40, third call set: the decode attention kernel under sustained load (no L2 flush, 400 replays of 28 layers
# back to back) with the SM clock and power logged: served, QuoKA's dense decode on the real 1.5B took 168 us a layer
# against FlashAttention's 129, while the flushed microbenchmark gives 137 against 136 with the same grid and registers
source /tmp/env.sh
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
S=/tmp/s40c; mkdir -p $S
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $S/smi.csv 2>&1 &
SMI=$!
B="python3 benchmarks/bench_decode_attention_tuning_gpu.py --selection first --chain 28 --flush none --reps 400 --page-size 16"
$B --heads 12:2 --cases 16:32768:1 --splits 16,17 --out $S/qwen15b_sustained.json > $S/qwen15b.log 2>&1
echo "qwen rc=$? $(date +%T.%N)" >> $S/status
$B --heads 32:8 --cases 16:16384:1 --splits 3 --out $S/llama8b_sustained.json > $S/llama8b.log 2>&1
echo "llama rc=$? $(date +%T.%N)" >> $S/status
kill $SMI; echo "done $(date +%T)" >> $S/status
