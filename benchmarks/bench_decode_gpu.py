"""Per-layer decode attention on the GPU: sparse Quest / Twilight (selection + tables + the Triton
paged executor) vs dense (FlashInfer decode where installed, and the Triton paged executor over
every page).

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d=128, bf16, pages of 16), head-major cache
with the Twilight metadata slots, B requests each decoding one token after ``context`` tokens.
Each case is timed with CUDA events, after warm-up, with the L2 flushed before every repetition;
the median is reported. Budgets are fractions of the context (``--budgets``, default 1/8 and 1/16) for
Quest; Twilight proposes 25% as candidates and keeps top-p 0.95 of their estimated mass (random keys
spread the mass evenly, so it keeps nearly all of them: its time here is an upper bound). Sink 16,
local 512 (inside the budget).

    python benchmarks/bench_decode_gpu.py --out DIR [--contexts 32768,131072] [--batches 1,32]
        [--budgets 0.125,0.0625] [--reps 20] [--no-twilight]

Writes ``DIR/decode_gpu.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import Timer

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.executors.triton_paged import TritonPagedExecutor
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import write_int4_shadow
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import QuestSelector, TwilightSelector
from vllm_sparse.selectors.base import empty_selection
from vllm_sparse.tables import build_page_tables

HQ, HKV, D, N = 32, 8, 128, 16
DTYPE = torch.bfloat16


def make_case(context: int, batch: int, seed: int):
    """A cache with ``batch`` requests of ``context + 1`` tokens, metadata written for every token."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    planes = MetaPlanes.for_method("twilight", HKV, N, D, DTYPE)
    seq = context + 1
    pages = -(-seq // N)
    nb = batch * pages + 8
    cache = torch.randn(nb, HKV + planes.num_slots, N, 2 * D, device="cuda", generator=g, dtype=DTYPE)
    table = torch.randperm(nb, device="cuda", generator=g)[: batch * pages].view(batch, pages).int()
    layout = PageLayout.of(cache, HKV, "interleaved")
    meta = planes.views(cache)
    pos = torch.arange(seq, device="cuda")
    for r in range(batch):
        slots = table[r, pos // N].long() * N + pos % N
        write_page_minmax(layout, cache, meta, slots)
        write_int4_shadow(meta, layout.keys(cache)[slots // N, :, slots % N], slots, N, DTYPE)
    query = torch.randn(batch, HQ, D, device="cuda", generator=g, dtype=DTYPE)
    return cache, table, layout, meta, query


def flashinfer_dense(cache, table, query, context, scale):
    import flashinfer

    batch, pages = table.shape
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND")
    last = context + 1 - (pages - 1) * N
    w.plan(
        torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages,
        table.flatten(),
        torch.full((batch,), last, dtype=torch.int32, device="cuda"),
        HQ, HKV, D, N, q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=scale,
    )  # fmt: skip
    kv = (cache[:, :HKV, :, :D], cache[:, :HKV, :, D:])  # [num_blocks, Hkv, N, D] strided views
    return lambda: w.run(query, kv)


def time_sparse(timer, ex, selector, plan, query, cache, table, layout, meta, scale, fi_ex=None) -> dict:
    """Median times of one sparse method's stages and of its whole forward, and the pages it attended.

    With ``fi_ex`` (a FlashInferExecutor: what vLLM runs for fixed per-row counts, i.e. Quest) the
    attention and the forward are also timed through it; its plan is made once per step and shared
    by every layer, so it is made before timing, as the metadata builder does.
    """
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    outp = torch.empty_like(query)
    state = {}

    def select():
        state["sel"] = selector(query, pk, table, layout, plan, meta)

    def tables():
        state["tables"] = build_page_tables(plan, state["sel"], table, layout)

    def attend():
        ex(query, pk, pv, state["tables"], plan, scale, outp)

    def forward():
        sel = selector(query, pk, table, layout, plan, meta)
        ex(query, pk, pv, build_page_tables(plan, sel, table, layout), plan, scale, outp)

    select(), tables(), attend()
    m = {
        "select_ms": timer(select),
        "tables_ms": timer(tables),
        "attention_ms": timer(attend),
        "forward_ms": timer(forward),
        "pages_attended_per_row": float(state["tables"].counts.float().mean()),
    }
    if fi_ex is not None:
        hkv, group = HKV, query.shape[1] // HKV
        fi_ex.prepare(plan, hkv, group, query.shape[-1], query.dtype, pk.dtype, scale, query.device)

        def attend_fi():
            fi_ex(query, pk, pv, state["tables"], plan, scale, outp)

        def forward_fi():
            sel = selector(query, pk, table, layout, plan, meta)
            fi_ex(query, pk, pv, build_page_tables(plan, sel, table, layout), plan, scale, outp)

        attend_fi()
        m["attention_flashinfer_ms"] = timer(attend_fi)
        m["forward_flashinfer_ms"] = timer(forward_fi)
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budgets", default="0.125,0.0625", help="Quest budget fractions of the context")
    ap.add_argument("--no-twilight", action="store_true", help="time Quest only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = Timer(args.reps)
    scale = D**-0.5
    ex = TritonPagedExecutor()
    fi_ex = None
    if importlib.util.find_spec("flashinfer") is not None:
        from vllm_sparse.executors.flashinfer import FlashInferExecutor

        fi_ex = FlashInferExecutor()
    results = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            cache, table, layout, meta, query = make_case(context, batch, seed=context + batch)
            pk, pv = layout.page_keys(cache), layout.page_values(cache)
            qsl, seqs = list(range(batch + 1)), [context + 1] * batch
            outp = torch.empty_like(query)
            r = {"context": context, "batch": batch}
            if importlib.util.find_spec("flashinfer") is not None:
                r["dense_flashinfer_ms"] = timer(flashinfer_dense(cache, table, query, context, scale))
            dense_plan = plan_step(LayerPolicy(True, Budget(), 16, 512, 0), N, qsl, seqs)
            dense_tables = build_page_tables(dense_plan, empty_selection(dense_plan, HKV, "cuda"), table, layout)
            r["dense_triton_ms"] = timer(partial(ex, query, pk, pv, dense_tables, dense_plan, scale, outp))
            base = r.get("dense_flashinfer_ms", r["dense_triton_ms"])
            r["pages_dense_per_row"] = dense_plan.requests[0].total_pages
            r["methods"] = {}
            cases = []
            for fraction in map(float, args.budgets.split(",")):
                budget = Budget(fraction=fraction, min_tokens=0, max_tokens=None)
                cases.append(
                    (f"quest@{fraction:g}", LayerPolicy(False, budget, 16, 512, 0), QuestSelector("max", scale))
                )
            if not args.no_twilight:
                budget = Budget(fraction=0.125, min_tokens=0, max_tokens=None)
                cases.append((
                    "twilight@cand0.25,p0.95",
                    LayerPolicy(False, budget, 16, 512, 0, 0.25),
                    TwilightSelector(QuestSelector("max", scale), 0.95, scale),
                ))  # fmt: skip
            for name, policy, selector in cases:
                plan = plan_step(policy, N, qsl, seqs)
                fixed = fi_ex if selector.fixed_counts else None  # varying rows (Twilight): Triton only
                m = time_sparse(timer, ex, selector, plan, query, cache, table, layout, meta, scale, fixed)
                for kind in ("attention", "forward", "attention_flashinfer", "forward_flashinfer"):
                    if f"{kind}_ms" in m:
                        m[f"speedup_{kind}"] = base / m[f"{kind}_ms"]
                r["methods"][name] = m
            results.append(r)
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
    doc = {
        "benchmark": "per-layer decode attention, B requests x 1 token, after `context` tokens",
        "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": N, "dtype": "bfloat16"},
        "method": "CUDA events, 3 warm-ups, median of reps, L2 flushed (512 MiB write) before each rep",
        "notes": "attention = the Triton paged executor over the selected pages (*_flashinfer: the "
        "FlashInfer executor, which vLLM runs for Quest; its per-step plan is made before timing); "
        "forward = selector + tables + attention (eager; host launch overhead included); speedups "
        "against FlashInfer dense decode where installed, else the Triton executor over every page",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "results": results,
    }
    (out / "decode_gpu.json").write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
