"""Twilight variants on the multi-key needle at 16K, on CPU, beside dense in the same run.

At 25% (candidates 50% of the context, top-p 0.95, prefill estimates from the last 64 queries) Twilight
found 1 of 2 multi-key needles where dense and Quest found both (eval_qwen0.5b_cpu_16k_budget025). This
runs top-p 0.99, and top-p 0.95 with every chunk query, to tell which setting loses it.

    python benchmarks/twilight_variants_cpu.py OUT_DIR
"""

import sys

from vllm_sparse.eval.runner import Backend, EvalConfig, run_eval

if __name__ == "__main__":
    base = {"dense_below_tokens": 1024, "budget": {"fraction": 0.25, "min_tokens": 1024}}
    backends = [
        Backend("CPU_ATTN", "CPU_ATTN"),
        Backend("twilight_p0.99", "sparse_twilight", {**base, "twilight": {"candidate_fraction": 0.5, "top_p": 0.99}}),
        Backend(
            "twilight_p0.95_allq",
            "sparse_twilight",
            {**base, "chunk_query_window": 0, "twilight": {"candidate_fraction": 0.5}},
        ),
    ]
    cfg = EvalConfig(
        model="qwen2.5-coder-0.5b-instruct",
        tasks=("niah_multikey",),
        contexts=(16384,),
        samples=2,
        depths=(0.1, 0.5, 0.9),
        backends=backends,
        block_size=32,
        max_num_batched_tokens=2048,
        out_dir=sys.argv[1],
        progress=False,
        command="python benchmarks/twilight_variants_cpu.py " + sys.argv[1],
    )
    run_eval(cfg)
