#!/usr/bin/env bash
# Accuracy of dense vs the sparse methods on this CPU machine (issue 5), Qwen2.5-Coder-0.5B-Instruct.
# Environment: CONTEXTS, SAMPLES, TASKS, METHODS (quoka quest twilight), BUDGETS, NAME.
# Every run writes samples.json, summary.json (machine, command, timings), report.md and PNG plots into
# benchmarks/results/eval_<name>/.
#
# dense_below_tokens is lowered to 1024 (the shipped config says 4096): otherwise a 4K prompt, chunked
# at 2048 tokens, would run fully dense and the 4K column would measure nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_NUM_OF_RESERVED_CPU=0
CONTEXTS=${CONTEXTS:-"4096 8192"}
SAMPLES=${SAMPLES:-2}
NAME=${NAME:-qwen0.5b_cpu}
TASKS=${TASKS:-"niah_single niah_multikey niah_multivalue niah_multiquery passkey vt cwe"}
METHODS=${METHODS:-"quoka"}
BUDGETS=${BUDGETS:-"0.125 0.25"}
python -m vllm_sparse.cli eval --model qwen2.5-coder-0.5b-instruct \
  --tasks $TASKS --contexts $CONTEXTS --samples "$SAMPLES" --depths 0.1 0.3 0.5 0.7 0.9 \
  --methods $METHODS --budgets $BUDGETS --min-tokens 1024 --sparse-config '{"dense_below_tokens": 1024}' \
  --dtype bfloat16 --block-size 32 --max-num-batched-tokens 2048 --kv-cache-gib 2 \
  --out "benchmarks/results/eval_${NAME}"
