#!/usr/bin/env bash
# session 40, second call set: the decode attention kernel at exact split counts (issue 11: QuoKA's dense decode on the
# real 1.5B served 168 us a layer against FlashAttention's 129, grid 32 rows x 17 splits = 544 programs, 128 registers)
source /tmp/env.sh
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
S=/tmp/s40b; mkdir -p $S; nvidia-smi > $S/nvidia_smi.txt
B="python3 benchmarks/bench_decode_attention_tuning_gpu.py --selection first --chain 16 --flush read --reps 20 --page-size 16"
$B --heads 12:2 --cases 16:32768:1,12:32768:1,4:32768:1 --splits 9,16,17,22,33,66 --out $S/qwen15b_splits.json > $S/qwen15b.log 2>&1
echo "qwen rc=$? $(date +%T)" >> $S/status
$B --heads 32:8 --cases 4:16384:1,1:131072:1,16:16384:0.125 --splits 2,3,16,17,66,67 --out $S/llama8b_splits.json > $S/llama8b.log 2>&1
echo "llama rc=$? $(date +%T)" >> $S/status
echo "done $(date +%T)" >> $S/status
