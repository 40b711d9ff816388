#!/usr/bin/env bash
# session-14 machine 1 (d), in the machine's last minutes: QuoKA's TTFT at 128K scoring with every query (w0) beside
# FLASH_ATTN; the w64 server that followed was cut off when the machine went back (not measured)
cd /tmp/repo14q2   # a copy of the working tree
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s14q; mkdir -p $M
python3 benchmarks/serve_bench.py run --out $M/serve --backends FLASH_ATTN,sparse_quoka+w0,sparse_quoka+w64 --loads tpot128k --repeat-baseline 1 \
  --variant w64 '{"chunk_query_window": 64}' --variant w0 '{"chunk_query_window": 0}' > $M/serve.out 2>&1; echo "serve rc=$?" >> $M/status
