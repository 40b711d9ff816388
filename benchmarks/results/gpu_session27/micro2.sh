#!/usr/bin/env bash
# session 27, machine 3: the decode attention with exactly 1, 2 or 3 splits per row (1: the attention writes the
# output, no merge launch) at pages of 32, 16 calls chained per graph, L2 not flushed (what a layer pays inside
# vLLM's full graph). Run as `bash benchmarks/results/gpu_session27/micro2.sh` after gpu_setup.
# The tree it ran held a variant of vllm_sparse/kernels/decode_attention.py (not kept) in which one split writes the
# output and no merge kernel runs (see README.md here).
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo27m && cp -r . /tmp/repo27m && cd /tmp/repo27m
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
O=/tmp/s27/micro2; mkdir -p $O
nvidia-smi > $O/nvidia_smi.txt
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $O/attn_splits.json --page-size 32 --reps 20 \
  --grid splits --flush none --chain 16 --cases 16:16384:0.125,32:16384:0.125,8:16384:0.125 > $O/attn_splits.log 2>&1
echo "attn rc=$?" >> $O/status
python3 - <<'PY' >> $O/summary.txt
import json
d = json.load(open("/tmp/s27/micro2/attn_splits.json"))
for c in d["cases"]:
    print(c["batch"], c["context"], "default", round(c["default"]["ms"] * 1e3, 1), "us splits", c["default"]["splits"])
    for v in sorted((v for v in c["variants"] if "ms" in v), key=lambda v: v["ms"])[:8]:
        print("   ", v["block_n"], v["warps"], v["stages"], "splits", v["splits"], round(v["ms"] * 1e3, 1))
    fa = {k: round(v["ms"] * 1e3, 1) for k, v in c.items() if k.startswith("flash")}
    print("    FA3", fa)
PY
echo done >> $O/status
