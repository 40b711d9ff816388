#!/usr/bin/env bash
# session 35: each seed's variant runs (eNNsK/gNN, sparse only) joined with the run of the same prompts that holds
# dense and the shipped configs (sessions 33-34), then the seeds pooled (python -m vllm_sparse.eval.pool) and every
# variant paired with its shipped base (benchmarks/eval_pair_variants.py). Run from the repository root.
set -euo pipefail
R=benchmarks/results; D=$R/eval_qwen_gpu_session35; J=/tmp/s35_joins; rm -rf $J; mkdir -p $J
join() { python -m vllm_sparse.eval.join "$J/$1" "$2" "${@:3}" --allow-dense-mismatch > /dev/null; }
join j15s0 $R/eval_qwen_gpu_session34/eval15_seed0 $D/e15s0/g0{0,1,2,3}
join j15s1 $R/eval_qwen_gpu_session34/eval15_seed1 $D/e15s1/g0{0,1,2,3}
join j15s2 $R/eval_qwen_gpu_session34/eval15_seed2 $D/e15s2/g0{0,1,2,3}
join j05s0 $R/eval_qwen0.5b_gpu_session33/joined $D/e05s0/g0{0,1}
join j05s1 $R/eval_qwen_gpu_session34/eval05_seed1 $D/e05s1/g0{0,1}
python -m vllm_sparse.eval.pool $D/pool15 $J/j15s0 $J/j15s1 $J/j15s2 > /dev/null
python -m vllm_sparse.eval.pool $D/pool05 $J/j05s0 $J/j05s1 > /dev/null
for m in 15 05; do
  python benchmarks/eval_pair_variants.py --base $D/pool$m --variant $D/pool$m --out $D/pool$m/variant_pairs.json
done
