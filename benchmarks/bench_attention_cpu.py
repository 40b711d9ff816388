"""Per-layer attention on the CPU: sparse_quoka's pipeline against vLLM's dense CPU_ATTN kernel, same run.

    python benchmarks/bench_attention_cpu.py [--contexts 4096 8192 16384 32768] [--chunk 2048]

The last chunk of a context of length ``ctx`` (or a decode step), one request, Qwen2.5-0.5B layer
shapes by default (14 query heads, 2 KV heads, d=64), bf16, 32-token pages. Dense is vLLM's
``cpu_attention_with_kv_cache`` over the request's block table with all KV heads (what CPU_ATTN
runs). Sparse is selection (QuoKA scoring + top-k) + page tables + the same kernel over
per-(request, KV head) page rows. Median of ``--reps`` after one warm-up.

Selection is timed twice, on the native CPU kernels (``csrc/``, the default when they
build) and on the torch path (``cpu_native.torch_path()``): ``select_*`` is the whole selector
(query subselection, grouping, scoring, top-k), ``score_topk_*`` the scoring + masked top-k stage
alone (torch twin ``score_pages`` + ``torch.topk`` against ``quoka_score_topk``). Sparse totals use
the native selection. ``--selection-only`` skips dense and sparse attention (quick, e.g. for
Llama-8B shapes). The JSON records the load average at start and end: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from cpu_timing import cpu_model, timed
from tqdm import tqdm
from vllm import _custom_ops as ops

from vllm_sparse.backend.cpu_attn_executor import ISA, CpuAttnExecutor
from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.kernels import cpu_native
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import forced_past, past_page_ids
from vllm_sparse.selectors.quoka import QuokaSelector, group_query, score_pages, subselect_queries
from vllm_sparse.tables import build_page_tables


def bench_case(ctx: int, chunk: int, fraction: float, hq: int, hkv: int, d: int, n: int, reps: int,
               selection_only: bool = False) -> dict:
    g = torch.Generator().manual_seed(ctx + chunk)
    dtype = torch.bfloat16
    num_pages = -(-ctx // n)
    kv_cache = torch.randn(num_pages + 1, hkv, n, 2 * d, generator=g).to(dtype)
    layout = PageLayout.of(kv_cache, hkv, "planes")
    block_table = torch.arange(1, num_pages + 1, dtype=torch.int32)[None]
    query = torch.randn(chunk, hq, d, generator=g).to(dtype)
    scale = d**-0.5
    seq_lens = [ctx]
    qsl = [0, chunk]

    # dense: the stock CPU_ATTN call
    qsl_t, sl_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    k_cache, v_cache = layout.keys(kv_cache).transpose(-1, -2), layout.values(kv_cache)  # vec packing views
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=sl_t, dtype=dtype,
        query_start_loc=qsl_t, causal=True, sliding_window_size=-1, isa=ISA, enable_kv_split=False,
    )
    out = torch.empty_like(query)

    def dense():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=k_cache.transpose(-1, -2), value_cache=v_cache, output=out,
            query_start_loc=qsl_t, seq_lens=sl_t, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=sched, s_aux=None,
        )

    # sparse: the pipeline stages of one layer
    policy = LayerPolicy(False, Budget(fraction=fraction, min_tokens=0, max_tokens=None), 16, 512, 0)
    plan = plan_step(policy, n, qsl, seq_lens)
    selector, executor = QuokaSelector(64), CpuAttnExecutor()
    pk, pv = layout.page_keys(kv_cache), layout.page_values(kv_cache)
    state = {}

    def select():
        state["sel"] = selector(query, pk, block_table, layout, plan)

    def select_torch():
        with cpu_native.torch_path():
            select()

    def tables():
        state["tab"] = build_page_tables(plan, state["sel"], block_table, layout)

    def attend():
        executor(query, pk, pv, state["tab"], plan, scale, out)

    # the scoring + top-k stage alone, both ways, on the selector's own inputs
    req = plan.requests[0]
    score_topk = {}
    if req.sparse and req.num_select:
        qbar = group_query(subselect_queries(query[: req.query_len], selector.num_queries).float(), hkv)
        ids = past_page_ids(block_table, 0, req.num_past_pages, layout)
        forced, k = forced_past(req, ids.device), req.num_select

        def st_torch():
            s = score_pages(qbar, pk[ids])
            s[:, forced] = float("-inf")
            state["top_torch"] = torch.topk(s, k, dim=1).indices

        def st_native():
            state["top_native"] = cpu_native.quoka_score_topk(qbar, pk, ids, forced, k)

        score_topk["score_topk_torch_ms"] = timed(st_torch, reps)
        if cpu_native.available():
            score_topk["score_topk_native_ms"] = timed(st_native, reps)
            top_t = state["top_torch"]
            same = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_t, state["top_native"])]
            score_topk["native_same_pages"] = sum(same) / (k * hkv)  # < 1 only through near-ties
            score_topk["score_topk_speedup"] = score_topk["score_topk_torch_ms"] / score_topk["score_topk_native_ms"]

    t_sel_torch = timed(select_torch, reps)
    t_sel = timed(select, reps) if cpu_native.available() else t_sel_torch
    row = {
        "context": ctx, "chunk": chunk, "budget_fraction": fraction, "num_past_pages": req.num_past_pages,
        "num_select": req.num_select, "select_ms": t_sel, "select_torch_ms": t_sel_torch, **score_topk,
    }
    if selection_only:
        return row
    t_dense = timed(dense, reps)
    t_tab, t_att = timed(tables, reps), timed(attend, reps)
    sparse = t_sel + t_tab + t_att
    attended = state["tab"].attended_pages / (hkv * plan.requests[0].total_pages)
    return {
        **row, "dense_ms": t_dense, "sparse_ms": sparse, "sparse_torch_select_ms": t_sel_torch + t_tab + t_att,
        "tables_ms": t_tab, "attention_ms": t_att, "attended_share": attended,
        "speedup_total": t_dense / sparse, "speedup_attention": t_dense / t_att,
        "selection_share": (t_sel + t_tab) / sparse,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 1])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25])
    p.add_argument("--shape", default="qwen0.5b", choices=["qwen0.5b", "llama8b"])
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--selection-only", action="store_true", help="time selection only (no dense, no attention)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    load_start = os.getloadavg()
    hq, hkv, d = {"qwen0.5b": (14, 2, 64), "llama8b": (32, 8, 128)}[args.shape]
    torch.set_num_threads(os.cpu_count() or 1)
    native = cpu_native.available()  # builds the library first if needed (not timed)
    cases = [(c, k, b) for c in args.contexts for k in args.chunks for b in args.budgets]
    rows = []
    for ctx, chunk, frac in tqdm(cases, desc="cases"):
        r = bench_case(ctx, chunk, frac, hq, hkv, d, args.page, args.reps, args.selection_only)
        rows.append(r)
        st = (f"score+topk torch {r['score_topk_torch_ms']:.2f} native {r.get('score_topk_native_ms', float('nan')):.2f}"
              if "score_topk_torch_ms" in r else "no sparse selection")
        msg = (f"ctx {ctx:6d} chunk {chunk:5d} budget {frac:.3f}: select torch {r['select_torch_ms']:.2f} "
               f"native {r['select_ms']:.2f} ({st})")
        if not args.selection_only:
            msg += (f"  dense {r['dense_ms']:.2f} sparse {r['sparse_ms']:.2f} (tables {r['tables_ms']:.2f} "
                    f"attn {r['attention_ms']:.2f}) x{r['speedup_total']:.2f}")
        tqdm.write(msg)
    ops_ns = cpu_native.load()
    out = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg()},
        "shape": {"name": args.shape, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "page": args.page,
                  "dtype": "bfloat16", "isa": ISA},
        "native": {"available": native, "avx512": bool(ops_ns.has_avx512()) if ops_ns is not None else None,
                   "reason": cpu_native._state.get("reason")},
        "versions": {"torch": torch.__version__},
        "rows": rows,
    }
    path = Path(args.out or Path(__file__).parent / "results" / f"attention_cpu_{args.shape}.json")
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
