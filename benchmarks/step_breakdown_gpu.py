"""Where a layer's time goes, per method, against dense in the same process: the breakdown the
serving numbers need (issues 11 and 18) and the data the prefill cost model is fitted on.

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16, pages of 16 or ``--page-size``), one layer,
each method's shipped defaults (12.5% budget), the head-major cache with the method's metadata
slots, CUDA events, median of reps, L2 flushed before every rep.

* prefill: one chunk of ``q`` tokens after ``ctx`` past tokens. ``dense_ms`` is what the backend
  now runs for a dense chunk (vLLM's FlashAttention on this cache, the FLASH_ATTN kernel); per
  method, the layer's sparse forward (selector, tables, executor, with the step's plan made
  beforehand as the metadata builder does) and its stages.
* decode: ``B`` requests of ``ctx`` tokens, one layer's decode captured in a CUDA graph and
  replayed (what vLLM's full graphs run): the whole layer, the selection alone and the attention
  alone; ``dense_fa_ms`` is FlashAttention's paged decode over every page (FLASH_ATTN's kernel),
  ``dense_ours_ms`` our decode kernel with no selection (QuoKA's default dense decode).

    python benchmarks/step_breakdown_gpu.py --out DIR [--reps 10] [--page-size 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import FLUSH_MODES, bench_setup, write_results

from vllm_sparse.backend.dense_prefill import DenseRows
from vllm_sparse.backend.flash_rows import FlashRowsExecutor
from vllm_sparse.config import SparseConfig
from vllm_sparse.decode_step import DecodeColumns
from vllm_sparse.executors.flashinfer import flashinfer_executor
from vllm_sparse.executors.triton_paged import TritonPagedExecutor
from vllm_sparse.kernels.decode_attention import decode_attention_triton
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import write_int4_shadow
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import make_selector
from vllm_sparse.tables import build_page_tables

HQ, HKV, D, N = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = D**-0.5
METHODS = ("quest", "quoka", "twilight")
MAX_MODEL_LEN = 131072 + 4096


class Cache:
    """A layer cache with ``pages`` blocks per request for ``reqs`` requests, random keys and the
    method's page metadata written for every token."""

    def __init__(self, method: str, reqs: int, tokens: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        planes = MetaPlanes.for_method(method, HKV, N, D, DTYPE)
        slots = HKV + (planes.num_slots if planes else 0)
        pages = -(-tokens // N)
        num_blocks = reqs * pages + 16
        self.cache = torch.randn(num_blocks, slots, N, 2 * D, device="cuda", generator=g, dtype=DTYPE)
        self.layout = PageLayout.of(self.cache, HKV, "interleaved")
        self.meta = planes.views(self.cache) if planes else None
        perm = torch.randperm(num_blocks, device="cuda", generator=g)[: reqs * pages]
        self.block_table = perm.view(reqs, pages).to(torch.int32).contiguous()
        if self.meta is not None:  # page metadata of every token (what the writes keep current)
            pos = torch.arange(pages * N, device="cuda")
            for r in range(reqs):
                slots_r = self.block_table[r, pos // N].long() * N + pos % N
                write_page_minmax(self.layout, self.cache, self.meta, slots_r)
                if self.meta.codes is not None:
                    keys = self.layout.keys(self.cache)[slots_r // N, :, slots_r % N]
                    write_int4_shadow(self.meta, keys, slots_r, N, DTYPE)
        self.pk, self.pv = self.layout.page_keys(self.cache), self.layout.page_values(self.cache)
        self.k, self.v = self.layout.keys(self.cache), self.layout.values(self.cache)


def executor_for(selector, kind: str = "auto"):
    """What the backend runs for sparse prefill rows (``auto``: vLLM's FlashAttention over the rows
    where vLLM ships it), or the previous executors (``flashinfer``: FlashInfer for fixed counts,
    the Triton paged kernel for Twilight's variable ones)."""
    if kind == "auto":
        rows = FlashRowsExecutor.create(D, N)
        if rows is not None:
            return rows
    return flashinfer_executor() if selector.fixed_counts else TritonPagedExecutor()


def prefill_case(timer, dense, method, q, ctx, seed, compare: bool = False) -> dict:
    c = Cache(method, 1, ctx + q, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(q, HQ, D, device="cuda", generator=g, dtype=DTYPE)
    out = torch.empty_like(query)
    rows = DenseRows(
        0, q, torch.tensor([0, q], dtype=torch.int32, device="cuda"),
        torch.tensor([ctx + q], dtype=torch.int32, device="cuda"), c.block_table, q, ctx + q,
    )  # fmt: skip
    r = {"phase": "prefill", "method": method, "query_len": q, "context": ctx, "page_size": N}
    r["dense_ms"] = timer(lambda: dense(query, c.k, c.v, rows, SCALE, out))
    cfg = SparseConfig(method=method, sparse_prefill=True)
    policy = cfg.for_layer(1)
    selector = make_selector(cfg, SCALE)
    execute = executor_for(selector)
    r["executor"] = type(execute).__name__
    plan = plan_step(policy, N, [0, q], [ctx + q])
    req = plan.requests[0]
    r.update(sparse=req.sparse, pages_dense=req.total_pages, pages_planned=req.num_pages)
    if not req.sparse:
        return r
    if getattr(execute, "prepare", None) is not None:
        execute.prepare(plan, HKV, HQ // HKV, D, DTYPE, DTYPE, SCALE, query.device)
    state = {}

    def select():
        state["sel"] = selector(query, c.pk, c.block_table, c.layout, plan, c.meta)

    def tables():
        state["tab"] = build_page_tables(plan, state["sel"], c.block_table, c.layout)

    def attend():
        execute(query, c.pk, c.pv, state["tab"], plan, SCALE, out)

    def forward():
        select(), tables(), attend()

    forward()
    r.update(select_ms=timer(select), tables_ms=timer(tables), attend_ms=timer(attend), forward_ms=timer(forward))
    if compare:  # the previous executor on the same tables
        before = executor_for(selector, "flashinfer")
        if type(before) is not type(execute):
            if getattr(before, "prepare", None) is not None:
                before.prepare(plan, HKV, HQ // HKV, D, DTYPE, DTYPE, SCALE, query.device)
            r[f"attend_{type(before).__name__}_ms"] = timer(
                lambda: before(query, c.pk, c.pv, state["tab"], plan, SCALE, out)
            )
    r["speedup"] = r["dense_ms"] / r["forward_ms"]
    return r


def decode_case(timer, dense, method, b, ctx, seed, profile=False) -> dict:
    c = Cache(method, b, ctx + 1, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(b, HQ, D, device="cuda", generator=g, dtype=DTYPE)
    out = torch.empty_like(query)
    seq = np.full(b, ctx + 1)
    cfg = SparseConfig(method=method, sparse_decode=True)
    policy = cfg.for_layer(1)
    selector = make_selector(cfg, SCALE)
    step = DecodeColumns([policy], N, b, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV).write(seq, c.block_table)
    rows_n = b * HKV
    none_pages = torch.zeros(rows_n, 1, dtype=torch.int32, device="cuda")
    none_counts = torch.zeros(rows_n, dtype=torch.int32, device="cuda")
    state = {}

    def select():
        state["sel"] = selector.select_decode(query, c.pk, c.layout, c.meta, step, policy)

    def attend():
        pages, counts = state["sel"]
        decode_attention_triton(query, c.pk, c.pv, step.block_table, pages, counts, step.columns[policy],
                                c.layout.num_head_slots, SCALE, out)  # fmt: skip

    def layer():
        select(), attend()

    dense_step = DecodeColumns([cfg.for_layer(0)], N, b, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV).write(
        seq, c.block_table
    )
    dense_policy = cfg.for_layer(0)  # layer 0: dense

    def dense_ours():
        decode_attention_triton(query, c.pk, c.pv, dense_step.block_table, none_pages, none_counts,
                                dense_step.columns[dense_policy], c.layout.num_head_slots, SCALE, out)  # fmt: skip

    rows = DenseRows(
        0, b, torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        torch.full((b,), ctx + 1, dtype=torch.int32, device="cuda"), c.block_table, 1, ctx + 1,
    )  # fmt: skip

    def graph(fn):
        fn()
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            fn()
        return gr.replay

    layer()
    if profile:  # kernel times of one eager selection (CUDA time per kernel)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                select()
            torch.cuda.synchronize()
        print(f"--- {method} decode B={b} ctx={ctx}: selection kernels, 5 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    r = {"phase": "decode", "method": method, "batch": b, "context": ctx, "page_size": N}
    r["dense_fa_ms"] = timer(lambda: dense(query, c.k, c.v, rows, SCALE, out))
    r["dense_ours_ms"] = timer(graph(dense_ours))
    r["layer_ms"] = timer(graph(layer))
    r["select_ms"] = timer(graph(select))
    r["attend_ms"] = timer(graph(attend))
    r["pages_dense"] = -(-(ctx + 1) // N)
    r["pages_attended_mean"] = float(state["sel"][1].float().mean()) + float(
        step.host_columns[policy][0, 1] + step.host_columns[policy][0, 3] - step.host_columns[policy][0, 2]
    )
    r["speedup_vs_fa"] = r["dense_fa_ms"] / r["layer_ms"]
    return r


def main() -> None:
    global N
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prefill-chunks", default="2048,8192")
    ap.add_argument("--prefill-contexts", default="4096,8192,16384,32768,65536,122880")
    ap.add_argument("--decode", default="1:16384,1:131072,16:16384,32:32768")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--profile", action="store_true", help="print the selection's kernel times per decode case")
    ap.add_argument("--compare-executors", action="store_true", help="also time the previous prefill executor")
    ap.add_argument("--page-size", type=int, default=N, help="tokens per page (Quest's GPU default is 32)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="write", help="how the L2 is emptied (gpu_timing)")
    args = ap.parse_args()
    N = args.page_size
    out, timer, dense = bench_setup(args.out, args.reps, D, N, args.flush)
    results = []

    def save():
        write_results(
            out / "step_breakdown_gpu.json",
            "per-layer breakdown, Llama-3.1-8B layer shapes, shipped defaults (12.5% budget)",
            f"CUDA events, median of reps, L2 flushed before each rep ({args.flush}); decode timed as CUDA-graph replays",
            results,
        )

    seed = 0
    for method in args.methods.split(","):
        for q in map(int, filter(None, args.prefill_chunks.split(","))):  # "": no prefill cases
            for ctx in map(int, filter(None, args.prefill_contexts.split(","))):
                seed += 1
                r = prefill_case(timer, dense, method, q, ctx, seed, args.compare_executors)
                results.append(r)
                print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()
        for spec in filter(None, args.decode.split(",")):
            b, ctx = map(int, spec.split(":"))
            seed += 1
            r = decode_case(timer, dense, method, b, ctx, seed, args.profile)
            results.append(r)
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
        save()
    save()


if __name__ == "__main__":
    main()
