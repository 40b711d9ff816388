"""Kascade's anchor scoring for decode rows, every length read on the device (CUDA-graph safe).

A decode token is a prefill tile of one (``kernels.anchor_mass``): for each (request, KV head) row,
the softmax of each of the group's ``G`` query heads over the ``ctx = seq_len - 1`` keys before the
token, averaged over the heads and summed per complete past page (``PAST = ctx // N`` pages).

One pass over the keys, read in place from the paged cache with the lengths taken from the decode
columns (``policy.decode_columns``), then a light pass over per-page numbers:

1. ``programs`` shares per row; per page and head the log-sum-exp of the page's scores
   ``l[p, h] = log sum_{t in p} exp(s_t)`` (into a persistent ``float32 [rows, G, P]`` workspace) and
   per share and head the log-sum-exp over the share's keys;
2. per row and head ``LSE_h`` from the shares, and per past page the pooled mass
   ``mean_h exp(l[p, h] - LSE_h)``, written over the workspace's head-0 plane (the same program
   reads a page's ``G`` numbers before it writes the page's mass there).

``exp(l[p, h] - LSE_h)`` is exactly the page's softmax weight, so this equals two passes over the
keys (log-sum-exp first, then the weights) and reads them once. The mass is what the layers up to
the next anchor select from (``DecodeStep.anchor``). The torch twin is ``anchor_decode_mass``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.anchor_mass import anchor_page_mass
from vllm_sparse.kernels.decode_rows import programs_per_row

POOL_PAGES = 256  # pages per tile of pass 2 (G numbers each)


@triton.jit
def _row_context(cols_ptr, req, NCOLS: tl.constexpr, C_TOTAL: tl.constexpr, C_LAST: tl.constexpr, N: tl.constexpr):
    """``ctx``: the keys before the row's decode token (0 for padding rows, ``seq_len = 0``)."""
    total = tl.load(cols_ptr + req * NCOLS + C_TOTAL)
    last = tl.load(cols_ptr + req * NCOLS + C_LAST)
    return tl.maximum((total - 1) * N + last - 1, 0)


@triton.jit
def _group_query(q_ptr, keys_ptr, req, kv, stride_qt, stride_qh, G: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, LOW_PRECISION: tl.constexpr):  # fmt: skip
    """The group's ``G`` query heads ``[BLOCK_M, BLOCK_D]`` (zero past ``G``) and their mask; in the
    cache's dtype with ``LOW_PRECISION`` (CUDA: 16-bit products), else float32 (the interpreter)."""
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    rm = r < G
    ptr = q_ptr + req.to(tl.int64) * stride_qt + (kv * G + r)[:, None] * stride_qh + d[None, :]
    qb = tl.load(ptr, mask=rm[:, None] & (d[None, :] < D), other=0.0)
    if LOW_PRECISION:
        qb = qb.to(keys_ptr.dtype.element_ty)
    else:
        qb = qb.to(tl.float32)
    return qb, rm


@triton.jit
def _keys_t(keys_ptr, bt_ptr, req, kv, p0, end, stride_bt, stride_kp, stride_kt, head_slots,
            N: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Keys ``[BLOCK_D, BLOCK_P * N]`` (transposed) of logical pages ``p0 ..`` (zero from ``end``)."""
    j = tl.arange(0, BLOCK_P * N)
    p = p0 + j // N
    pm = p < end
    blk = tl.load(bt_ptr + req.to(tl.int64) * stride_bt + p, mask=pm, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ptr = keys_ptr + (blk * head_slots + kv)[None, :] * stride_kp + (j % N)[None, :] * stride_kt + d[:, None]
    return tl.load(ptr, mask=pm[None, :] & (d[:, None] < D), other=0.0), j


@triton.jit(do_not_specialize=["head_slots", "stride_wr", "stride_wh"])
def _anchor_decode_pages_kernel(
    q_ptr, keys_ptr, bt_ptr, cols_ptr, part_ptr, work_ptr, scale, head_slots,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_bt, stride_wr, stride_wh,
    HKV: tl.constexpr, G: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, NCOLS: tl.constexpr, C_TOTAL: tl.constexpr,
    C_LAST: tl.constexpr, LOW_PRECISION: tl.constexpr,
):  # fmt: skip
    """Pass 1, grid ``(rows, S)``: for this program's share of the row's ``ctx`` keys,
    ``work [rows, G, P]`` the log-sum-exp of each page's scores per head (``-inf`` for a page with no
    key before the token) and ``part [rows, S, BLOCK_M]`` the share's log-sum-exp per head."""
    row = tl.program_id(0)
    req = row // HKV
    kv = row % HKV
    ctx = _row_context(cols_ptr, req, NCOLS, C_TOTAL, C_LAST, N)
    pages = tl.cdiv(ctx, N)
    share = tl.cdiv(tl.cdiv(pages, tl.num_programs(1)), BLOCK_P) * BLOCK_P
    start = tl.program_id(1) * share
    end = tl.minimum(pages, start + share)
    qb, rm = _group_query(q_ptr, keys_ptr, req, kv, stride_qt, stride_qh, G, D, BLOCK_M, BLOCK_D, LOW_PRECISION)
    work_row = work_ptr + row.to(tl.int64) * stride_wr + tl.arange(0, BLOCK_M)[:, None] * stride_wh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for p0 in range(start, end, BLOCK_P):
        kt, j = _keys_t(keys_ptr, bt_ptr, req, kv, p0, end, stride_bt, stride_kp, stride_kt, head_slots,
                        N, D, BLOCK_P, BLOCK_D)  # fmt: skip
        s = tl.dot(qb, kt.to(qb.dtype), out_dtype=tl.float32) * scale  # [BLOCK_M, BLOCK_P * N]
        s = tl.where((p0 * N + j < ctx)[None, :], s, float("-inf"))
        s3 = tl.reshape(s, [BLOCK_M, BLOCK_P, N])
        pm = tl.max(s3, 2)  # [BLOCK_M, BLOCK_P]
        pm_safe = tl.where(pm == float("-inf"), 0.0, pm)
        ps = tl.sum(tl.exp(s3 - pm_safe[:, :, None]), 2)
        page_lse = tl.where(ps > 0, pm_safe + tl.log(ps), float("-inf"))
        page = p0 + tl.arange(0, BLOCK_P)
        tl.store(work_row + page[None, :], page_lse, mask=rm[:, None] & (page < end)[None, :])
        m_new = tl.maximum(m_i, tl.max(page_lse, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - safe) + tl.sum(tl.exp(page_lse - safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    out = part_ptr + (row.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * BLOCK_M
    tl.store(out + tl.arange(0, BLOCK_M), lse)


@triton.jit(do_not_specialize=["shares", "stride_wr", "stride_wh"])
def _anchor_decode_pool_kernel(
    cols_ptr, part_ptr, work_ptr, shares, stride_wr, stride_wh,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_Q: tl.constexpr, NCOLS: tl.constexpr, C_PAST: tl.constexpr,
):  # fmt: skip
    """Pass 2, grid ``(rows, S2)``: ``LSE_h`` of the row from its ``shares`` partial log-sum-exps,
    then for this program's share of the row's ``PAST`` pages the mean over the group's heads of
    ``exp(work[row, h, p] - LSE_h)``, written to ``work[row, 0, p]``."""
    row = tl.program_id(0)
    req = row // HKV
    past = tl.load(cols_ptr + req * NCOLS + C_PAST)
    h = tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for s0 in range(0, shares, BLOCK_S):
        sh = s0 + tl.arange(0, BLOCK_S)
        part = tl.load(part_ptr + (row.to(tl.int64) * shares + sh[:, None]) * BLOCK_M + h[None, :],
                       mask=(sh < shares)[:, None], other=float("-inf"))  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(part, 0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - safe) + tl.sum(tl.exp(part - safe[None, :]), 0)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    rm = h < G
    lse = tl.where(rm, lse, float("inf"))  # heads past G weigh exp(-inf) = 0
    share = tl.cdiv(tl.cdiv(past, tl.num_programs(1)), BLOCK_Q) * BLOCK_Q
    start = tl.program_id(1) * share
    end = tl.minimum(past, start + share)
    work_row = work_ptr + row.to(tl.int64) * stride_wr
    for p0 in range(start, end, BLOCK_Q):
        page = p0 + tl.arange(0, BLOCK_Q)
        pmask = page < end
        page_lse = tl.load(work_row + h[:, None] * stride_wh + page[None, :], mask=rm[:, None] & pmask[None, :],
                           other=float("-inf"))  # fmt: skip
        mass = tl.sum(tl.exp(page_lse - lse[:, None]), 0) / G
        tl.store(work_row + page, mass, mask=pmask)


def anchor_decode_mass_triton(
    query: torch.Tensor,
    page_keys: torch.Tensor,
    block_table: torch.Tensor,
    columns: torch.Tensor,
    num_kv_heads: int,
    head_slots: int,
    scale: float,
    work: torch.Tensor,
    programs: int | None = None,
    block_keys: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Kascade's anchor mass of every decode row, lengths read on the device, one read of the keys.

    Args:
        query: ``[B, Hq, D]`` one token per decode request (last dim contiguous).
        page_keys: ``[num_pages, N, D]`` keys by physical page id (strided view).
        block_table: ``int32 [B, max_blocks]``; columns: ``int32 [B, NUM_COLUMNS]`` (any policy's:
            only ``TOTAL``, ``LAST`` and ``PAST`` are read, which every policy shares).
        head_slots: head slots per block (page id ``block * head_slots + head``).
        work: ``float32 [>= B * Hkv, >= G, P]`` a persistent workspace (last dim contiguous): the
            pages' per-head log-sum-exps, then the mass over its head-0 plane.
        programs: programs per row of the pass over the keys (default ``programs_per_row``).
        block_keys, num_warps: keys per iteration of that pass (whole pages) and its warps.
    Returns:
        ``work[:B * Hkv, 0]`` (``float32 [B * Hkv, P]``, a view): per row the mass of each past page
        ``[0, PAST)`` (entries past it are unspecified); equals ``anchor_decode_mass`` there up to
        rounding.
    """
    from vllm_sparse.policy import LAST, NUM_COLUMNS, PAST, TOTAL

    b, hq, d = query.shape
    rows = b * num_kv_heads
    g = hq // num_kv_heads
    res = work[:rows, 0]
    if rows == 0:
        return res
    assert query.stride(-1) == 1 and page_keys.stride(-1) == 1 and block_table.stride(-1) == 1
    assert work.dim() == 3 and work.shape[1] >= g and work.stride(-1) == 1 and work.dtype == torch.float32
    n = page_keys.shape[1]
    block_m = max(16, triton.next_power_of_2(g))
    block_p = max(1, block_keys // n)
    page_cap = work.shape[2]
    progs = programs or programs_per_row(rows, page_cap, block_p, query.device)
    low = query.is_cuda
    part = torch.empty(rows, progs, block_m, dtype=torch.float32, device=query.device)
    _anchor_decode_pages_kernel[(rows, progs)](
        query, page_keys, block_table, columns, part, work, scale, head_slots,
        query.stride(0), query.stride(1), page_keys.stride(0), page_keys.stride(1), block_table.stride(0),
        work.stride(0), work.stride(1),
        HKV=num_kv_heads, G=g, N=n, D=d, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(d), BLOCK_P=block_p,
        NCOLS=NUM_COLUMNS, C_TOTAL=TOTAL, C_LAST=LAST, LOW_PRECISION=low, num_warps=num_warps,
    )  # fmt: skip
    block_q = min(POOL_PAGES, triton.next_power_of_2(page_cap))
    _anchor_decode_pool_kernel[(rows, programs_per_row(rows, page_cap, block_q, query.device))](
        columns, part, work, progs, work.stride(0), work.stride(1),
        HKV=num_kv_heads, G=g, BLOCK_M=block_m, BLOCK_S=min(64, triton.next_power_of_2(progs)), BLOCK_Q=block_q,
        NCOLS=NUM_COLUMNS, C_PAST=PAST, num_warps=4,
    )  # fmt: skip
    return res


def anchor_decode_mass(
    query: torch.Tensor,
    page_keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    num_kv_heads: int,
    head_slots: int,
    scale: float,
    page_cap: int,
) -> torch.Tensor:
    """Torch twin of ``anchor_decode_mass_triton``: ``float32 [B * Hkv, page_cap]``, row
    ``b * Hkv + h`` = ``anchor_page_mass`` of request ``b``'s token (zeros past its ``PAST``)."""
    n = page_keys.shape[1]
    out = torch.zeros(len(seq_lens) * num_kv_heads, page_cap, dtype=torch.float32, device=query.device)
    heads = torch.arange(num_kv_heads, device=query.device)
    for b, seq in enumerate(seq_lens):
        ctx = max(int(seq) - 1, 0)
        if ctx < n:
            continue
        pages = -(-ctx // n)
        ids = block_table[b, :pages].long()[None, :] * head_slots + heads[:, None]  # [Hkv, pages]
        mass = anchor_page_mass(query[b : b + 1], page_keys, ids, ctx, scale, tile=1)
        out[b * num_kv_heads : (b + 1) * num_kv_heads, : mass.shape[1]] = mass
    return out
