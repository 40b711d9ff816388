"""Session 16: Quest's exact prefill against its bounds on CPU, the outside needle test's setting (2048-token chunks)."""
import shlex
import sys
from pathlib import Path

import yaml

from vllm_sparse.eval.runner import Backend, EvalConfig, run_eval

if __name__ == "__main__":
    shipped = Path("/work/main/configs/qwen2.5-coder-0.5b-instruct.yaml")
    base = {"config": str(shipped), "budget": yaml.safe_load(shipped.read_text())["budget"]}
    chosen = [
        Backend("CPU_ATTN", "CPU_ATTN"),
        Backend("quest_exact", "sparse_quest", base),
        Backend("quest_bounds", "sparse_quest", {**base, "quest": {"prefill_scores": "bounds"}}),
    ]
    config = EvalConfig(
        model="qwen2.5-coder-0.5b-instruct", tasks=("niah_single", "niah_multikey"), contexts=(8192, 16384), samples=4,
        depths=(0.1, 0.5, 0.9), backends=chosen, block_size=32, max_num_batched_tokens=2048, out_dir=sys.argv[1],
        progress=False, command="python " + " ".join(shlex.quote(a) for a in sys.argv),
    )
    config.sparse_only = False
    run_eval(config)
