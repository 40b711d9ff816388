#!/usr/bin/env bash
# session 31, machine 3 (one H100; machine 2 went back idle mid-run): Kascade's decode per layer, over all layers and
# as one graph of the 32 layers at pages of 16 and 32
# (bench_kascade_decode_gpu.py, issue 13's decode target), then issue 11/13's 128K and 16 x 16K loads for FLASH_ATTN
# and sparse_kascade at 10% with tile_stride 8, at vLLM's default pages of 16 (k10s8) and at pages of 32 (k10s8+p32,
# --block-size 32), one server each, same machine. Run as
# `bash benchmarks/results/gpu_session31/kascade_pages.sh` after gpu_setup; results under /tmp/s31b.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo31b && cp -r . /tmp/repo31b && cd /tmp/repo31b
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s31b; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
for P in 16 32; do
  python3 benchmarks/bench_kascade_decode_gpu.py --out $S/decode --page-size $P > $S/decode_pages$P.log 2>&1
  echo "decode pages $P rc=$?" >> $S/status
done
C=/tmp/repo31b/configs/llama-3.1-8b-instruct.yaml
python3 benchmarks/serve_bench.py run --out $S/loads --workdir /tmp/sb31b --port 8132 --loads tpot128k,decode16 \
  --deadline 1100 --repeat-baseline 1 \
  --variant k10s8 "{\"config\": \"$C\", \"budget\": {\"fraction\": 0.1}, \"kascade\": {\"tile_stride\": 8}}" \
  --variant p32 '{"server_args": ["--block-size", "32"]}' \
  --backends "FLASH_ATTN,sparse_kascade+k10s8+p32,sparse_kascade+k10s8" > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
grep -h "JIT compilation\|cudagraph_mode\|block size" $S/loads/server_*.log | head -30 > $S/jit_and_graphs.txt
echo done >> $S/status
