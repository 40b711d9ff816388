#!/usr/bin/env bash
# session 26: the decode top-k with its early stop against the previous one (541b81b's page_topk.py, copied beside
# this driver for the run with `git show 541b81b:vllm_sparse/kernels/page_topk.py > page_topk_541b81b.py`, not kept),
# and the decode attention with its splits merged by the row's last split (one launch; a variant of
# decode_attention_triton with merge="fused" and --merges in the tuning benchmark, measured slower and taken out
# again) against the second merge kernel, at pages of 32 (Quest's and Twilight's GPU pages), 16 calls chained per
# graph (what a layer pays inside vLLM's full graph). Run as `bash benchmarks/results/gpu_session26/micro.sh` after
# gpu_setup.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo26m && cp -r . /tmp/repo26m && cd /tmp/repo26m
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s26/micro; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
python3 benchmarks/bench_topk_gpu.py --out $O/topk.json --page-size 32 --chain 16 --reps 30 \
  --baseline benchmarks/results/gpu_session26/page_topk_541b81b.py --variants default \
  --cases 1:131072,2:65536,4:32768,16:16384,32:16384 > $O/topk.log 2>&1; echo "topk rc=$?" >> $O/status
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $O/attn.json --page-size 32 --reps 20 --grid default \
  --merges fused,kernel --flush none --chain 16 \
  --cases 1:131072:0.125,16:16384:0.125,16:16384:1,1:131072:1,4:32768:0.125 > $O/attn.log 2>&1; echo "attn rc=$?" >> $O/status
echo done >> $O/status
