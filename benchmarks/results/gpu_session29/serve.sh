#!/usr/bin/env bash
# session 29, first H100 (after tests.sh): issue 11's decode loads (one 130K prompt; 16 x 16K) for FLASH_ATTN, FLASHINFER, sparse_quest
# with its min/max planes in bf16 (the default) and with `quest.decode_planes: int8`, one server each, same machine.
# Run as `bash benchmarks/results/gpu_session29/serve.sh` after gpu_setup; results under /tmp/s29s.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo29s && cp -r . /tmp/repo29s && cd /tmp/repo29s
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s29s; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb29 --port 8129 --loads tpot128k,decode16 \
  --deadline 1500 --repeat-baseline 1 --variant int8 '{"quest": {"decode_planes": "int8"}}' \
  --backends "${1:-FLASH_ATTN,sparse_quest+int8,sparse_quest,FLASHINFER}" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
grep -h "Setting kv cache block size\|JIT compilation\|cudagraph_mode" $S/loads/server_*.log | head -30 > $S/jit_and_graphs.txt
echo done >> $S/status
