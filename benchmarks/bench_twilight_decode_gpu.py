"""Twilight's decode selection on the GPU, previous vs current implementation, in one process.

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16, pages of 16), the shipped
Twilight defaults (Quest candidates: 25% of the context, top-p 0.95; sink 16, local 512), the
head-major cache with the Twilight metadata planes written for every token, batch 16 x 16K and
batch 1 x 128K context (``max_model_len`` 132K: the engine's candidate cap). Every part is captured
in a CUDA graph and replayed (what vLLM's full graphs run): CUDA events, median of reps, the L2
flushed before every rep (``gpu_timing.Timer``).

Timed, per case (milliseconds):

* ``select_{old,new}``: the whole ``TwilightSelector.select_decode``;
* Quest candidates: ``quest_bounds`` (shared), ``quest_topk_{old,new}`` (``kernels/page_topk.py``);
* previous pruning: ``old_pages`` (the ~10 torch ops building the rows' page lists),
  ``old_estimate`` (two-pass ``estimate_page_mass_rows_triton``), ``old_top_p``;
* current pruning: ``new_estimate`` (one pass, page lists built in the kernel), ``new_top_p``;
* ``new_estimate_variants``: the current estimate at other tiles / warps / pipeline stages.

Checks: the kept pages of both implementations (rows whose sets differ, and by how many pages),
and the largest difference of their estimated masses.

The previous implementation is kept below (copied from the commit before this change, marked
PREVIOUS): its top-p and page top-k kernels and the page-list ops of ``select_decode``; its
estimate is the package's ``estimate_page_mass_rows_triton`` (unchanged, the planned path's).

    python benchmarks/bench_twilight_decode_gpu.py --out FILE.json [--reps 20] [--cases 16:16384,1:131072]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode_select_gpu import old_select_top_pages  # the PREVIOUS top-k (bisection), kept there
from gpu_timing import Timer

from vllm_sparse.config import SparseConfig
from vllm_sparse.decode_step import DecodeColumns
from vllm_sparse.kernels.page_topk import select_top_pages_triton
from vllm_sparse.kernels.quest_score import quest_decode_bounds_triton
from vllm_sparse.kernels.top_p import top_p_select_triton
from vllm_sparse.kernels.twilight_estimate import decode_page_lse_triton, estimate_page_mass_rows_triton
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import write_int4_shadow
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import HEAD, PAST, SELECT, TAIL
from vllm_sparse.selectors import make_selector
from vllm_sparse.selectors.twilight import forced_cap

DEV = "cuda"
HQ, HKV, D, N = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = D**-0.5
MAX_MODEL_LEN = 131072 + 4096
VARIANTS = [  # (pages per tile, warps, pipeline stages) of the current estimate; the default first
    (4, 4, None),
    (8, 8, None),
    (8, 4, None),
    (4, 4, 2),
    (4, 4, 4),
    (2, 4, None),
]


# ---------------------------------------------------------------------------------------------
# PREVIOUS implementation (the commit before this change), for the comparison only
# ---------------------------------------------------------------------------------------------

OLD_BLOCK = 1024
OLD_INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _old_mass_at_least(row_ptr, cnt, t, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, cnt, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = tl.load(row_ptr + c, mask=c < cnt, other=0.0)
        acc += tl.where(m.to(tl.int32, bitcast=True) >= t, m, 0.0)
    return tl.sum(acc)


@triton.jit(do_not_specialize=["width", "stride_mr", "stride_mg", "stride_cr", "stride_or"])
def _old_top_p_kernel(
    mass_ptr, cnt_ptr, cand_ptr, out_ptr, count_ptr, top_p, width, stride_mr, stride_mg, stride_cr, stride_or,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cnt = tl.load(cnt_ptr + row)
    base = mass_ptr + row.to(tl.int64) * stride_mr
    gi = tl.arange(0, BLOCK_G)
    thr = tl.full([BLOCK_G], OLD_INF_BITS + 1, tl.int32)
    for g in tl.static_range(G):
        hrow = base + g * stride_mg
        total = tl.zeros([BLOCK], tl.float32)
        cand = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, width, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            m = tl.load(hrow + c, mask=c < width, other=0.0)
            total += m
            cand += tl.where(c < cnt, m, 0.0)
        cand_sum = tl.sum(cand)
        need = top_p - (tl.sum(total) - cand_sum)
        lo = tl.zeros([], tl.int32)
        hi = tl.full([], OLD_INF_BITS + 1, tl.int32)
        if need <= 0.0:
            lo = hi
        elif cand_sum >= need:
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                ok = _old_mass_at_least(hrow, cnt, mid, BLOCK) >= need
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
        thr = tl.where(gi == g, lo, thr)
    written = tl.zeros([], tl.int32)
    for c0 in range(0, cnt, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        cm = c < cnt
        m = tl.load(base + gi[:, None] * stride_mg + c[None, :], mask=(gi < G)[:, None] & cm[None, :], other=0.0)
        keep = tl.max((m.to(tl.int32, bitcast=True) >= thr[:, None]).to(tl.int32), axis=0) > 0
        keep = keep & cm
        k32 = keep.to(tl.int32)
        pos = written + tl.cumsum(k32, axis=0) - k32
        page = tl.load(cand_ptr + row.to(tl.int64) * stride_cr + c, mask=keep, other=0)
        tl.store(out_ptr + row.to(tl.int64) * stride_or + pos, page, mask=keep)
        written += tl.sum(k32)
    tl.store(count_ptr + row, written)


def old_top_p_select(mass, cand_counts, cand, top_p):
    """PREVIOUS ``top_p_select_triton``: ``mass [R, G, W]`` (zeros past each row's pages)."""
    r, g, w = mass.shape
    pages = torch.zeros_like(cand)
    counts = torch.empty(r, dtype=torch.int32, device=mass.device)
    _old_top_p_kernel[(r,)](
        mass, cand_counts, cand, pages, counts, float(top_p) if top_p < 1 else 3.0, w,
        mass.stride(0), mass.stride(1), cand.stride(0), pages.stride(0),
        G=g, BLOCK_G=triton.next_power_of_2(g), BLOCK=OLD_BLOCK, num_warps=4,
    )  # fmt: skip
    return pages, counts


def old_row_pages(cand, cand_counts, cols, block_table, hkv, f_cap):
    """PREVIOUS page lists of ``select_decode`` (torch ops): ``(blocks [R, K + F], num_valid [R])``."""
    dev = cand.device
    b = cols.shape[0]
    k = cand.shape[1]
    req = torch.arange(b * hkv, device=dev) // hkv
    head, tail, past = (cols[req, c].long()[:, None] for c in (HEAD, TAIL, PAST))
    cnt = cand_counts.long()[:, None]
    fcnt = torch.where(cnt > 0, head + (past - tail).clamp(min=0), 0)
    col = torch.arange(k + f_cap, device=dev)[None, :]
    f = col - cnt
    page = torch.where(col < cnt, F.pad(cand, (0, f_cap)).long(), torch.where(f < head, f, tail + f - head))
    valid = col < cnt + fcnt
    table = block_table.long()
    blocks = table[req[:, None], torch.where(valid, page, 0)].masked_fill_(~valid, -1)
    return blocks, (cnt + fcnt)[:, 0].to(torch.int32)


def old_select_decode(selector, query, layout, meta, step, policy):
    """PREVIOUS ``TwilightSelector.select_decode`` (Quest's ``max`` rule)."""
    cols = step.columns[policy]
    b = step.num_reqs
    scores = quest_decode_bounds_triton(query[:b], meta.kmin, meta.kmax, step.block_table, cols, step.page_cap)
    cand, cand_counts = old_select_top_pages(scores, cols, layout.num_kv_heads, step.select_caps[policy])
    blocks, num_valid = old_row_pages(cand, cand_counts, cols, step.block_table, layout.num_kv_heads,
                                      forced_cap(policy, N))  # fmt: skip
    mass = estimate_page_mass_rows_triton(query[:b], meta.codes, meta.scale, meta.zero, blocks, SCALE, num_valid)
    return old_top_p_select(mass, cand_counts, cand, selector.top_p)


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


class Cache:
    """A layer cache for ``reqs`` requests of ``tokens`` tokens (random keys), the Quest and
    Twilight metadata written for every token."""

    def __init__(self, reqs: int, tokens: int, seed: int):
        g = torch.Generator(device=DEV).manual_seed(seed)
        planes = MetaPlanes.for_method("twilight", HKV, N, D, DTYPE)
        pages = -(-tokens // N)
        num_blocks = reqs * pages + 16
        self.cache = torch.randn(num_blocks, HKV + planes.num_slots, N, 2 * D, device=DEV, generator=g, dtype=DTYPE)
        self.layout = PageLayout.of(self.cache, HKV, "interleaved")
        self.meta = planes.views(self.cache)
        perm = torch.randperm(num_blocks, device=DEV, generator=g)[: reqs * pages]
        self.block_table = perm.view(reqs, pages).to(torch.int32).contiguous()
        pos = torch.arange(pages * N, device=DEV)
        for r in range(reqs):
            slots = self.block_table[r, pos // N].long() * N + pos % N
            write_page_minmax(self.layout, self.cache, self.meta, slots)
            keys = self.layout.keys(self.cache)[slots // N, :, slots % N]
            write_int4_shadow(self.meta, keys, slots, N, DTYPE)
        self.pk = self.layout.page_keys(self.cache)


def graph(fn):
    """``fn`` captured in a CUDA graph: its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def kept_sets(pages, counts):
    pages, counts = pages.cpu(), counts.cpu()
    return [set(pages[r, : int(counts[r])].tolist()) for r in range(counts.numel())]


def case(timer: Timer, b: int, ctx: int, seed: int) -> dict:
    c = Cache(b, ctx + 1, seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    query = torch.randn(b, HQ, D, device=DEV, generator=g, dtype=DTYPE) * 2
    cfg = SparseConfig(method="twilight", sparse_decode=True)
    policy = cfg.for_layer(1)
    selector = make_selector(cfg, SCALE)
    step = DecodeColumns([policy], N, b, MAX_MODEL_LEN, DEV, num_kv_heads=HKV).write(np.full(b, ctx + 1), c.block_table)
    cols, meta, layout = step.columns[policy], c.meta, c.layout
    f_cap = forced_cap(policy, N)
    k_cap = step.select_caps[policy]
    r = {
        "batch": b,
        "context": ctx,
        "k_cap": k_cap,
        "f_cap": f_cap,
        "select": int(step.host_columns[policy][0, SELECT]),
    }
    t0 = time.time()

    # inputs of the parts, computed once
    scores = quest_decode_bounds_triton(query, meta.kmin, meta.kmax, step.block_table, cols, step.page_cap)
    cand, cnt = select_top_pages_triton(scores, cols, HKV, k_cap)
    blocks, num_valid = old_row_pages(cand, cnt, cols, step.block_table, HKV, f_cap)
    mass = estimate_page_mass_rows_triton(query, meta.codes, meta.scale, meta.zero, blocks, SCALE, num_valid)
    lse, _ = decode_page_lse_triton(query, meta.codes, meta.scale, meta.zero, step.block_table, cols, cand, cnt,
                                    SCALE, f_cap)  # fmt: skip
    top_p = selector.top_p

    parts = {
        "select_old": lambda: old_select_decode(selector, query, layout, meta, step, policy),
        "select_new": lambda: selector.select_decode(query, c.pk, layout, meta, step, policy),
        "quest_bounds": lambda: quest_decode_bounds_triton(
            query, meta.kmin, meta.kmax, step.block_table, cols, step.page_cap
        ),  # fmt: skip
        "quest_topk_old": lambda: old_select_top_pages(scores, cols, HKV, k_cap),
        "quest_topk_new": lambda: select_top_pages_triton(scores, cols, HKV, k_cap),
        "old_pages": lambda: old_row_pages(cand, cnt, cols, step.block_table, HKV, f_cap),
        "old_estimate": lambda: estimate_page_mass_rows_triton(
            query, meta.codes, meta.scale, meta.zero, blocks, SCALE, num_valid
        ),  # fmt: skip
        "old_top_p": lambda: old_top_p_select(mass, cnt, cand, top_p),
        "new_estimate": lambda: decode_page_lse_triton(
            query, meta.codes, meta.scale, meta.zero, step.block_table, cols, cand, cnt, SCALE, f_cap
        ),  # fmt: skip
        "new_top_p": lambda: top_p_select_triton(lse, cnt, cand, top_p, num_valid, log_mass=True),
    }
    for name, fn in parts.items():
        r[f"{name}_ms"] = timer(graph(fn))

    def variant(bp, warps, stages):
        return lambda: decode_page_lse_triton(
            query, meta.codes, meta.scale, meta.zero, step.block_table, cols, cand, cnt, SCALE, f_cap,
            block_p=bp, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    r["new_estimate_variants_ms"] = {
        f"p{bp}_w{warps}_s{stages or 'default'}": timer(graph(variant(bp, warps, stages)))
        for bp, warps, stages in VARIANTS
    }
    r["speedup_select"] = r["select_old_ms"] / r["select_new_ms"]

    # the same kept pages (up to float ties), the same estimated masses
    old_sets = kept_sets(*old_select_decode(selector, query, layout, meta, step, policy))
    new_sets = kept_sets(*selector.select_decode(query, c.pk, layout, meta, step, policy))
    diff = [len(a ^ b) for a, b in zip(old_sets, new_sets)]
    r["rows_differing"] = sum(d > 0 for d in diff)
    r["max_pages_differing"] = max(diff)
    r["kept_mean"] = float(np.mean([len(s) for s in new_sets]))
    r["candidates_mean"] = float(cnt.float().mean())
    col = torch.arange(lse.shape[2], device=DEV)[None, None, :]
    v = lse.masked_fill(col >= num_valid[:, None, None], float("-inf"))
    new_mass = torch.softmax(v * np.log(2.0), dim=-1).nan_to_num(0.0)
    r["max_mass_diff"] = float((new_mass - mass).abs().max())
    r["case_s"] = round(time.time() - t0, 1)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", default="16:16384,1:131072", help="batch:context, comma separated")
    args = ap.parse_args()
    start = time.time()
    timer = Timer(args.reps)
    results = []
    for i, spec in enumerate(args.cases.split(",")):
        b, ctx = map(int, spec.split(":"))
        results.append(case(timer, b, ctx, seed=i))
        torch.cuda.empty_cache()
    doc = {
        "benchmark": "Twilight decode selection per layer, previous vs current, Llama-3.1-8B shapes, shipped defaults",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "method": "CUDA-graph replays, CUDA events, median of reps, L2 flushed before each rep",
        "results": results,
        "total_s": round(time.time() - start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
