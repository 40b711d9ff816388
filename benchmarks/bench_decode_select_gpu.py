"""GPU micro-benchmark of two decode kernels at small batches, before and after their rework.

* top-k (``kernels.page_topk``): the radix select (4 histogram passes + 1 write pass over a row),
  one program a row (``new``) and each row split over ``split_chunks`` programs (``split``, the
  default where rows are few and long), against the previous bisection (32 counting passes + 1 + 1 write pass, 4 warps per row), copied
  below unchanged so that both run in this process, on the same random page scores and decode
  columns; the JSON says whether they select the same pages.
* decode attention (``kernels.decode_attention``) over each row's 1/8 selected pages plus its forced
  pages, for the split count of the previous rule (``min(32, cdiv(2 * SMs, rows))``), of the new
  ``num_splits`` and a few fixed ones (the merge is the new one throughout).

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16, pages of 16), 128K contexts at
batch 1 (8 rows of 8192 pages) and more. Every case is captured in a CUDA graph and its replays
timed with CUDA events (median of ``--reps``, L2 flushed before each, ``gpu_timing.Timer``).

    python benchmarks/bench_decode_select_gpu.py --out FILE [--reps 50]

Prints the results as one JSON line and writes them to FILE.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import Timer, graphed

from vllm_sparse.config import SparseConfig
from vllm_sparse.decode_step import DecodeColumns
from vllm_sparse.kernels.decode_attention import decode_attention_triton, num_splits
from vllm_sparse.kernels.page_topk import select_num_warps, select_top_pages_triton, split_chunks
from vllm_sparse.kernels.paged_attention import num_sms
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import HEAD, NUM_COLUMNS, SELECT, TAIL, TOTAL

HQ, HKV, D, N = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = D**-0.5
MAX_MODEL_LEN = 131072 + 4096
TOPK_CASES = [(1, 131072), (1, 32768), (2, 131072), (4, 131072), (16, 131072), (64, 32768)]  # (batch, context)
ATTN_CASES = [(1, 131072), (8, 32768)]
FIXED_SPLITS = [16, 64, 128]

# --------------------------------------------------------------------------------------------
# PREVIOUS VERSION of the top-k kernel (bisection over the int32 keys, one program of 4 warps per
# row), copied unchanged from vllm_sparse/kernels/page_topk.py before the radix select; only the
# names carry an ``_old`` prefix. Kept here for the comparison only.
# --------------------------------------------------------------------------------------------

OLD_BLOCK = 1024


@triton.jit
def _old_key(x):
    """int32 keys ordered as the float32 values ``x`` are (for non-NaN values)."""
    i = x.to(tl.int32, bitcast=True)
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i)


@triton.jit
def _old_count_at_least(row_ptr, lo, hi, t, BLOCK: tl.constexpr):
    c = tl.zeros([BLOCK], tl.int32)
    for p0 in range(lo, hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < hi
        key = _old_key(tl.load(row_ptr + p, mask=m, other=0.0))
        c += ((key >= t) & m).to(tl.int32)
    return tl.sum(c)


@triton.jit(do_not_specialize=["stride_s", "stride_o"])
def _old_select_pages_kernel(
    scores_ptr,
    cols_ptr,
    out_ptr,
    count_ptr,
    stride_s,
    stride_o,
    HKV: tl.constexpr,
    NCOLS: tl.constexpr,
    C_SELECT: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    req = row // HKV
    k = tl.load(cols_ptr + req * NCOLS + C_SELECT)
    lo = tl.load(cols_ptr + req * NCOLS + C_HEAD)
    hi = tl.load(cols_ptr + req * NCOLS + C_TAIL)
    tl.store(count_ptr + row, k)
    if k > 0:
        row_ptr = scores_ptr + row.to(tl.int64) * stride_s
        out = out_ptr + row.to(tl.int64) * stride_o
        if k >= hi - lo:  # every selectable page
            for p0 in range(lo, hi, BLOCK):
                p = p0 + tl.arange(0, BLOCK)
                tl.store(out + (p - lo), p, mask=p < hi)
        else:
            # largest t with count(key >= t) >= k: the k-th largest key (int64 bounds, no overflow)
            t_lo = tl.full([], -2147483648, tl.int64)
            t_hi = tl.full([], 2147483648, tl.int64)
            for _ in range(32):
                mid = (t_lo + t_hi) >> 1
                enough = _old_count_at_least(row_ptr, lo, hi, mid, BLOCK) >= k
                t_lo = tl.where(enough, mid, t_lo)
                t_hi = tl.where(enough, t_hi, mid)
            above = _old_count_at_least(row_ptr, lo, hi, t_lo + 1, BLOCK)
            n_above = tl.zeros([], tl.int32)
            n_equal = tl.zeros([], tl.int32)
            for p0 in range(lo, hi, BLOCK):
                p = p0 + tl.arange(0, BLOCK)
                m = p < hi
                key = _old_key(tl.load(row_ptr + p, mask=m, other=0.0)).to(tl.int64)
                gt = (key > t_lo) & m
                eq = (key == t_lo) & m
                pos_gt = n_above + tl.cumsum(gt.to(tl.int32), 0) - 1
                tl.store(out + pos_gt, p, mask=gt)
                pos_eq = above + n_equal + tl.cumsum(eq.to(tl.int32), 0) - 1
                tl.store(out + pos_eq, p, mask=eq & (pos_eq < k))
                n_above += tl.sum(gt.to(tl.int32))
                n_equal += tl.sum(eq.to(tl.int32))


def old_select_top_pages(scores, columns, num_kv_heads, k_cap):
    """The previous ``select_top_pages_triton`` (same contract)."""
    rows = scores.shape[0]
    out = torch.empty(rows, max(k_cap, 1), dtype=torch.int32, device=scores.device)
    counts = torch.empty(rows, dtype=torch.int32, device=scores.device)
    _old_select_pages_kernel[(rows,)](
        scores, columns, out, counts, scores.stride(0), out.stride(0),
        HKV=num_kv_heads, NCOLS=NUM_COLUMNS, C_SELECT=SELECT, C_HEAD=HEAD, C_TAIL=TAIL, BLOCK=OLD_BLOCK,
        num_warps=4,
    )  # fmt: skip
    return out, counts


# --------------------------------------------------------------------------------------------
# end of the previous version
# --------------------------------------------------------------------------------------------


def decode_step(batch: int, context: int, fraction: float = 0.125, ordered: bool = False):
    """Quest decode columns (``fraction`` of the context, sink 16, local 512) of ``batch`` requests
    of ``context`` past tokens, over a random block table of ``context + 1`` tokens per request
    (``ordered``: blocks in order, consecutive logical pages consecutive in memory)."""
    policy = SparseConfig(method="quest", dense_below_tokens=0, sparse_decode=True, sink_tokens=16, local_tokens=512,
                          budget={"fraction": fraction, "min_tokens": 16, "max_tokens": None}).for_layer(1)  # fmt: skip
    pages = -(-(context + 1) // N)
    num_blocks = batch * pages + 16
    perm = torch.arange(num_blocks, device="cuda") if ordered else torch.randperm(num_blocks, device="cuda")
    table = perm[: batch * pages].view(batch, pages).int()
    step = DecodeColumns([policy], N, batch, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV).write(
        np.full(batch, context + 1), table
    )
    return policy, step, num_blocks


def same_selection(a, b, counts) -> bool:
    k = int(counts.max())
    a, b = a[:, :k].sort(dim=1).values, b[:, :k].sort(dim=1).values
    keep = torch.arange(k, device=a.device)[None, :] < counts[:, None]
    return bool(torch.equal(torch.where(keep, a, 0), torch.where(keep, b, 0)))


def topk_case(timer, batch: int, context: int) -> dict:
    policy, step, _ = decode_step(batch, context)
    cols, k_cap = step.columns[policy], step.select_caps[policy]
    rows = batch * HKV
    scores = torch.randn(rows, step.page_cap, device="cuda")  # Quest bounds: continuous, no ties
    state = {}

    def new():
        state["new"] = select_top_pages_triton(scores, cols, HKV, k_cap, chunks=1)

    def split():
        state["split"] = select_top_pages_triton(scores, cols, HKV, k_cap, counters=step.topk_counters)

    def old():
        state["old"] = old_select_top_pages(scores, cols, HKV, k_cap)

    r = {"batch": batch, "context": context, "rows": rows, "page_cap": step.page_cap,
         "selectable": int(step.host_columns[policy][0, TAIL] - step.host_columns[policy][0, HEAD]),
         "k": int(step.host_columns[policy][0, SELECT]), "new_num_warps": select_num_warps(step.page_cap, batch * HKV),
         "split_chunks": split_chunks(step.page_cap, rows, num_sms(scores.device))}  # fmt: skip
    r["old_ms"] = timer(graphed(old))
    r["new_ms"] = timer(graphed(new))
    r["split_ms"] = timer(graphed(split))
    r["speedup"] = r["old_ms"] / r["new_ms"]
    r["split_speedup"] = r["new_ms"] / r["split_ms"]
    r["same_selection"] = same_selection(state["new"][0], state["old"][0], state["new"][1])
    r["split_same_selection"] = same_selection(state["split"][0], state["new"][0], state["new"][1])
    print(json.dumps(r), flush=True)
    return r


def attention_case(timer, batch: int, context: int) -> dict:
    policy, step, num_blocks = decode_step(batch, context)
    cols = step.columns[policy]
    rows = batch * HKV
    cache = torch.randn(num_blocks, HKV, N, 2 * D, device="cuda", dtype=DTYPE)
    layout = PageLayout.of(cache, HKV, "interleaved")
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    scores = torch.randn(rows, step.page_cap, device="cuda")
    pages, counts = select_top_pages_triton(
        scores, cols, HKV, step.select_caps[policy], counters=step.topk_counters
    )  # random 1/8
    query = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(query)
    host = step.host_columns[policy][0]
    attended = int(host[SELECT] + host[HEAD] + host[TOTAL] - host[TAIL])  # pages per row
    kv_bytes = rows * attended * N * D * 2 * cache.element_size()
    sms = num_sms(query.device)
    variants = {"old_rule": max(1, min(32, -(-2 * sms // rows))), "new_rule": num_splits(rows, query.device)}
    variants.update({f"fixed_{s}": s for s in FIXED_SPLITS})
    r = {"batch": batch, "context": context, "rows": rows, "pages_per_row": attended, "kv_mib": kv_bytes / 2**20}
    for name, splits in variants.items():

        def attend(splits=splits):
            decode_attention_triton(query, pk, pv, step.block_table, pages, counts, cols, layout.num_head_slots,
                                    SCALE, out, splits)  # fmt: skip

        ms = timer(graphed(attend))
        r[name] = {"splits": splits, "ms": ms, "gb_per_s": kv_bytes / ms / 1e6}
    r["speedup"] = r["old_rule"]["ms"] / r["new_rule"]["ms"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    timer = Timer(args.reps)
    res = {
        "bench": "decode_select_gpu",
        "device": torch.cuda.get_device_name(),
        "sms": num_sms(torch.device("cuda")),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "method": "CUDA-graph replays, CUDA events, median of reps, L2 flushed before each rep",
        "reps": args.reps,
        "topk": [topk_case(timer, b, ctx) for b, ctx in TOPK_CASES],
        "attention": [attention_case(timer, b, ctx) for b, ctx in ATTN_CASES],
    }
    res["seconds"] = round(time.time() - t0, 1)
    line = json.dumps(res)
    print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(line + "\n")


if __name__ == "__main__":
    main()
