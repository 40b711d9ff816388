"""End to end through vLLM on a GPU: sparse_quoka against FLASH_ATTN and FLASHINFER.

Every engine runs in its own subprocess (clean GPU memory; the plugin must load through its
``vllm.general_plugins`` entry point there and in vLLM's engine-core process).

``tiny``: a small random-weight Llama (GQA 8/2, head_dim 128, run in fp16) written with transformers.
Greedy tokens of sparse_quoka with a budget covering the context must equal FLASH_ATTN's (and
FLASHINFER's): a batch of prompts of different lengths, chunked prefill with 100-token chunks
(chunks start inside 16-token pages), and a second batch that hits the prefix cache. Runs in
eager mode and in vLLM's default compile mode (piecewise CUDA graphs); a sparse run with a real
budget shows pages are skipped.

``perf``: Llama-3.1-8B shapes with random weights (``load_format="dummy"``, no tokenizer):
TTFT at the given contexts and TPOT (decode after a 32K prompt) for sparse_quoka (12.5% budget),
FLASH_ATTN and FLASHINFER in the same run, prefix caching off, chunks of 8192 tokens.

    python benchmarks/e2e_gpu.py tiny --out DIR [--modes eager,compile] [--parallel]
    python benchmarks/e2e_gpu.py perf --out DIR [--contexts 32768,130560] [--compile]
    python benchmarks/e2e_gpu.py tp --out DIR [--tp 2] [--parallel]     # tensor parallelism, 2+ GPUs

Writes ``DIR/e2e_gpu_<part>.json`` and one log per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]

FULL_BUDGET = {
    "sparse_attention": {
        "budget": {"fraction": 1.0, "min_tokens": 0, "max_tokens": None},
        "dense_layers": [],
        "dense_below_tokens": 0,
    }
}
# every row of every layer through the selection path (selection, tables, sparse executor, the
# device decode path), every page selected: must still equal dense
FORCED_SPARSE = {
    "sparse_attention": {
        **FULL_BUDGET["sparse_attention"],
        "force_sparse": True,
        "sparse_decode": True,
        "twilight": {"top_p": 1.0, "candidate_fraction": 1.0},
    }
}
REAL_BUDGET = {
    "sparse_attention": {
        "budget": {"fraction": 0.25, "min_tokens": 64, "max_tokens": None},
        "sink_tokens": 32,
        "local_tokens": 64,
        "dense_layers": [0],
        "dense_below_tokens": 256,
        "sparse_decode": True,
        "sparse_prefill": True,  # the tiny prompts sit below the GPU cost model's break-even
        "quoka": {"num_queries": 16},
    }
}
FORCED_METHODS = ("quoka", "quest", "twilight", "compact", "kascade")


def forced_sparse(method: str) -> dict:
    """FORCED_SPARSE for ``method``; Compact keeps every block with a threshold of 0 and decodes
    dense (it refuses ``sparse_decode: true``: the method is prefill-only); Kascade scores at
    layers 0 and 2 of the 4-layer model (no calibration on random weights)."""
    if method == "kascade":
        return {"sparse_attention": {**FORCED_SPARSE["sparse_attention"], "kascade": {"anchors": [0, 2]}}}
    if method != "compact":
        return FORCED_SPARSE
    cfg = {k: v for k, v in FORCED_SPARSE["sparse_attention"].items() if k != "sparse_decode"}
    return {"sparse_attention": {**cfg, "compact": {"block_threshold": 0.0}}}


PERF_BUDGET = {"sparse_attention": {"budget": {"fraction": 0.125}}}  # other fields: method defaults

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


# ---------------------------------------------------------------------------------------------
# models


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Random-weight Llama, GQA 8/2, head_dim 128 (FA3 and FlashInfer both run it), 4 layers.

    lm_head has a large std so that greedy choices are not near-ties (bf16 kernels differ in
    rounding; equal tokens must test attention, not tie-breaking)."""
    if (path / "done").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 if "lm_head" in name else 0.06)
    model.save_pretrained(path, safe_serialization=True)
    (path / "done").write_text("ok")
    return path


def build_llama8b_config(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_8B, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    return path


def tiny_prompts() -> list[list[list[int]]]:
    rng = random.Random(1234)
    a, b, c, d = ([rng.randrange(2, 512) for _ in range(n)] for n in (700, 1100, 1500, 333))
    shares_a = a[:600] + [rng.randrange(2, 512) for _ in range(400)]  # prefix hit, not page aligned
    shares_c = c[:1203] + [rng.randrange(2, 512) for _ in range(50)]
    short = [rng.randrange(2, 512) for _ in range(90)]
    return [[a, b, c, d], [shares_a, a, short, shares_c]]


# ---------------------------------------------------------------------------------------------
# one engine (runs in a subprocess)


def plugin_check() -> dict:
    from importlib.metadata import entry_points

    eps = [f"{e.name}={e.value}" for e in entry_points(group="vllm.general_plugins")]
    return {"entry_points": eps, "registered": any(e.startswith("vllm_sparse=") for e in eps)}


def engine_kwargs(spec: dict) -> dict:
    kw = {
        "model": spec["model"],
        "attention_backend": spec["backend"],
        "additional_config": spec.get("additional_config") or {},
        "dtype": spec.get("dtype", "bfloat16"),
        "max_model_len": spec["max_model_len"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "max_num_seqs": spec.get("max_num_seqs", 8),
        "enable_prefix_caching": spec.get("prefix_caching", True),
        "enforce_eager": spec["mode"] == "eager",
        "seed": 0,
    }
    if spec.get("block_size", 16) is not None:  # None: vLLM takes the backend's preferred block size
        kw["block_size"] = spec.get("block_size", 16)
    if spec.get("dummy"):
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    else:
        kw.update(skip_tokenizer_init=True)
    if spec.get("kv_cache_memory_bytes"):
        kw["kv_cache_memory_bytes"] = spec["kv_cache_memory_bytes"]
    if "async_scheduling" in spec:  # unset: vLLM's default (on for GPUs in 0.33)
        kw["async_scheduling"] = spec["async_scheduling"]
    kw["gpu_memory_utilization"] = spec.get("gpu_memory_utilization", 0.85)
    if spec.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = spec["tp"]
    return kw


def run_engine(spec: dict) -> dict:
    os.environ["SPARSE_ATTENTION_STATS"] = spec["stats_path"]
    res = {"plugin": plugin_check(), "spec": {k: v for k, v in spec.items() if k != "batches"}}
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    res["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    res["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size

    def gen(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    if spec["kind"] == "tiny":
        # greedy tokens with the top-5 logprobs of every step (to tell near-ties from errors)
        params = SamplingParams(
            max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False, logprobs=5
        )
        res["tokens"], res["top_logprobs"] = [], []
        for batch in spec["batches"]:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            res["tokens"].append([list(o.outputs[0].token_ids) for o in outs])
            res["top_logprobs"].append(
                [[{str(t): lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]
            )
        # teacher-forced: logprob of every prompt token of the first batch (chunked prefill, no divergence)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["batches"][0]], params, use_tqdm=False)
        res["prompt_logprobs"] = [
            [None if d is None else d[t].logprob for d, t in zip(o.prompt_logprobs, o.prompt_token_ids)] for o in outs
        ]
    else:
        rng = random.Random(7)

        def prompt(n: int) -> list[int]:
            return [rng.randrange(10, 128000) for _ in range(n)]

        gen([prompt(2048)], 8)  # warm-up (kernels, JIT caches)
        gen([prompt(8192 + 100)], 4)
        ttft, tpot = {}, {}
        for ctx in spec["contexts"]:
            reps = 3 if ctx <= 40000 else 1
            times = [gen([prompt(ctx)], 1)[0] for _ in range(reps)]
            ttft[str(ctx)] = {"median_s": statistics.median(times), "all_s": times}
            n_dec = spec["decode_tokens"]
            if ctx == spec["contexts"][0] or spec.get("tpot_all"):
                t_long = gen([prompt(ctx)], n_dec + 1)[0]
                tpot[str(ctx)] = {"ms": 1000 * (t_long - statistics.median(times)) / n_dec, "decode_tokens": n_dec}
            print(f"[{spec['backend']}] ctx {ctx}: ttft {ttft[str(ctx)]} tpot {tpot.get(str(ctx))}", flush=True)
        res["ttft"], res["tpot"] = ttft, tpot
    from vllm_sparse.stats import read_stats

    res["sparse_stats"] = read_stats(spec["stats_path"])
    res["ok"] = True
    return res


# ---------------------------------------------------------------------------------------------
# orchestration


def launch(spec: dict, out: Path) -> subprocess.Popen:
    """Start one engine subprocess; its spec, result, stats and log go to ``out`` (a work folder)."""
    name = spec["name"]
    spec_path = out / f"spec_{name}.json"
    spec["stats_path"] = str(out / f"stats_{name}.json")
    spec["result_path"] = str(out / f"result_{name}.json")
    spec_path.write_text(json.dumps(spec))
    log = open(out / f"log_{name}.txt", "w")  # noqa: SIM115 (the child owns it)
    # own compile cache per engine: engines may start at the same time
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(out / f"vllm_cache_{name}"), VLLM_SPARSE_JIT_TRACE="1")
    return subprocess.Popen(
        [sys.executable, str(HERE), "engine", str(spec_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: killed as a whole below
    )


def collect(spec: dict, proc: subprocess.Popen, out: Path, deadline: float) -> dict:
    """Wait for an engine subprocess (killed at ``deadline``), then end what it left running."""
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        rc = "killed at the deadline"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine core and workers it may have left behind
    except ProcessLookupError:
        pass
    proc.wait()
    time.sleep(2)  # let the driver release its memory before the next engine starts
    path = Path(spec["result_path"])
    log = (out / f"log_{spec['name']}.txt").read_text(errors="replace")
    if path.exists():
        res = json.loads(path.read_text())
    else:
        res = {"ok": False, "rc": rc, "log_tail": log[-3000:]}
    res["rc"] = rc
    # kernels vLLM's JIT monitor saw compiled after start-up (a latency spike in serving)
    res["jit_during_inference"] = sorted(set(re.findall(r"JIT compilation during inference: (\w+)", log)))
    return res


def run_specs(specs: list[dict], out: Path, parallel: bool, deadline: float) -> dict:
    results = {}
    if parallel:
        procs = [(s, launch(s, out)) for s in specs]
        for s, p in procs:
            results[s["name"]] = collect(s, p, out, deadline)
    else:
        for s in specs:
            results[s["name"]] = collect(s, launch(s, out), out, deadline)
            print(f"{s['name']}: ok={results[s['name']].get('ok')}", flush=True)
    return results


# Two kernels that round differently (FLASH_ATTN and FLASHINFER too) part ways where the
# reference's top logprobs are within a few ulps of the logits; in bf16 (ulp 0.125-0.25 at this
# model's |logit| of 20-60) they did so at gaps up to 0.25, the runs here use fp16 (8x finer).
NEAR_TIE = 0.26


def ref_gap(top: dict[str, float], want: int, got: int) -> float | None:
    """Where two greedy runs part: the reference's logprob of its own token ``want`` minus that of
    the other run's ``got``, from the reference's top logprobs ``top`` (keyed by token id as a
    string); ``None`` where ``got`` is not among them (never a near-tie)."""
    own, other = top.get(str(want)), top.get(str(got))
    return None if own is None or other is None else round(own - other, 4)


def tie_bound(dense_gap: float | None) -> float:
    """The near-tie bound of a run: twice the largest gap at which its two dense backends part
    (``dense_gap``, the numerical noise of their kernels on this model), at least ``NEAR_TIE``."""
    return max(NEAR_TIE, 2 * (dense_gap or 0.0) + 0.01)


def compare_tokens(got: dict, want: dict) -> dict:
    """Per prompt: equal, or the first different token and the reference's logprob gap there
    between its own choice and ``got`` 's (a near-tie when small). ``got``/``want``: run results."""
    per = []
    for b, (gb, wb) in enumerate(zip(got["tokens"], want["tokens"])):
        for i, (g, w) in enumerate(zip(gb, wb)):
            first = next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), None)
            item = {"equal": g == w, "first_diff": first, "len": len(g)}
            if first is not None:
                top = want["top_logprobs"][b][i][first]  # reference's top-5 at the divergence
                item["ref_gap"] = ref_gap(top, w[first], g[first])
            per.append(item)
    gaps = [p.get("ref_gap") for p in per if not p["equal"]]
    return {
        "all_equal": all(p["equal"] for p in per),
        "max_ref_gap_at_divergence": None if None in gaps else max(gaps, default=0.0),
        "prompts": per,
    }


def compare_prompt_logprobs(got: dict, want: dict) -> dict:
    """Teacher-forced prompt-token logprobs: max and mean absolute difference over all tokens."""
    diffs = [
        abs(a - b)
        for ga, wa in zip(got["prompt_logprobs"], want["prompt_logprobs"])
        for a, b in zip(ga, wa)
        if a is not None and b is not None
    ]
    return {"max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs), "tokens": len(diffs)}


def tiny(args) -> dict:
    out = Path(args.workdir) / "tiny_runs"
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_llama(Path(args.workdir) / "tiny_llama"))
    batches = tiny_prompts()
    common = {
        "kind": "tiny",
        "model": model,
        # float16: 8x finer rounding than bfloat16. This random model's wide logits turn the
        # rounding noise of any two bf16 kernels (FLASHINFER and FLASH_ATTN included) into greedy
        # flips at 1-3 ulps of the logits; in fp16 the noise floor sits far below the near-tie
        # bound, and an attention error (a wrong or missing page) still moves logits by whole units
        "dtype": "float16",
        "batches": batches,
        "max_tokens": 48,
        "max_model_len": 4096,
        "max_num_batched_tokens": 100,
        "kv_cache_memory_bytes": 1 << 30,
        "gpu_memory_utilization": 0.05,
    }
    specs = []
    for mode in args.modes.split(","):
        specs += [
            {**common, "name": f"{mode}_flash_attn", "mode": mode, "backend": "FLASH_ATTN"},
            {**common, "name": f"{mode}_flashinfer", "mode": mode, "backend": "FLASHINFER"},
            {
                **common,
                "name": f"{mode}_sparse_full",
                "mode": mode,
                "backend": "sparse_quoka",
                "additional_config": FULL_BUDGET,
            },
            {
                **common,
                "name": f"{mode}_sparse_real",
                "mode": mode,
                "backend": "sparse_quoka",
                "additional_config": REAL_BUDGET,
            },
        ]
        specs += [
            {
                **common,
                "name": f"{mode}_forced_{method}",
                "mode": mode,
                "backend": f"sparse_{method}",
                "additional_config": forced_sparse(method),
            }
            for method in FORCED_METHODS
        ]
        # the forced runs above take vLLM's default scheduling (async on GPUs); one without it
        specs.append({**common, "name": f"{mode}_forced_quest_sync", "mode": mode, "backend": "sparse_quest",
                      "additional_config": forced_sparse("quest"), "async_scheduling": False})  # fmt: skip
        # and one that leaves the block size to the backend (Quest prefers pages of 32 on GPUs)
        specs.append({**common, "name": f"{mode}_forced_quest_default_pages", "mode": mode, "backend": "sparse_quest",
                      "additional_config": forced_sparse("quest"), "block_size": None})  # fmt: skip
    results = run_specs(specs, out, args.parallel, args.deadline_at)
    summary = {}
    for mode in args.modes.split(","):
        kinds = ("flash_attn", "flashinfer", "sparse_full", "sparse_real")
        kinds += ("forced_quest_sync", "forced_quest_default_pages")
        kinds += tuple(f"forced_{m}" for m in FORCED_METHODS)
        runs = {k: results.get(f"{mode}_{k}", {}) for k in kinds}
        pairs = [
            ("sparse_full", "flash_attn"),
            ("sparse_full", "flashinfer"),
            ("flashinfer", "flash_attn"),
            ("sparse_real", "flash_attn"),
        ]
        forced = FORCED_METHODS + ("quest_sync", "quest_default_pages")
        pairs += [(f"forced_{m}", ref) for m in forced for ref in ("flash_attn", "flashinfer")]
        for a, b in pairs:
            if runs[a].get("ok") and runs[b].get("ok"):
                summary[f"{mode}: {a} vs {b}"] = {
                    "greedy": compare_tokens(runs[a], runs[b]),
                    "prompt_logprobs": compare_prompt_logprobs(runs[a], runs[b]),
                }
    return {"summary": summary, "runs": results}


def real_budget(method: str) -> dict:
    """REAL_BUDGET for ``method``: Kascade with the forced runs' anchors, compact decoding dense with
    a threshold that drops blocks on this random model (its shipped one keeps them all here)."""
    cfg = {**REAL_BUDGET["sparse_attention"]}
    if method == "kascade":
        cfg["kascade"] = {"anchors": [0, 2]}
    if method == "compact":
        del cfg["sparse_decode"]
        cfg["compact"] = {"block_threshold": 0.95}
    return {"sparse_attention": cfg}


def tp(args) -> dict:
    """Tensor parallelism: the tiny model (2 KV heads: one per rank at ``--tp 2``) as ``tiny`` runs it.
    Every method forced through its selection path with every page at TP=2 must give FLASH_ATTN's
    greedy tokens at TP=2 and at TP=1 (near-ties aside: TP's all-reduce rounds differently); at a
    real budget (default mode) every method completes and skips pages."""
    out = Path(args.workdir) / "tp_runs"
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_llama(Path(args.workdir) / "tiny_llama"))
    common = {
        "kind": "tiny", "model": model, "dtype": "float16", "batches": tiny_prompts(), "max_tokens": 48,
        "max_model_len": 4096, "max_num_batched_tokens": 100, "kv_cache_memory_bytes": 1 << 29,
        "gpu_memory_utilization": 0.05, "tp": args.tp or 2,
    }  # fmt: skip
    specs = []
    for mode in args.modes.split(","):
        specs += [
            {**common, "name": f"{mode}_flash_attn_tp1", "mode": mode, "backend": "FLASH_ATTN", "tp": 1},
            {**common, "name": f"{mode}_flash_attn", "mode": mode, "backend": "FLASH_ATTN"},
        ]
        specs += [
            {**common, "name": f"{mode}_forced_{m}", "mode": mode, "backend": f"sparse_{m}",
             "additional_config": forced_sparse(m)}
            for m in FORCED_METHODS
        ]  # fmt: skip
        if mode == "compile":  # the default mode, what a user serves with
            specs += [
                {**common, "name": f"{mode}_real_{m}", "mode": mode, "backend": f"sparse_{m}",
                 "additional_config": real_budget(m)}
                for m in FORCED_METHODS
            ]  # fmt: skip
    results = run_specs(specs, out, args.parallel, args.deadline_at)
    summary = {}
    for mode in args.modes.split(","):
        pairs = [("flash_attn", "flash_attn_tp1")]
        pairs += [(f"forced_{m}", ref) for m in FORCED_METHODS for ref in ("flash_attn", "flash_attn_tp1")]
        for a, b in pairs:
            ra, rb = results.get(f"{mode}_{a}", {}), results.get(f"{mode}_{b}", {})
            if ra.get("ok") and rb.get("ok"):
                summary[f"{mode}: {a} vs {b}"] = {
                    "greedy": compare_tokens(ra, rb),
                    "prompt_logprobs": compare_prompt_logprobs(ra, rb),
                }
    return {"tp": common["tp"], "summary": summary, "runs": results}


def perf(args) -> dict:
    out = Path(args.workdir) / f"perf_runs_{'compile' if args.compile else 'eager'}"
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_llama8b_config(Path(args.workdir) / "llama8b_dummy"))
    contexts = [int(c) for c in args.contexts.split(",")]
    common = {
        "kind": "perf",
        "model": model,
        "dummy": True,
        "contexts": contexts,
        "decode_tokens": args.decode_tokens,
        "max_model_len": 131072,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 16,
        "prefix_caching": False,
        "gpu_memory_utilization": 0.85,
        "mode": "compile" if args.compile else "eager",
        "tpot_all": args.tpot_all,
        "tp": args.tp or 1,
    }
    specs = []
    # variants after "+": dense_decode / sparse_decode (decode steps), windowW (chunk_query_window=W),
    # bounds (quest.prefill_scores=bounds)
    for label in args.backends.split(","):  # e.g. "sparse_quoka+dense_decode", "sparse_twilight+window64"
        b, *variants = label.split("+")
        extra = {}
        if "sparse" in b:
            cfg = {**PERF_BUDGET["sparse_attention"]}
            for variant in variants:
                if variant in ("dense_decode", "sparse_decode"):
                    cfg["sparse_decode"] = variant == "sparse_decode"
                elif variant.startswith("window"):
                    cfg["chunk_query_window"] = int(variant.removeprefix("window"))
                elif variant == "bounds":  # Quest's (and Twilight's candidates') prefill by page bounds
                    cfg["quest"] = {"prefill_scores": "bounds"}
                else:
                    raise SystemExit(f"unknown backend variant {variant!r} in {label!r}")
            extra = {"additional_config": {"sparse_attention": cfg}}
        specs.append(
            {**common, "name": f"perf_{label.lower().replace('+', '_')}", "backend": b, "label": label, **extra}
        )
    results = run_specs(specs, out, False, args.deadline_at)
    table = []
    for ctx in contexts:
        row = {"context": ctx}
        for r in results.values():
            if r.get("ok"):
                label = r["spec"].get("label", r["spec"]["backend"])
                row[f"{label} ttft_s"] = round(r["ttft"][str(ctx)]["median_s"], 3)
                if str(ctx) in r["tpot"]:
                    row[f"{label} tpot_ms"] = round(r["tpot"][str(ctx)]["ms"], 2)
        table.append(row)
    return {"table": table, "runs": results}


def gpu_name() -> str:
    try:
        return subprocess.check_output(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], text=True
        ).strip()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


def versions() -> dict:
    v = {"python": platform.python_version()}
    for mod in ("torch", "vllm", "flashinfer", "triton", "transformers"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            v[mod] = f"not importable: {type(e).__name__}"
    return v


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        spec = json.loads(Path(sys.argv[2]).read_text())
        try:
            res = run_engine(spec)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
        Path(spec["result_path"]).write_text(json.dumps(res))
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown of the engine (hangs seen with leftover processes)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["tiny", "perf", "tp"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/e2e_gpu")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--parallel", action="store_true", help="tiny: start all engines at once (small KV caches)")
    ap.add_argument("--contexts", default="32768,130560")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--backends", default="FLASH_ATTN,FLASHINFER,sparse_quoka")
    ap.add_argument("--compile", action="store_true", help="perf: vLLM's default compile mode instead of eager")
    ap.add_argument("--tpot-all", action="store_true", help="perf: TPOT at every context (default: the first)")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (tp: default 2; perf: default 1)")
    ap.add_argument("--deadline", type=float, default=3600.0, help="seconds; engines still running are killed")
    args = ap.parse_args()
    args.deadline_at = time.monotonic() + args.deadline
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = {"tiny": tiny, "perf": perf, "tp": tp}[args.part](args)
    res = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "gpu": gpu_name(),
        "versions": versions(),
        "wall_s": round(time.perf_counter() - t0, 1),
        **res,
    }
    tag = args.part if args.part != "perf" else f"perf_{'compile' if args.compile else 'eager'}"
    path = Path(args.out) / f"e2e_gpu_{tag}.json"
    runs = Path(args.workdir) / (f"{tag}_runs" if args.part != "perf" else f"perf_runs_{tag[5:]}")
    logs = sorted(str(p.relative_to(runs)) for p in runs.glob("log_*.txt"))
    subprocess.run(["tar", "czf", str(Path(args.out) / f"logs_{tag}.tar.gz"), "-C", str(runs), *logs], check=False)
    path.write_text(json.dumps(res, indent=1))
    if args.part in ("tiny", "tp"):
        for key, cmp in res["summary"].items():
            g, lp = cmp["greedy"], cmp["prompt_logprobs"]
            first = [p["first_diff"] for p in g["prompts"]]
            print(
                f"{key}: tokens equal {g['all_equal']} first_diff {first} ref gap {g['max_ref_gap_at_divergence']}"
                f" | prompt logprob |d| max {lp['max_abs']:.4f} mean {lp['mean_abs']:.5f}"
            )
        for name, r in res["runs"].items():
            print(name, "ok" if r.get("ok") else r.get("error") or r.get("log_tail", "")[-500:], r.get("sparse_stats"))
    else:
        print(json.dumps(res["table"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
