"""Triton Twilight mass estimate from INT4 key shadows; twins:
``vllm_sparse.selectors.twilight.estimate_page_mass`` over ``dequantize_int4`` keys (one request)
and ``vllm_sparse.selectors.twilight.estimate_page_mass_rows`` (decode rows of many requests).

The shadows are read in place (``PageMeta.codes/scale/zero`` through the pages' physical blocks)
and never dequantized to memory: with ``k = code * s + z``, ``q . k = s * (q . code) + z * sum(q)``,
one product of the queries' even channels with the low nibbles plus one of the odd channels with
the high nibbles.

A row is one (slot, KV head) pair with its own page list ``blocks[row]`` (``-1``: padding, never
read, zero mass); a slot is a request whose ``C`` queries are ``q[slot * C : (slot + 1) * C]``, so
one launch estimates every decode request of a step. A program takes the row's ``C x G``
(query, head of the group) pairs flattened, so a page's shadow is read once for the whole group.
Two passes per row:

1. log-sum-exp of every query's logits over all the row's tokens (online, the tokens split over
   programs; the partial ``(max, sum)`` pairs are merged in torch);
2. per page, ``sum_c sum_{t in page} exp(logit - lse_c) / C``.

The top-p selection (sort + cumulative sum) stays in torch (``selectors.twilight.top_p_keep``).

Decode rows on the device path (``decode_page_lse_triton``, below) take one pass instead: a row
is one query token, its page list (candidates, then forced past pages) is built in the kernel from
the decode columns, the candidates and the block table, each page's shadow is read once for the
G heads of the group, and each page's base-2 log-mass (the log-sum-exp of its tokens' logits) is
written unnormalised; the top-p kernel (``kernels.top_p``) normalises it per head. The products
run on tensor cores: the codes are exact in float16 and each query is split into float16 high
and low parts, so ``q . code`` keeps ~22 bits with float32 accumulation (no tf32); the G heads sit
in the 16 rows a dot needs, padding rows are zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.decode_rows import programs_per_row

LOG2E = 1.4426950408889634


@triton.jit
def _shadow_logits(
    qe,
    qo,
    qsum,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    blocks_ptr,
    t,
    tm,
    row,
    kv,
    stride_br,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_sh,
    PAGE: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Logits (times log2 e and the softmax scale, already folded into the queries) of a tile of
    queries against tokens ``t`` of the row's pages: ``[BLOCK_Q, BLOCK_T]`` float32, ``-inf`` for
    tokens out of range or on padding pages."""
    j = tl.arange(0, BLOCK_HD)
    jm = j < HALF_D
    blk = tl.load(blocks_ptr + row.to(tl.int64) * stride_br + t // PAGE, mask=tm, other=-1).to(tl.int64)
    tv = tm & (blk >= 0)
    off = t % PAGE
    c = tl.load(
        codes_ptr + blk[:, None] * stride_cb + kv * stride_ch + off[:, None] * stride_ct + j[None, :],
        mask=tv[:, None] & jm[None, :],
        other=0,
    )  # [BLOCK_T, BLOCK_HD] uint8
    lo = (c & 15).to(tl.float32)
    hi = (c >> 4).to(tl.float32)
    s = tl.load(scale_ptr + blk * stride_sb + kv * stride_sh + off, mask=tv, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + blk * stride_sb + kv * stride_sh + off, mask=tv, other=0.0).to(tl.float32)
    dots = tl.dot(qe, tl.trans(lo), input_precision=PRECISION) + tl.dot(qo, tl.trans(hi), input_precision=PRECISION)
    x = dots * s[None, :] + qsum[:, None] * z[None, :]
    return tl.where(tv[None, :], x, float("-inf"))


@triton.jit
def _load_queries(q_ptr, i, im, q0, kv, stride_qc, stride_qh, G: tl.constexpr, HALF_D: tl.constexpr,
                  BLOCK_HD: tl.constexpr):
    """Flattened queries ``i = c * G + g`` of the row (query ``q0 + c``, head ``kv * G + g``):
    even channels, odd channels and their sums."""
    j = tl.arange(0, BLOCK_HD)
    jm = j < HALF_D
    base = q_ptr + (q0 + (i // G)[:, None]).to(tl.int64) * stride_qc + (kv * G + i % G)[:, None] * stride_qh
    m = im[:, None] & jm[None, :]
    qe = tl.load(base + 2 * j[None, :], mask=m, other=0.0)
    qo = tl.load(base + 2 * j[None, :] + 1, mask=m, other=0.0)
    return qe, qo, tl.sum(qe, axis=1) + tl.sum(qo, axis=1)


@triton.jit(do_not_specialize=["num_queries", "num_tokens", "split_tokens", "stride_br"])
def _lse_partial_kernel(
    q_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    blocks_ptr,
    valid_ptr,
    m_ptr,
    l_ptr,
    num_queries,
    num_kv_heads,
    num_tokens,
    split_tokens,
    stride_qc,
    stride_qh,
    stride_br,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_sh,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    row = tl.program_id(0)
    kv = row % num_kv_heads
    q0 = (row // num_kv_heads) * num_queries
    nq = num_queries * G
    i = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    im = i < nq
    split = tl.program_id(2)
    qe, qo, qsum = _load_queries(q_ptr, i, im, q0, kv, stride_qc, stride_qh, G, HALF_D, BLOCK_HD)
    m_i = tl.full([BLOCK_Q], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    lo_t = split * split_tokens
    hi_t = tl.minimum(lo_t + split_tokens, num_tokens)
    if HAS_VALID:  # the row's pages past valid[row] are padding: not even computed
        hi_t = tl.minimum(hi_t, tl.load(valid_ptr + row) * PAGE)
    for t0 in range(lo_t, hi_t, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < hi_t
        x = _shadow_logits(
            qe, qo, qsum, codes_ptr, scale_ptr, zero_ptr, blocks_ptr, t, tm, row, kv,
            stride_br, stride_cb, stride_ch, stride_ct, stride_sb, stride_sh, PAGE, HALF_D, BLOCK_HD, PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(x - m_new[:, None]), axis=1)
        m_i = m_new
    nsplit = tl.num_programs(2)
    o = (row.to(tl.int64) * nsplit + split) * nq + i
    tl.store(m_ptr + o, m_i, mask=im)
    tl.store(l_ptr + o, l_i, mask=im)


@triton.jit(do_not_specialize=["num_queries", "num_pages", "stride_br"])
def _page_mass_kernel(
    q_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    blocks_ptr,
    valid_ptr,
    lse_ptr,
    out_ptr,
    num_queries,
    num_kv_heads,
    num_pages,
    stride_qc,
    stride_qh,
    stride_br,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_sh,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_PG: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    row = tl.program_id(0)
    kv = row % num_kv_heads
    q0 = (row // num_kv_heads) * num_queries
    nq = num_queries * G
    t = tl.program_id(1) * BLOCK_PG * PAGE + tl.arange(0, BLOCK_PG * PAGE)
    tm = t < num_pages * PAGE
    gi = tl.arange(0, BLOCK_G)
    acc = tl.zeros([BLOCK_G, BLOCK_PG * PAGE], tl.float32)
    nq_run = nq
    if HAS_VALID:  # programs whose pages are all padding store zeros without computing
        nq_run = tl.where(tl.program_id(1) * BLOCK_PG < tl.load(valid_ptr + row), nq, 0)
    for i0 in range(0, nq_run, BLOCK_Q):
        i = i0 + tl.arange(0, BLOCK_Q)
        im = i < nq
        qe, qo, qsum = _load_queries(q_ptr, i, im, q0, kv, stride_qc, stride_qh, G, HALF_D, BLOCK_HD)
        x = _shadow_logits(
            qe, qo, qsum, codes_ptr, scale_ptr, zero_ptr, blocks_ptr, t, tm, row, kv,
            stride_br, stride_cb, stride_ch, stride_ct, stride_sb, stride_sh, PAGE, HALF_D, BLOCK_HD, PRECISION,
        )
        lse = tl.load(lse_ptr + row.to(tl.int64) * nq + i, mask=im, other=0.0)
        w = tl.where(im[:, None], tl.exp2(x - lse[:, None]), 0.0)  # [BLOCK_Q, BLOCK_PG * PAGE]
        for g in tl.static_range(G):  # sum over the tile's queries of head g
            wg = tl.sum(tl.where((i % G == g)[:, None], w, 0.0), axis=0)
            acc = tl.where(gi[:, None] == g, acc + wg[None, :], acc)
    mass = tl.sum(tl.reshape(acc, (BLOCK_G, BLOCK_PG, PAGE)), axis=2) / num_queries  # [BLOCK_G, BLOCK_PG]
    p = tl.program_id(1) * BLOCK_PG + tl.arange(0, BLOCK_PG)
    out = out_ptr + row.to(tl.int64) * G * num_pages + gi[:, None] * num_pages + p[None, :]
    tl.store(out, mass, mask=(gi[:, None] < G) & (p[None, :] < num_pages))


def _estimate(q, codes, scale, zero, blocks, softmax_scale, num_queries, valid=None):
    """``[R, G, P]`` for rows ``blocks [R, P]`` (``R = slots * Hkv``) and queries ``q [slots * C, Hq, D]``;
    ``valid``: ``int32 [R]`` leading pages of each row that are not padding (None: all)."""
    hq = q.shape[1]
    _, hkv, n, half = codes.shape
    rows, p = blocks.shape
    g = hq // hkv
    out = torch.zeros(rows, g, p, dtype=torch.float32, device=q.device)
    if p == 0 or rows == 0 or num_queries == 0:
        return out
    assert n & (n - 1) == 0, f"page size {n} is not a power of two"
    assert codes.stride(-1) == 1 and scale.stride() == zero.stride() and scale.stride(-1) == 1
    # the softmax scale and log2(e) folded into the queries: logits come out in base 2
    qs = (q.float() * (softmax_scale * LOG2E)).contiguous()
    blocks = blocks.contiguous()
    nq = num_queries * g
    block_q = 16 if nq <= 16 else 32
    block_t = max(64, n)
    num_tokens = p * n
    qblocks = triton.cdiv(nq, block_q)
    # split the tokens so that about 2048 programs run (a few per SM), at least 4 tiles each
    splits = max(1, min(triton.cdiv(2048, rows * qblocks), num_tokens // (4 * block_t)))
    split_tokens = triton.cdiv(triton.cdiv(num_tokens, splits), block_t) * block_t
    splits = triton.cdiv(num_tokens, split_tokens)
    m = torch.empty(rows, splits, nq, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)  # noqa: E741  (the (m, l) pair of an online softmax)
    common = (qs.stride(0), qs.stride(1), blocks.stride(0), codes.stride(0), codes.stride(1), codes.stride(2),
              scale.stride(0), scale.stride(1))
    consts = dict(G=g, PAGE=n, HALF_D=half, BLOCK_HD=max(16, triton.next_power_of_2(half)),
                  PRECISION="tf32x3" if q.is_cuda else "ieee", BLOCK_Q=block_q, num_warps=4)
    has_valid = valid is not None
    valid = valid if has_valid else blocks  # any pointer: not read
    _lse_partial_kernel[(rows, qblocks, splits)](
        qs, codes, scale, zero, blocks, valid, m, l, num_queries, hkv, num_tokens, split_tokens, *common,
        BLOCK_T=block_t, HAS_VALID=has_valid, **consts,
    )
    mx = m.amax(dim=1, keepdim=True)
    lse = (mx.squeeze(1) + torch.log2((l * torch.exp2(m - mx)).sum(dim=1))).contiguous()  # [R, C * G]
    block_pg = max(1, 64 // n)
    _page_mass_kernel[(rows, triton.cdiv(p, block_pg))](
        qs, codes, scale, zero, blocks, valid, lse, out, num_queries, hkv, p, *common, BLOCK_PG=block_pg,
        BLOCK_G=triton.next_power_of_2(g), HAS_VALID=has_valid, **consts,
    )
    return out


def estimate_page_mass_triton(
    q: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    blocks: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Estimated attention mass per page of one request from the INT4 shadows, mean over the
    chunk's queries.

    Args:
        q: ``[C, Hq, D]`` queries.
        codes: ``uint8 [num_blocks, Hkv, N, D // 2]``, scale/zero ``float16 [num_blocks, Hkv, N]``:
            the shadow planes (``PageMeta``), read in place.
        blocks: ``int [Hkv, P]`` physical block of each page per KV head (complete pages).
        softmax_scale: the softmax scale.
    Returns:
        ``float32 [Hkv, G, P]``; equals ``estimate_page_mass(q, dequantize_int4(codes[blocks, h],
        ...).flatten(1, 2), N, softmax_scale)``.
    """
    return _estimate(q, codes, scale, zero, blocks, softmax_scale, q.shape[0])


def estimate_page_mass_rows_triton(
    q: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    blocks: torch.Tensor,
    softmax_scale: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Estimated attention mass per page of many requests' decode queries, in one launch per pass.

    Args:
        q: ``[S, Hq, D]`` one query per slot (request).
        codes, scale, zero: the shadow planes, as for ``estimate_page_mass_triton``.
        blocks: ``int [S * Hkv, P]`` physical block of each page of row ``slot * Hkv + kv_head``;
            ``-1`` marks padding (never read; zero mass, outside every softmax).
        softmax_scale: the softmax scale.
        valid: ``int32 [S * Hkv]`` optional: every page of a row at or past ``valid[row]`` is
            padding, and its tokens are skipped rather than masked (rows padded to a fixed cap).
    Returns:
        ``float32 [S * Hkv, G, P]``; equals ``estimate_page_mass_rows`` (the twin).
    """
    assert blocks.shape[0] == q.shape[0] * codes.shape[1]
    return _estimate(q, codes, scale, zero, blocks, softmax_scale, 1, valid)


# ---------------------------------------------------------------------------------------------
# Decode rows, every length read on the device (CUDA-graph safe)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _f16_nibbles(codes):
    """Low and high nibbles of ``uint8`` codes as exact float16: the nibble goes into the mantissa
    of 1024 (an OR) and 1024 is subtracted, instead of an int-to-float conversion."""
    w = codes.to(tl.int16)
    lo = ((w & 15) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    hi = ((w >> 4) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return lo, hi


@triton.jit
def _row_blocks(cand_row, bt_row, c, cm, cnt, head, tail):
    """Physical blocks (int64) of a row's columns ``c`` (``cm``: in range): the candidates
    ``cand_row[c]`` below ``cnt``, then the forced past pages ``[0, head) + [tail, past)``."""
    f = c - cnt
    page = tl.where(f < head, f, tail + f - head)
    page = tl.where(f < 0, tl.load(cand_row + c, mask=cm & (f < 0), other=0), page)
    return tl.load(bt_row + page, mask=cm, other=0).to(tl.int64)


@triton.jit(do_not_specialize=["stride_bt", "stride_cr", "stride_or", "stride_og"])
def _decode_page_lse_kernel(
    q_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    bt_ptr,
    cols_ptr,
    cand_ptr,
    cnt_ptr,
    out_ptr,
    valid_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_cr,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_sh,
    stride_or,
    stride_og,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PAGE: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    NCOLS: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    C_PAST: tl.constexpr,
):
    row = tl.program_id(0)  # (request, KV head)
    req = row // HKV
    kv = row % HKV
    cnt = tl.load(cnt_ptr + row)
    head = tl.load(cols_ptr + req * NCOLS + C_HEAD)
    tail = tl.load(cols_ptr + req * NCOLS + C_TAIL)
    past = tl.load(cols_ptr + req * NCOLS + C_PAST)
    nv = tl.where(cnt > 0, cnt + head + tl.maximum(past - tail, 0), 0)  # candidates + forced past pages
    if tl.program_id(1) == 0:
        tl.store(valid_ptr + row, nv)
    # this program's columns: a share of [0, nv) in whole tiles (none past the row's count)
    share = tl.cdiv(tl.cdiv(nv, tl.num_programs(1)), BLOCK_P) * BLOCK_P
    start = tl.program_id(1) * share
    end = tl.minimum(nv, start + share)
    cand_row = cand_ptr + row.to(tl.int64) * stride_cr
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    out_row = out_ptr + row.to(tl.int64) * stride_or
    # the group's queries (even and odd channels, scaled to base-2 logits) as float16 high + low
    # parts (~22 bits of q; the codes are exact in float16, so the tensor-core products are exact)
    gi = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_HD)
    qp = q_ptr + req.to(tl.int64) * stride_qt + (kv * G + gi)[:, None] * stride_qh + 2 * j[None, :]
    qm = (gi < G)[:, None] & (j < HALF_D)[None, :]
    qe = tl.load(qp, mask=qm, other=0.0).to(tl.float32) * qk_scale  # [BLOCK_G, BLOCK_HD]
    qo = tl.load(qp + 1, mask=qm, other=0.0).to(tl.float32) * qk_scale
    qsum = tl.sum(qe + qo, axis=1)
    qe_hi = qe.to(tl.float16)
    qo_hi = qo.to(tl.float16)
    qe_lo = (qe - qe_hi.to(tl.float32)).to(tl.float16)
    qo_lo = (qo - qo_hi.to(tl.float32)).to(tl.float16)
    t = tl.arange(0, BLOCK_P * PAGE)
    n = t % PAGE
    for p0 in range(start, end, BLOCK_P):
        c = p0 + t // PAGE  # each token's column
        cm = c < end
        blk = _row_blocks(cand_row, bt_row, c, cm, cnt, head, tail)
        codes = tl.load(
            codes_ptr + (blk * stride_cb + kv * stride_ch + n * stride_ct)[None, :] + j[:, None],
            mask=cm[None, :] & (j < HALF_D)[:, None],
            other=0,
        )  # [BLOCK_HD, BLOCK_P * PAGE]: byte i of each token's codes = channels 2i (low), 2i + 1 (high)
        soff = blk * stride_sb + kv * stride_sh + n
        s = tl.load(scale_ptr + soff, mask=cm, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + soff, mask=cm, other=0.0).to(tl.float32)
        lo, hi = _f16_nibbles(codes)
        dots = tl.dot(qe_hi, lo)  # q . code, float32 accumulation
        dots = tl.dot(qo_hi, hi, dots)
        dots = tl.dot(qe_lo, lo, dots)
        dots = tl.dot(qo_lo, hi, dots)
        x = dots * s[None, :] + qsum[:, None] * z[None, :]  # q . (code * s + z), [BLOCK_G, BLOCK_P * PAGE]
        x = tl.reshape(x, (BLOCK_G, BLOCK_P, PAGE))
        m = tl.max(x, axis=2)
        lse = m + tl.log2(tl.sum(tl.exp2(x - m[:, :, None]), axis=2))  # [BLOCK_G, BLOCK_P]
        cp = p0 + tl.arange(0, BLOCK_P)
        tl.store(out_row + gi[:, None] * stride_og + cp[None, :], lse, mask=(gi < G)[:, None] & (cp < end)[None, :])


def decode_page_lse_triton(
    query: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    block_table: torch.Tensor,
    columns: torch.Tensor,
    cand: torch.Tensor,
    cand_counts: torch.Tensor,
    softmax_scale: float,
    forced_cap: int,
    block_p: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mass of every page a decode row estimates, in one pass over the shadows, lengths read on
    the device.

    Row ``r = request * Hkv + kv_head`` estimates its columns ``[0, num_valid[r])``: its
    ``cnt = cand_counts[r]`` candidates ``cand[r, :cnt]``, then its forced past pages
    ``[0, HEAD) + [TAIL, PAST)`` (none when ``cnt = 0``: dense or padding rows estimate nothing).
    The page lists are built in the kernel (twin: ``selectors.twilight.decode_row_pages``).

    Args:
        query: ``[B, Hq, D]`` one token per decode request (last dim contiguous).
        codes, scale, zero: the shadow planes, as for ``estimate_page_mass_triton``.
        block_table: ``int32 [B, max_blocks]``.
        columns: ``int32 [B, NUM_COLUMNS]`` decode columns (``policy.decode_columns``).
        cand: ``int32 [B * Hkv, K]`` candidate pages (valid below ``cand_counts``).
        cand_counts: ``int32 [B * Hkv]``.
        softmax_scale: the softmax scale.
        forced_cap: ``F`` the most forced past pages a row can have.
        block_p, num_warps, num_stages, programs: pages per tile, warps, pipeline stages and
            programs per row (None: defaults; programs past a row's count do nothing).
    Returns:
        ``(lse float32 [B * Hkv, G, K + F], num_valid int32 [B * Hkv])``: per head, the base-2
        log-sum-exp of each page's logits ``q . k * softmax_scale * log2(e)`` over its tokens;
        ``exp2(lse - logsumexp2(lse[r, g, :num_valid[r]]))`` is ``estimate_page_mass_rows`` of the
        row's pages. Columns at or past ``num_valid`` are not written.
    """
    from vllm_sparse.policy import HEAD, NUM_COLUMNS, PAST, TAIL

    b, hq, _ = query.shape
    _, hkv, n, half = codes.shape
    g = hq // hkv
    rows, k = cand.shape
    width = k + forced_cap
    out = torch.empty(rows, g, width, dtype=torch.float32, device=query.device)
    valid = torch.empty(rows, dtype=torch.int32, device=query.device)
    if rows == 0:
        return out, valid
    assert rows == b * hkv and n & (n - 1) == 0, f"page size {n} is not a power of two"
    assert query.stride(-1) == 1 and codes.stride(-1) == 1 and scale.stride() == zero.stride()
    assert scale.stride(-1) == 1 and columns.is_contiguous() and block_table.stride(-1) == 1
    assert cand.stride(-1) == 1 and cand_counts.is_contiguous()
    # tiles of 256 tokens and about 2 programs per SM: each tile waits on a chain of loads (candidate,
    # block, shadow), so fewer, wider tiles keep more bytes in flight (on an H100, 16 x 16K: 0.047 ms
    # against 0.066 with tiles of 64 tokens and 4 programs per SM; 1 x 128K: 0.013 against 0.015;
    # benchmarks/results/decode_kernels_h100_session19/)
    block_p = block_p or max(1, 256 // n)
    progs = programs or max(1, programs_per_row(rows, width, block_p, query.device) // 2)
    _decode_page_lse_kernel[(rows, progs)](
        query, codes, scale, zero, block_table, columns, cand, cand_counts, out, valid, softmax_scale * LOG2E,
        query.stride(0), query.stride(1), block_table.stride(0), cand.stride(0), codes.stride(0), codes.stride(1),
        codes.stride(2), scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
        HKV=hkv, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), PAGE=n, HALF_D=half,
        BLOCK_HD=max(16, triton.next_power_of_2(half)), BLOCK_P=block_p,
        NCOLS=NUM_COLUMNS, C_HEAD=HEAD, C_TAIL=TAIL, C_PAST=PAST, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    return out, valid
