#!/usr/bin/env bash
# session 36: the 1.5B at 8K over three seeds. Seed 0 is session 34's run (dense and every shipped method; its 8K
# prompts only, with session 35's variants) joined with this session's budget-floor variants on the same prompts;
# seeds 1 and 2 are this session's (dense, every method, the variants). Pooled (python -m vllm_sparse.eval.pool)
# and each variant paired with its base (benchmarks/eval_pair_variants.py). Run from the repository root.
set -euo pipefail
R=benchmarks/results; D=$R/eval_qwen_gpu_session36; J=/tmp/s36_joins; rm -rf $J; mkdir -p $J
# 8K rows of a run folder (samples.json and the contexts in summary.json)
only8k() {
  mkdir -p "$2" && python - "$1" "$2" <<'PY'
import json, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
rows = [r for r in json.loads((src / "samples.json").read_text()) if r["context"] == 8192]
summary = json.loads((src / "summary.json").read_text())
summary["config"]["contexts"] = [8192]
(dst / "samples.json").write_text(json.dumps(rows))
(dst / "summary.json").write_text(json.dumps(summary))
PY
}
# This session's eval recorded budgets without min_tokens where no variant set one (the eval's default changed while
# the runs were made); the engine ran the config's min_tokens, 1024 in configs/qwen2.5-coder-1.5b-instruct.yaml, as
# the earlier runs record it. Written out so that pool compares equal settings as equal.
min1024() {
  mkdir -p "$2" && cp "$1"/samples.json "$2"/ && python - "$1" "$2" <<'PY'
import json, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
summary = json.loads((src / "summary.json").read_text())
for sparse in [b["sparse"] for b in summary["config"]["backends"]] + [b["sparse_attention"] for b in summary["backends"]]:
    if sparse and "budget" in sparse:
        sparse["budget"].setdefault("min_tokens", 1024)
(dst / "summary.json").write_text(json.dumps(summary))
PY
}
only8k $R/eval_qwen_gpu_session34/eval15_seed0 $J/s34_seed0_8k
python -m vllm_sparse.eval.join $J/j0 $J/s34_seed0_8k $D/e15s0_8k/g00 $D/e15s0_8k/g01 > /dev/null
min1024 $D/e15s1_8k/joined $J/j1
min1024 $D/e15s2_8k/joined $J/j2
python -m vllm_sparse.eval.pool $D/pool8k $J/j0 $J/j1 $J/j2 > /dev/null
python benchmarks/eval_pair_variants.py --base $D/pool8k --variant $D/pool8k --out $D/pool8k/variant_pairs.json
