#!/usr/bin/env bash
# session 32, machine 2 (one H100): programmatic dependent launch (PDL) of the decode chain kernels (K/V write,
# selection, attention, merge; kernels/pdl.py). Issue 11's decode16 and tpot128k for FLASH_ATTN, sparse_quest (PDL on,
# the default) and sparse_quest+nopdl (VLLM_SPARSE_PDL=0), one server each, same machine; then the whole tests/gpu folder.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo32b && cp -r . /tmp/repo32b && cd /tmp/repo32b
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s32b; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb32b --port 8136 --loads decode16,tpot128k \
  --deadline 1300 --repeat-baseline 1 --variant nopdl '{"env": {"VLLM_SPARSE_PDL": "0"}}' \
  --backends "FLASH_ATTN,sparse_quest,sparse_quest+nopdl" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
bash benchmarks/gpu_tests.sh $S/tests > /dev/null 2>&1
echo "tests rc=$?" >> $S/status
echo done >> $S/status
