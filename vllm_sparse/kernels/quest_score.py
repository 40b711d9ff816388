"""Triton Quest page bounds; twins: ``vllm_sparse.selectors.quest.page_upper_bounds`` (one request)
and ``vllm_sparse.selectors.quest.page_upper_bounds_rows`` (decode rows of many requests).

For every query head and past page, ``U = max_c sum_d max(q[c,d] * kmax[d], q[c,d] * kmin[d])``
computed as ``q+ . kmax + q- . kmin`` (two matrix products per tile of queries and pages), with
``kmin``/``kmax`` read in place from the metadata planes through the pages' physical blocks.

One program scores a tile of pages of one row, a row being one (slot, KV head) pair: a slot is a
request (its queries start at ``tokens[slot]``, its pages are ``blocks[slot]``), so a single
launch scores every decode request of a step. The program loads its page summaries once, then,
for each head of the GQA group, runs over the row's queries in tiles, keeping an elementwise
running max of the tiles' bounds that it reduces over the queries once per head (no reduction
per tile). The GQA reduction and the top-k (rank merges included) stay in torch (``selectors.quest``).

Decode rows have a kernel of their own below, whose row loop (``quest_rows.quest_row_bounds``) the
top-k kernel also runs where it ranks one row per program: there Quest's decode selection is one
launch (``kernels.page_topk``, ``quest=``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.decode_rows import programs_per_row, selectable_share
from vllm_sparse.kernels.quest_rows import QuestRows, quest_row_bounds


@triton.jit(do_not_specialize=["num_queries", "num_pages", "stride_bs"])
def _quest_bounds_kernel(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    blocks_ptr,
    tokens_ptr,
    npages_ptr,
    out_ptr,
    num_queries,
    num_pages,
    num_kv_heads,
    stride_qc,
    stride_qh,
    stride_bs,
    stride_mb,
    stride_mh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_TOKENS: tl.constexpr,
    HAS_NPAGES: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)  # (slot, KV head)
    slot = row // num_kv_heads
    kv = row % num_kv_heads
    tok0 = 0
    if HAS_TOKENS:
        tok0 = tl.load(tokens_ptr + slot).to(tl.int64)
    row_pages = num_pages
    if HAS_NPAGES:
        row_pages = tl.load(npages_ptr + slot)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < row_pages  # the row's own pages (padding is neither read nor scored)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    blk = tl.load(blocks_ptr + slot.to(tl.int64) * stride_bs + p, mask=pm, other=0).to(tl.int64)
    moff = blk[:, None] * stride_mb + kv * stride_mh + d[None, :]
    kmax = tl.load(kmax_ptr + moff, mask=pm[:, None] & dm[None, :], other=0.0)  # [BLOCK_P, BLOCK_D]
    kmin = tl.load(kmin_ptr + moff, mask=pm[:, None] & dm[None, :], other=0.0)
    if not LOW_PRECISION:
        kmax = kmax.to(tl.float32)
        kmin = kmin.to(tl.float32)
    gi = tl.arange(0, BLOCK_G)
    best = tl.full([BLOCK_G, BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        # an elementwise running max over the query tiles of head g, reduced over queries once
        run = tl.full([BLOCK_Q, BLOCK_P], float("-inf"), tl.float32)
        for c0 in range(0, num_queries, BLOCK_Q):
            c = c0 + tl.arange(0, BLOCK_Q)
            qm = c < num_queries
            q = tl.load(
                q_ptr + (tok0 + c[:, None].to(tl.int64)) * stride_qc + (kv * G + g) * stride_qh + d[None, :],
                mask=qm[:, None] & dm[None, :],
                other=0.0,
            )
            if LOW_PRECISION:  # 16-bit operands: exact products, float32 sums
                u = tl.dot(tl.maximum(q, 0.0).to(kmax.dtype), tl.trans(kmax))
                u += tl.dot(tl.minimum(q, 0.0).to(kmin.dtype), tl.trans(kmin))
            else:
                q = q.to(tl.float32)
                u = tl.dot(tl.maximum(q, 0.0), tl.trans(kmax), input_precision="ieee")
                u += tl.dot(tl.minimum(q, 0.0), tl.trans(kmin), input_precision="ieee")
            run = tl.maximum(run, tl.where(qm[:, None], u, float("-inf")))
        best = tl.where(gi[:, None] == g, tl.max(run, axis=0)[None, :], best)
    best = tl.where(pm[None, :], best, float("-inf"))
    out = out_ptr + row.to(tl.int64) * G * num_pages + gi[:, None] * num_pages + p[None, :]
    tl.store(out, best, mask=(gi[:, None] < G) & (p[None, :] < num_pages))


def _launch(q, kmin, kmax, blocks, tokens, npages, num_slots, num_queries, hkv, out):
    hq, d = q.shape[1], q.shape[2]
    g = hq // hkv
    p = blocks.shape[-1]
    assert q.stride(-1) == 1 and kmin.stride(-1) == 1 and kmax.stride(-1) == 1
    assert kmin.stride() == kmax.stride() and blocks.stride(-1) == 1
    # 16-bit operands on the GPU (Triton's interpreter multiplies 16-bit dots wrongly; the products
    # are exact either way, so both paths compute the same bounds)
    low = q.is_cuda and q.dtype == kmin.dtype and q.dtype in (torch.bfloat16, torch.float16)
    # queries of one head per tile; wider page tiles for long contexts (at 8192 queries x 7680
    # pages on an H100: 64 x 128 tiles 2.05 ms, 64 x 64 2.72 ms, 128 x 128 2.25 ms)
    block_q = 16 if num_queries <= 16 else 64
    block_p = 128 if p > 1024 else 64 if p > 32 else 32
    _quest_bounds_kernel[(num_slots * hkv, triton.cdiv(p, block_p))](
        q,
        kmin,
        kmax,
        blocks,
        tokens if tokens is not None else blocks,
        npages if npages is not None else blocks,
        out,
        num_queries,
        p,
        hkv,
        q.stride(0),
        q.stride(1),
        blocks.stride(0) if blocks.dim() == 2 else 0,
        kmin.stride(0),
        kmin.stride(1),
        G=g,
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_G=triton.next_power_of_2(g),
        BLOCK_Q=block_q,
        BLOCK_P=block_p,
        HAS_TOKENS=tokens is not None,
        HAS_NPAGES=npages is not None,
        LOW_PRECISION=low,
        num_warps=4,
        num_stages=3,
    )
    return out


def page_upper_bounds_triton(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor
) -> torch.Tensor:
    """Quest bounds of every query head of one request for pages read in place.

    Args:
        q: ``[C, Hq, D]`` the chunk's queries (a strided view is fine; last dim contiguous).
        kmin, kmax: ``[num_blocks, Hkv, D]`` the metadata planes (``PageMeta.kmin/kmax``).
        blocks: ``int [P]`` physical block of each past page (shared by the KV heads).
    Returns:
        ``float32 [Hkv, G, P]``; equals ``page_upper_bounds(q, kmin[blocks].transpose(0, 1), ...)``.
    """
    c, hq, _ = q.shape
    hkv = kmin.shape[1]
    p = blocks.shape[0]
    out = torch.empty(hkv, hq // hkv, p, dtype=torch.float32, device=q.device)
    if p == 0 or c == 0:
        return out.fill_(float("-inf"))
    return _launch(q, kmin, kmax, blocks.contiguous(), None, None, 1, c, hkv, out)


def page_upper_bounds_rows_triton(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    tokens: torch.Tensor,
    blocks: torch.Tensor,
    num_pages: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quest bounds of many requests' decode queries in one launch.

    Args:
        query: ``[T, Hq, D]`` the step's queries (last dim contiguous).
        kmin, kmax: ``[num_blocks, Hkv, D]`` the metadata planes.
        tokens: ``int [S]`` query token of each slot (request).
        blocks: ``int [S, P]`` physical block of each past page of each slot (padded).
        num_pages: ``int [S]`` valid pages per slot (bounds past it are ``-inf``, never read);
            ``None``: all ``P``.
    Returns:
        ``float32 [S * Hkv, G, P]``, row ``slot * Hkv + kv_head``; equals
        ``page_upper_bounds_rows(query[tokens], kmin, kmax, blocks)`` on the valid pages.
    """
    s, p = blocks.shape
    hkv = kmin.shape[1]
    out = torch.empty(s * hkv, query.shape[1] // hkv, p, dtype=torch.float32, device=query.device)
    if p == 0 or s == 0:
        return out.fill_(float("-inf"))
    return _launch(query, kmin, kmax, blocks.contiguous(), tokens.contiguous(), num_pages, s, 1, hkv, out)


# ---------------------------------------------------------------------------------------------
# Decode rows, every length read on the device (CUDA-graph safe)
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_or", "stride_og"])
def _quest_decode_bounds_kernel(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    bt_ptr,
    cols_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_mb,
    stride_mh,
    scale_ptr,
    stride_sb,
    stride_sh,
    stride_or,
    stride_og,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    REDUCE_MAX: tl.constexpr,
    NCOLS: tl.constexpr,
    C_SELECT: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
):
    row = tl.program_id(0)
    req = row // HKV
    start, end = selectable_share(cols_ptr, req, NCOLS, C_SELECT, C_HEAD, C_TAIL, BLOCK_P)
    quest_row_bounds(
        q_ptr, kmin_ptr, kmax_ptr, bt_ptr, out_ptr + row.to(tl.int64) * stride_or, req, row % HKV, start, end,
        stride_qt, stride_qh, stride_bt, stride_mb, stride_mh, scale_ptr, stride_sb, stride_sh, stride_og, G, BLOCK_G,
        D, BLOCK_D, BLOCK_P, REDUCE_MAX, LOW_PRECISION, SCALED,
    )  # fmt: skip


def quest_decode_bounds_triton(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    columns: torch.Tensor,
    page_cap: int,
    reduce_max: bool = True,
    programs: int | None = None,
    block_p: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quest bounds of every decode row over its selectable pages, lengths read on the device.

    Args:
        query: ``[B, Hq, D]`` one token per decode request (last dim contiguous).
        kmin, kmax: ``[num_blocks, Hkv, D]`` the metadata planes.
        block_table: ``int32 [B, max_blocks]``.
        columns: ``int32 [B, NUM_COLUMNS]`` decode columns (rows with ``SELECT = 0`` are skipped).
        page_cap: ``P`` the width of the result (at least every request's past pages).
        reduce_max: max over the G query heads of each row (the ``max`` GQA rule) in the kernel.
        programs, block_p, num_warps, num_stages: programs per row (None: ``programs_per_row``),
            pages per tile, warps and pipeline stages (None: Triton's default).
        scale: ``[num_blocks, Hkv]`` with ``int8`` planes (``QuestRows.scale``).
    Returns:
        ``float32 [B * Hkv, P]`` (``reduce_max``) or ``[B * Hkv, G, P]``; only the columns
        ``[HEAD, TAIL)`` of rows that select are written (the rest is unspecified). Row by row
        what ``page_upper_bounds(query[b:b+1], ...)`` gives for those pages.
    """
    from vllm_sparse.policy import HEAD, NUM_COLUMNS, SELECT, TAIL

    b, hq, _ = query.shape
    hkv = kmin.shape[1]
    g = hq // hkv
    rows = b * hkv
    shape = (rows, page_cap) if reduce_max else (rows, g, page_cap)
    out = torch.empty(shape, dtype=torch.float32, device=query.device)
    if rows == 0:
        return out
    assert columns.is_contiguous()
    progs = programs or programs_per_row(rows, page_cap, block_p, query.device)
    quest = QuestRows(query, kmin, kmax, block_table, scale)
    _quest_decode_bounds_kernel[(rows, progs)](
        *quest.args()[:4], columns, out, *quest.args()[4:], out.stride(0), 0 if reduce_max else out.stride(1),
        HKV=hkv, BLOCK_P=block_p, REDUCE_MAX=reduce_max, NCOLS=NUM_COLUMNS, C_SELECT=SELECT, C_HEAD=HEAD, C_TAIL=TAIL,
        num_warps=num_warps, **quest.constants(), **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    return out
