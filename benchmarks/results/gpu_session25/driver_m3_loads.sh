#!/usr/bin/env bash
# session-25 machine 3 (one H100), written on the machine as /tmp/drv_loads.sh and run as `bash /tmp/drv_loads.sh REPO`:
# issue 18's loads A-C for sparse_twilight, then FLASH_ATTN and FLASHINFER. The machine was handed back during FLASH_ATTN's
# loads (by its polling helper, early), so only Twilight's results came back (../serve_bench_h100_session25/machine3_twilight_only/).
cd /tmp && rm -rf /tmp/repo25c && cp -r $1 /tmp/repo25c && cd /tmp/repo25c
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s25c; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $M/loads --workdir /tmp/sb0 --port 8124 --loads A,B,C --deadline 1000 \
  --repeat-baseline 1 --backends "sparse_twilight,FLASH_ATTN,FLASHINFER" > $M/loads.log 2>&1; echo "loads rc=$?" >> $M/status
grep -h "Setting kv cache block size\|JIT compilation" $M/loads/server_*.log | head -20 > $M/loads_jit_and_block.txt
echo done >> $M/status
