#!/usr/bin/env bash
# session 30, first H100 (no vLLM staged: torch + Triton of the host, pyyaml and pydantic carried as wheels):
# Quest's decode selection with the bounds scored request-major (kernels.quest_request_bounds), the few-long-rows
# top-k in one program a row (16 warps, registers), and the decode attention with its merge done by each row's last
# program. Results under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .microwheels/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/pydeps:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
python3 benchmarks/bench_quest_select_gpu.py --out $OUT/quest_select.json --page-size 32 --chain 8 --reps 30 \
  --cases 16:16384,32:16384,1:131072 > $OUT/quest_select.log 2>&1; echo "select rc=$?" >> $OUT/status
python3 benchmarks/bench_decode_attention_tuning_gpu.py --out $OUT/attn_merge.json --grid default --page-size 32 \
  --chain 16 --reps 30 > $OUT/attn_merge.log 2>&1; echo "attn rc=$?" >> $OUT/status
