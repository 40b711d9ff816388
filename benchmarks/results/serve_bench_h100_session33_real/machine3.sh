#!/usr/bin/env bash
# session 33, machine 3 (one H100): issue 14's missing measurement, compact's speed on real weights. Qwen2.5-Coder-1.5B-
# Instruct (GGUF carried in pieces to /tmp/gg15), its shipped config, vllm serve in the default mode (torch.compile +
# CUDA graphs), prefix caching off, chunks of 8192: the eval's prompts of 32K tokens (serve_bench.py's real32k: 9
# prompts, niah_multikey / vt / code, one at a time, 16 new tokens) for FLASH_ATTN, FLASHINFER, sparse_compact and
# sparse_quoka, one server each, same machine.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo33c && cp -r . /tmp/repo33c && cd /tmp/repo33c
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
S=/tmp/s33c; mkdir -p $S
nvidia-smi > $S/nvidia_smi.txt
bash benchmarks/gpu_stage_model.sh qwen2.5-coder-1.5b-instruct /tmp/gg15 > $S/stage_model15.log 2>&1
echo "stage rc=$?" >> $S/status
C15=$(pwd)/configs/qwen2.5-coder-1.5b-instruct.yaml
python3 benchmarks/serve_bench.py run --out $S/real15 --workdir /tmp/sb33c --port 8138 \
  --real-model qwen2.5-coder-1.5b-instruct --loads real32k --repeat-baseline 1 --deadline 1500 \
  --sparse-config "{\"config\": \"$C15\"}" --backends "FLASH_ATTN,sparse_compact,sparse_quoka,FLASHINFER" \
  > $S/serve.log 2>&1
echo "serve rc=$?" >> $S/status
echo done >> $S/status
