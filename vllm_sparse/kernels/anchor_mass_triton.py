"""The two Triton passes of Kascade's anchor scoring (wrapper and torch twin: ``kernels.anchor_mass``).

Rows of a program are the ``TILE x G`` (query, query head) pairs of one tile and one KV head,
row ``r`` = query ``r // G`` of the tile, head ``kv * G + r % G``. Keys are read in blocks of
``BLOCK_P`` pages (``BLOCK_P * N`` keys) through the request's page ids. ``LOW_PRECISION``: the
products take the cache's 16-bit inputs (CUDA), else float32 inputs (the interpreter). Lengths and
the page-id row stride vary with the data and are not specialised on (``vllm_sparse.warmup``).
Program ``i`` of the first grid axis takes tile ``tiles - 1 - i * tile_stride`` (``anchor_mass.scored_tiles``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scored_tile(num_queries, tile_stride, TILE: tl.constexpr):
    """The tile of this program: the chunk's last tile, ``tile_stride`` tiles earlier per program."""
    return tl.cdiv(num_queries, TILE) - 1 - tl.program_id(0) * tile_stride


@triton.jit
def _tile_queries(q_ptr, t, kv, num_queries, stride_qc, stride_qh,
                  G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """The tile's query rows ``[BLOCK_M, BLOCK_D]`` (zero past the valid rows) and the valid mask."""
    r = tl.arange(0, BLOCK_M)
    c = t * TILE + r // G
    rm = (r < TILE * G) & (c < num_queries)
    d = tl.arange(0, BLOCK_D)
    ptr = q_ptr + c.to(tl.int64)[:, None] * stride_qc + (kv * G + r % G)[:, None] * stride_qh + d[None, :]
    qb = tl.load(ptr, mask=rm[:, None] & (d[None, :] < D), other=0.0)
    return qb, rm


@triton.jit
def _key_block(k_ptr, ids_ptr, kv, p0, num_pages, stride_kp, stride_kn, stride_kd, stride_ids,
               N: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Keys ``[BLOCK_D, BLOCK_P * N]`` (transposed) of pages ``p0 ..`` (zero past ``num_pages``)."""
    j = tl.arange(0, BLOCK_P * N)
    page = p0 + j // N
    pm = page < num_pages
    pid = tl.load(ids_ptr + kv * stride_ids + page, mask=pm, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ptr = k_ptr + pid[None, :] * stride_kp + (j % N)[None, :] * stride_kn + d[:, None] * stride_kd
    return tl.load(ptr, mask=pm[None, :] & (d[:, None] < D), other=0.0), j


@triton.jit(do_not_specialize=["num_queries", "context_len", "tile_stride", "stride_ids"])
def anchor_lse_kernel(
    q_ptr, k_ptr, ids_ptr, lse_ptr, num_queries, context_len, scale, tile_stride,
    stride_qc, stride_qh, stride_kp, stride_kn, stride_kd, stride_ids,
    G: tl.constexpr, D: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, LOW_PRECISION: tl.constexpr,
):  # fmt: skip
    """Pass 1, grid ``(scored tiles, Hkv)``: ``lse [scored tiles, Hkv, BLOCK_M]`` of every row over
    the keys below its tile's first position (online max and sum)."""
    t = _scored_tile(num_queries, tile_stride, TILE)
    kv = tl.program_id(1)
    qb, rm = _tile_queries(q_ptr, t, kv, num_queries, stride_qc, stride_qh, G, D, TILE, BLOCK_M, BLOCK_D)
    if not LOW_PRECISION:
        qb = qb.to(tl.float32)
    visible = context_len + t * TILE
    num_pages = tl.cdiv(visible, N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for p0 in range(0, num_pages, BLOCK_P):
        kb, j = _key_block(k_ptr, ids_ptr, kv, p0, num_pages, stride_kp, stride_kn, stride_kd, stride_ids,
                           N, D, BLOCK_P, BLOCK_D)  # fmt: skip
        s = tl.dot(qb, kb.to(qb.dtype), out_dtype=tl.float32) * scale  # [BLOCK_M, BLOCK_P * N]
        s = tl.where((p0 * N + j < visible)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    lse = tl.where(rm, m_i + tl.log(l_i), float("inf"))  # invalid rows: weight exp(-inf) = 0
    tl.store(lse_ptr + (tl.program_id(0) * tl.num_programs(1) + kv) * BLOCK_M + tl.arange(0, BLOCK_M), lse)


@triton.jit(do_not_specialize=["num_queries", "num_past", "tile_stride", "stride_ids"])
def anchor_mass_kernel(
    q_ptr, k_ptr, ids_ptr, lse_ptr, out_ptr, num_queries, num_past, scale, tile_stride,
    stride_qc, stride_qh, stride_kp, stride_kn, stride_kd, stride_ids,
    G: tl.constexpr, D: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, LOW_PRECISION: tl.constexpr,
    STEPS: tl.constexpr,
):  # fmt: skip
    """Pass 2, grid ``(scored tiles, Hkv, cdiv(past, BLOCK_P * STEPS))``: ``out [scored tiles, Hkv,
    past]`` the mean over the tile's valid rows of each past page's softmax weight (past keys are
    visible to every tile). A program loads its tile's queries once and walks ``STEPS`` key blocks."""
    i = tl.program_id(0)
    t = _scored_tile(num_queries, tile_stride, TILE)
    kv = tl.program_id(1)
    hkv = tl.num_programs(1)
    qb, rm = _tile_queries(q_ptr, t, kv, num_queries, stride_qc, stride_qh, G, D, TILE, BLOCK_M, BLOCK_D)
    if not LOW_PRECISION:
        qb = qb.to(tl.float32)
    lse = tl.load(lse_ptr + (i * hkv + kv) * BLOCK_M + tl.arange(0, BLOCK_M))
    rows = tl.sum(rm.to(tl.float32), 0)
    out_row = out_ptr + (i * hkv + kv).to(tl.int64) * num_past
    for step in range(STEPS):
        p0 = (tl.program_id(2) * STEPS + step) * BLOCK_P
        if p0 < num_past:
            kb, j = _key_block(k_ptr, ids_ptr, kv, p0, num_past, stride_kp, stride_kn, stride_kd, stride_ids,
                               N, D, BLOCK_P, BLOCK_D)  # fmt: skip
            s = tl.dot(qb, kb.to(qb.dtype), out_dtype=tl.float32) * scale
            w = tl.exp(s - lse[:, None])  # [BLOCK_M, BLOCK_P * N]; invalid rows 0
            per_key = tl.sum(w, 0) / rows
            per_page = tl.sum(tl.reshape(per_key, [BLOCK_P, N]), 1)
            page = p0 + tl.arange(0, BLOCK_P)
            tl.store(out_row + page, per_page, mask=page < num_past)
