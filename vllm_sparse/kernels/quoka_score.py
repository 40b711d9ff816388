"""Triton QuoKA page scoring; twin: ``vllm_sparse.selectors.quoka.score_pages``.

A page's score is the max over the grouped queries and over the page's tokens of the cosine
between query and key. Since ``||k|| > 0`` divides every query's dot product alike,
``max_i (q_i . k) / ||k||`` is computed as one matrix product, a max over queries, then one
division per token: the keys are read once, in place, through the physical page ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.decode_rows import programs_per_row, selectable_share


@triton.jit(do_not_specialize=["num_queries", "num_pages", "stride_qh", "stride_ih", "stride_oh"])
def _score_pages_kernel(
    q_ptr,
    keys_ptr,
    ids_ptr,
    out_ptr,
    num_queries,
    num_pages,
    stride_qh,
    stride_qn,
    stride_kp,
    stride_kt,
    stride_ih,
    stride_oh,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    h = tl.program_id(0)
    p0 = tl.program_id(1) * BLOCK_P
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qi = tl.arange(0, BLOCK_Q)
    q = tl.load(
        q_ptr + h * stride_qh + qi[:, None] * stride_qn + d[None, :],
        mask=(qi[:, None] < num_queries) & dm[None, :],
        other=0.0,
    )  # [BLOCK_Q, BLOCK_D] float32
    r = tl.arange(0, BLOCK_P * PAGE)  # token rows of BLOCK_P pages
    p = p0 + r // PAGE
    pm = p < num_pages
    page = tl.load(ids_ptr + h * stride_ih + p, mask=pm, other=0).to(tl.int64)
    k = tl.load(
        keys_ptr + page[:, None] * stride_kp + (r % PAGE)[:, None] * stride_kt + d[None, :],
        mask=pm[:, None] & dm[None, :],
        other=0.0,
    )  # [R, BLOCK_D] cache dtype
    kf = k.to(tl.float32)
    dots = tl.dot(q, tl.trans(kf))  # [BLOCK_Q, R] float32 (tf32 on the GPU)
    dots = tl.where(qi[:, None] < num_queries, dots, float("-inf"))
    best = tl.max(dots, axis=0)  # [R]
    norm = tl.maximum(tl.sqrt(tl.sum(kf * kf, axis=1)), 1e-12)
    cos = tl.reshape(best / norm, (BLOCK_P, PAGE))
    score = tl.max(cos, axis=1)  # [BLOCK_P]
    po = p0 + tl.arange(0, BLOCK_P)
    tl.store(out_ptr + h * stride_oh + po, score, mask=po < num_pages)


def score_pages_triton(qbar: torch.Tensor, page_keys: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Page scores of grouped queries against pages read in place by physical id.

    Args:
        qbar: ``float32 [Hkv, nq, D]`` grouped unit queries (``selectors.quoka.group_query``).
        page_keys: ``[num_pages_total, N, D]`` keys by physical page id (``PageLayout.page_keys``;
            a strided view, last dim contiguous).
        page_ids: ``int [Hkv, P]`` physical pages to score per KV head.
    Returns:
        ``float32 [Hkv, P]``: ``max`` over queries and the page's tokens of the cosine; equals
        ``score_pages(qbar, page_keys[page_ids])``.
    """
    hkv, nq, d = qbar.shape
    p = page_ids.shape[1]
    n = page_keys.shape[1]
    out = torch.empty(hkv, p, dtype=torch.float32, device=qbar.device)
    if p == 0:
        return out
    qbar = qbar.float().contiguous()
    assert page_keys.stride(-1) == 1 and page_ids.stride(-1) == 1
    # two query-tile sizes only (compiled at start, vllm_sparse.warmup): up to 16, else up to the config's count
    block_q = 16 if nq <= 16 else max(64, triton.next_power_of_2(nq))
    block_p = max(1, 128 // n)
    _score_pages_kernel[(hkv, triton.cdiv(p, block_p))](
        qbar,
        page_keys,
        page_ids,
        out,
        nq,
        p,
        qbar.stride(0),
        qbar.stride(1),
        page_keys.stride(0),
        page_keys.stride(1),
        page_ids.stride(0),
        out.stride(0),
        PAGE=n,
        D=d,
        BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_P=block_p,
        num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Decode rows, every length read on the device (CUDA-graph safe)
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_o"])
def _quoka_decode_score_kernel(
    q_ptr,
    keys_ptr,
    bt_ptr,
    cols_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_bt,
    stride_o,
    head_slots,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    NCOLS: tl.constexpr,
    C_SELECT: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
):
    row = tl.program_id(0)
    req = row // HKV
    kv = row % HKV
    start, end = selectable_share(cols_ptr, req, NCOLS, C_SELECT, C_HEAD, C_TAIL, BLOCK_P)
    # the group's query: mean over its G heads of the unit queries (selectors.quoka.group_query)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + req.to(tl.int64) * stride_qt + (kv * G + g)[:, None] * stride_qh + d[None, :],
        mask=(g < G)[:, None] & dm[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=1)), 1e-12)[:, None]
    qbar = tl.sum(q, axis=0) / G  # [BLOCK_D]
    r = tl.arange(0, BLOCK_P * PAGE)
    out_row = out_ptr + row.to(tl.int64) * stride_o
    for p0 in range(start, end, BLOCK_P):
        p = p0 + r // PAGE
        pm = p < end
        blk = tl.load(bt_ptr + req.to(tl.int64) * stride_bt + p, mask=pm, other=0).to(tl.int64)
        page = blk * head_slots + kv
        k = tl.load(
            keys_ptr + page[:, None] * stride_kp + (r % PAGE)[:, None] * stride_kt + d[None, :],
            mask=pm[:, None] & dm[None, :],
            other=0.0,
        ).to(tl.float32)
        dots = tl.sum(k * qbar[None, :], axis=1)
        cos = dots / tl.maximum(tl.sqrt(tl.sum(k * k, axis=1)), 1e-12)
        score = tl.max(tl.reshape(cos, (BLOCK_P, PAGE)), axis=1)
        po = p0 + tl.arange(0, BLOCK_P)
        tl.store(out_row + po, score, mask=po < end)


def quoka_decode_scores_triton(
    query: torch.Tensor,
    page_keys: torch.Tensor,
    block_table: torch.Tensor,
    columns: torch.Tensor,
    num_kv_heads: int,
    head_slots: int,
    page_cap: int,
) -> torch.Tensor:
    """QuoKA page scores of every decode row over its selectable pages, lengths read on the device.

    Args:
        query: ``[B, Hq, D]`` one token per decode request (last dim contiguous).
        page_keys: ``[num_pages, N, D]`` keys by physical page id (strided view).
        block_table: ``int32 [B, max_blocks]``; columns: ``int32 [B, NUM_COLUMNS]``.
        head_slots: head slots per block (page id ``block * head_slots + head``).
        page_cap: ``P`` the width of the result.
    Returns:
        ``float32 [B * Hkv, P]``: the max over the page's tokens of the cosine between the group's
        mean unit query and the key; only ``[HEAD, TAIL)`` of rows that select are written.
        Equals ``score_pages(group_query(query[b:b+1]), keys)`` on those pages.
    """
    from vllm_sparse.policy import HEAD, NUM_COLUMNS, SELECT, TAIL

    b, hq, d = query.shape
    rows = b * num_kv_heads
    n = page_keys.shape[1]
    out = torch.empty(rows, page_cap, dtype=torch.float32, device=query.device)
    if rows == 0:
        return out
    assert query.stride(-1) == 1 and page_keys.stride(-1) == 1 and block_table.stride(-1) == 1
    block_p = max(1, 64 // n)
    progs = programs_per_row(rows, page_cap, block_p, query.device)
    g = hq // num_kv_heads
    _quoka_decode_score_kernel[(rows, progs)](
        query, page_keys, block_table, columns, out,
        query.stride(0), query.stride(1), page_keys.stride(0), page_keys.stride(1), block_table.stride(0),
        out.stride(0), head_slots,
        HKV=num_kv_heads, G=g, BLOCK_G=triton.next_power_of_2(g), PAGE=n, D=d,
        BLOCK_D=triton.next_power_of_2(d), BLOCK_P=block_p, NCOLS=NUM_COLUMNS, C_SELECT=SELECT, C_HEAD=HEAD,
        C_TAIL=TAIL, num_warps=4,
    )  # fmt: skip
    return out
