#!/usr/bin/env bash
# session 33, machine 1 (one H100): the decode chain's launches (issue 11).
# 1. bench_decode_chain_gpu.py: the 32-layer decode chain in one CUDA graph per variant (write inside Quest's
#    selection launch, split merge inside the attention launch, rows of <= 512 pages ranked by counting, PDL modes);
# 2. the decode kernels' GPU tests (graph replay against eager, compiled Triton against the twins);
# 3. issue 11's decode16 and tpot128k served for FLASH_ATTN, sparse_quest+new (the chain bench's fastest 16 x 16K
#    variant without PDL, by env) and sparse_quest+old (every new launch change off), one server each.
cd "$(dirname "$0")/../.." && rm -rf /tmp/repo33 && cp -r . /tmp/repo33 && cd /tmp/repo33
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s33; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
python3 benchmarks/bench_decode_chain_gpu.py --out $S/chain --decode 16:16384,1:131072 > $S/chain.log 2>&1
echo "chain rc=$?" >> $S/status
python3 -m pytest -q tests/gpu/test_decode_graph_gpu.py tests/test_decode_path.py \
  tests/test_kernels_triton_decode_write.py -p no:cacheprovider > $S/quick_tests.log 2>&1
echo "quick tests rc=$?" >> $S/status
NEW=$(python3 - <<'PY'
import json
env = {"VLLM_SPARSE_FUSED_WRITE": "1", "VLLM_SPARSE_FUSED_MERGE": "1", "VLLM_SPARSE_RANK_PAGES": "512"}
try:
    doc = json.load(open("/tmp/s33/chain/decode_chain_quest_pages32.json"))
    case = next(r for r in doc["results"] if r["batch"] == 16)
    name, v = min(((n, v) for n, v in case["variants"].items() if v["pdl"] == "0"), key=lambda nv: nv[1]["ms"])
    env = {"VLLM_SPARSE_FUSED_WRITE": str(int(v["fused_write"])), "VLLM_SPARSE_FUSED_MERGE": str(int(v["fused_merge"])),
           "VLLM_SPARSE_RANK_PAGES": str(v["rank_pages"])}
except Exception as e:  # the chain bench failed: serve every change on
    print("no chain result:", e, file=open("/tmp/s33/pick.txt", "w"))
print(json.dumps({"env": env}))
PY
)
echo "new=$NEW" >> $S/status
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb33 --port 8137 --loads decode16,tpot128k \
  --deadline 1000 --repeat-baseline 1 --variant new "$NEW" \
  --variant old '{"env": {"VLLM_SPARSE_FUSED_WRITE": "0", "VLLM_SPARSE_FUSED_MERGE": "0", "VLLM_SPARSE_RANK_PAGES": "0"}}' \
  --backends "FLASH_ATTN,sparse_quest+new,sparse_quest+old" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
echo done >> $S/status
