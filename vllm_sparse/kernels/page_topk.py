"""Triton per-row top-k of page scores with counts and ranges read on the device; twin:
``select_top_pages_reference``.

Row ``r = request * Hkv + head`` picks the ``k = columns[request, SELECT]`` best pages among its
selectable past pages ``[HEAD, TAIL)`` (``policy.decode_columns``: the forced sink and local pages
lie outside that range). Every length is read on the device and the grid is one program per row,
so the kernel captures into a CUDA graph once and replays for any lengths.

One program per row finds the k-th largest score exactly, by bisection over the scores' 32-bit
order-preserving integer keys (32 counting steps), then writes the pages above it and, in
ascending page order, as many pages equal to it as ``k`` needs. Rows asked for every selectable
page skip the bisection. The row's first ``BLOCK`` keys (up to ``REGISTER_TILE``, 8192 pages: a
128K context) stay in registers across the steps, so a step is a few instructions per key rather
than a dependent pass over memory; keys past them are re-read (L1/L2) at every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.policy import HEAD, NUM_COLUMNS, SELECT, TAIL

REGISTER_TILE = 8192  # keys a program keeps in registers


@triton.jit
def _key(x):
    """int32 keys ordered as the float32 values ``x`` are (for non-NaN values)."""
    i = x.to(tl.int32, bitcast=True)
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i)


@triton.jit
def _count_at_least(row_ptr, lo, hi, t, BLOCK: tl.constexpr):
    c = tl.zeros([BLOCK], tl.int32)
    for p0 in range(lo, hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < hi
        key = _key(tl.load(row_ptr + p, mask=m, other=0.0))
        c += ((key >= t) & m).to(tl.int32)
    return tl.sum(c)


@triton.jit(do_not_specialize=["stride_s", "stride_o"])
def _select_pages_kernel(
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
            # (the first BLOCK keys stay in registers; padding gets the NaN key -2^31, below every
            # threshold the bisection tries since k of the row's keys lie above it)
            p = lo + tl.arange(0, BLOCK)
            key0 = tl.where(p < hi, _key(tl.load(row_ptr + p, mask=p < hi, other=0.0)), -2147483648)
            t_lo = tl.full([], -2147483648, tl.int64)
            t_hi = tl.full([], 2147483648, tl.int64)
            for _ in range(32):
                mid = (t_lo + t_hi) >> 1
                n = tl.sum((key0 >= mid.to(tl.int32)).to(tl.int32))
                n += _count_at_least(row_ptr, lo + BLOCK, hi, mid, BLOCK)
                t_lo = tl.where(n >= k, mid, t_lo)
                t_hi = tl.where(n >= k, t_hi, mid)
            above = tl.sum((key0 > t_lo.to(tl.int32)).to(tl.int32))
            above += _count_at_least(row_ptr, lo + BLOCK, hi, t_lo + 1, BLOCK)
            n_above = tl.zeros([], tl.int32)
            n_equal = tl.zeros([], tl.int32)
            for p0 in range(lo, hi, BLOCK):
                p = p0 + tl.arange(0, BLOCK)
                m = p < hi
                key = _key(tl.load(row_ptr + p, mask=m, other=0.0)).to(tl.int64)
                gt = (key > t_lo) & m
                eq = (key == t_lo) & m
                pos_gt = n_above + tl.cumsum(gt.to(tl.int32), 0) - 1
                tl.store(out + pos_gt, p, mask=gt)
                pos_eq = above + n_equal + tl.cumsum(eq.to(tl.int32), 0) - 1
                tl.store(out + pos_eq, p, mask=eq & (pos_eq < k))
                n_above += tl.sum(gt.to(tl.int32))
                n_equal += tl.sum(eq.to(tl.int32))


def select_top_pages_triton(
    scores: torch.Tensor, columns: torch.Tensor, num_kv_heads: int, k_cap: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best pages of every (request, KV head) row.

    Args:
        scores: ``float32 [B * Hkv, P]`` page scores (higher is better); only ``[HEAD, TAIL)`` of
            each row is read (other entries may hold anything).
        columns: ``int32 [B, NUM_COLUMNS]`` decode columns (``policy.decode_columns``), device.
        num_kv_heads: ``Hkv``.
        k_cap: the widest selection any row can ask for (``DecodeStep.select_caps``).
    Returns:
        ``(pages int32 [B * Hkv, max(k_cap, 1)], counts int32 [B * Hkv])``: each row's first
        ``counts[row] = columns[request, SELECT]`` entries are distinct logical pages (entries past
        it are unspecified).
    """
    rows = scores.shape[0]
    out = torch.empty(rows, max(k_cap, 1), dtype=torch.int32, device=scores.device)
    counts = torch.empty(rows, dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out, counts
    assert scores.stride(-1) == 1 and columns.is_contiguous() and columns.shape[1] == NUM_COLUMNS
    block = max(128, min(triton.next_power_of_2(scores.shape[1]), REGISTER_TILE))
    _select_pages_kernel[(rows,)](
        scores, columns, out, counts, scores.stride(0), out.stride(0),
        HKV=num_kv_heads, NCOLS=NUM_COLUMNS, C_SELECT=SELECT, C_HEAD=HEAD, C_TAIL=TAIL, BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return out, counts


def select_top_pages_reference(
    scores: torch.Tensor, columns: torch.Tensor, num_kv_heads: int, k_cap: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``select_top_pages_triton`` (``torch.topk`` per row; the same set of pages
    wherever the k-th score is not tied)."""
    rows = scores.shape[0]
    out = torch.zeros(rows, max(k_cap, 1), dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    cols = columns.cpu()
    for r in range(rows):
        k, lo, hi = (int(cols[r // num_kv_heads, c]) for c in (SELECT, HEAD, TAIL))
        counts[r] = k
        if k:
            top = torch.topk(scores[r, lo:hi].float().cpu(), k).indices + lo
            out[r, :k] = top.sort().values.int()
    return out, counts
