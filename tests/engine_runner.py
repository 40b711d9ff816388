"""Runs vLLM engines described by a JSON spec, one after another in this process; writes JSON results.

    python tests/engine_runner.py SPEC.json OUT.json

SPEC: {"model": PATH, "runs": [RUN, ...]} with RUN keys:
    name, backend, additional_config (optional), speculative_config (optional), dtype ("float32"), block_size (32),
    max_num_batched_tokens (100), max_tokens (64), batches ([[token ids, ...], ...]: each inner
    list of prompts is one generate() call, so later batches can hit the prefix cache), logprobs (0:
    none; K: the top K logprobs of every generated position, to tell near-ties from errors).
OUT: {name: {"ok": bool, "error": str, "tokens": [[...] per prompt, per batch], "cached": [[prompt
    tokens read from the prefix cache, per prompt] per batch], "stats": {...}, and with logprobs
    "top_logprobs": [[[{token id (str): logprob} per position] per prompt] per batch]}}
Engine start failures are caught, so one spec can check several bad configs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def run_one(model: str, run: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_sparse.stats import read_stats

    stats_path = os.path.join(tempfile.mkdtemp(), "stats.json")
    os.environ["SPARSE_ATTENTION_STATS"] = stats_path
    try:
        llm = LLM(
            model=model,
            attention_backend=run["backend"],
            additional_config=run.get("additional_config") or {},
            dtype=run.get("dtype", "float32"),
            block_size=run.get("block_size", 32),
            max_model_len=run.get("max_model_len", 4096),
            max_num_batched_tokens=run.get("max_num_batched_tokens", 100),
            max_num_seqs=run.get("max_num_seqs", 8),
            enable_prefix_caching=run.get("prefix_caching", True),
            enforce_eager=True,
            gpu_memory_utilization=0.5,
            kv_cache_memory_bytes=run.get("kv_cache_memory_bytes", 1 << 28),
            seed=0,
            **({"speculative_config": run["speculative_config"]} if run.get("speculative_config") else {}),
        )
    except Exception as e:  # engine start failure: the reasons are on stderr
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    top = int(run.get("logprobs", 0))
    params = SamplingParams(
        max_tokens=run.get("max_tokens", 64), temperature=0.0, ignore_eos=True, logprobs=top or None
    )
    tokens, cached, logprobs = [], [], []
    for batch in run["batches"]:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        cached.append([int(o.num_cached_tokens or 0) for o in outs])
        if top:
            logprobs.append([
                [{str(t): float(lp.logprob) for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in outs
            ])  # fmt: skip
    stats = read_stats(stats_path)
    del llm
    out = {"ok": True, "tokens": tokens, "cached": cached, "stats": stats}
    if top:
        out["top_logprobs"] = logprobs
    return out


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    results = {}
    for run in spec["runs"]:
        results[run["name"]] = run_one(spec["model"], run)
        json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
