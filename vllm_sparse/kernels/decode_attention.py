"""Triton decode attention over compacted (request, KV head) rows, every length read on the device;
twin: ``decode_attention_reference``.

Row ``r = request * Hkv + head`` attends its selected pages (``pages[r, :counts[r]]``, logical
page numbers) and then its forced pages ``[0, HEAD) + [TAIL, TOTAL)`` (``policy.decode_columns``;
a dense row has ``HEAD = TAIL = 0`` and attends every page), each page's block read through the
request's block-table row and its K/V read in place (physical page ``block * head_slots + head``).
No page table is materialised: compacted token ``t`` of a row lies on compacted page ``t // N``,
whose logical page follows from the counts above. The query (one token, the G heads of the
group) sees every compacted token, the last page holding ``LAST`` tokens.

The grid is ``(B * Hkv, splits)``, fixed for a batch size (``splits`` is a run-time argument, so
the batch sizes of eager mixed steps compile nothing new): each program takes an equal share of
its row's tokens (computed on the device), writes the normalised partial outputs of the group's
``G`` query heads and their log-sum-exps, and a second kernel, one program per query head, merges
the splits. Small batches take many splits (up to ``MAX_SPLITS``) so that the few rows still keep
every SM streaming K/V. Rows with nothing to attend (CUDA-graph padding) write zeros; float32
caches take IEEE dots (the reference's numbers), half-precision ones tensor-core dots. So the
kernel captures into a CUDA graph once per batch size.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.decode_row_tables import decode_row_extent, decode_row_logical_pages
from vllm_sparse.kernels.paged_attention import num_sms
from vllm_sparse.kernels.pdl import launch_options, pdl_wait_then_release
from vllm_sparse.kernels.split_merge import merge_partial_vectors
from vllm_sparse.policy import HEAD, LAST, NUM_COLUMNS, TAIL, TOTAL

LOG2E = 1.4426950408889634
BLOCK_N = 64
MAX_SPLITS = 128
PROGRAMS_PER_SM = 2  # attention programs per SM that ``num_splits`` aims for
# Few rows (small batches) aim for twice as many: their rows are long (a dense 1 x 128K row streams 8,193 pages),
# and on an H200 4 programs per SM read them 14% faster at 1 x 128K and 11% at 4 x 16K (FA3's speed), while at
# 128 rows of 129 pages the extra splits cost 12%, at 64 dense rows of 16K 21% on an H100, where few rows gain
# 1-2% (``serve_bench_h200_session18/sweep``).
# ``VLLM_SPARSE_DECODE_FEW_ROWS`` (read at import) moves the line, for A/B runs: 0 gives every batch 2 programs per SM.
# On the real Qwen2.5-Coder-1.5B (2 KV heads) 16 decode requests are 32 rows, and its dense decode serves at 0.84-0.92x
# FLASH_ATTN's speed. On H200s (session 37, ``serve_bench_h200_session37``) the kernel alone read those 32 rows 16%
# faster at 4 per SM (FlashAttention's speed); served once each, 2 per SM gave a lower median ITL but a higher TTFT and
# a lower output throughput in the same runs: inconclusive, so the line stays at 32.
FEW_ROWS_ENV = "VLLM_SPARSE_DECODE_FEW_ROWS"


def few_rows(environ=os.environ) -> int:
    """``FEW_ROWS``: ``VLLM_SPARSE_DECODE_FEW_ROWS`` (default 32, also when empty), a whole number of rows >= 0."""
    text = environ.get(FEW_ROWS_ENV) or "32"
    if not text.strip().isdigit():
        raise ValueError(f"{FEW_ROWS_ENV}={text!r}: expected a whole number of decode rows (default 32; 0: none)")
    return int(text)


FEW_ROWS, PROGRAMS_PER_SM_FEW_ROWS = few_rows(), 4
MERGE_SPLITS = 32  # splits the merge reads per step


@triton.jit(do_not_specialize=["stride_sel", "scale_log2", "stride_bt", "splits"])
def _decode_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    sel_ptr,
    count_ptr,
    cols_ptr,
    part_o_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_vp,
    stride_vt,
    stride_bt,
    stride_sel,
    head_slots,
    splits,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NCOLS: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    C_TOTAL: tl.constexpr,
    C_LAST: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    kv = row % HKV
    req, head, tail, total, last, k_sel, n_pages = decode_row_extent(
        cols_ptr, count_ptr, row, HKV, NCOLS, C_HEAD, C_TAIL, C_TOTAL, C_LAST
    )
    kv_len = tl.where(total > 0, (n_pages - 1) * PAGE + last, 0)
    share = tl.cdiv(tl.cdiv(kv_len, splits), BLOCK_N) * BLOCK_N
    lo = split * share
    hi = tl.minimum(kv_len, lo + share)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + req.to(tl.int64) * stride_qt + (kv * G + g)[:, None] * stride_qh + d[None, :],
        mask=(g < G)[:, None] & dm[None, :],
        other=0.0,
    )
    if LOW_PRECISION:
        q = q.to(k_ptr.dtype.element_ty)
    else:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    sel_row = sel_ptr + row.to(tl.int64) * stride_sel
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tm = t < hi
        j = t // PAGE
        logical = decode_row_logical_pages(j, tm, k_sel, head, tail, sel_row)
        blk = tl.load(bt_row + logical, mask=tm, other=0).to(tl.int64)
        page = blk * head_slots + kv
        off = t % PAGE
        kvm = tm[:, None] & dm[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_kt + d[None, :], mask=kvm, other=0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vt + d[None, :], mask=kvm, other=0.0)
        if not LOW_PRECISION:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(tm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    gm = g < G
    base = (row * splits + split) * G + g
    tl.store(part_lse_ptr + base, tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf")), mask=gm)
    tl.store(part_o_ptr + base[:, None] * BLOCK_D + d[None, :], acc / safe_l[:, None], mask=gm[:, None])


@triton.jit(do_not_specialize=["splits"])
def _decode_merge_kernel(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    splits,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0)
    h = tl.program_id(1)  # query head of the group
    req = row // HKV
    kv = row % HKV
    d = tl.arange(0, BLOCK_D)
    o = merge_partial_vectors(part_o_ptr, part_lse_ptr, row * splits * G + h, G, splits, BLOCK_S, BLOCK_D)
    tl.store(
        out_ptr + req.to(tl.int64) * stride_ot + (kv * G + h) * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < D,
    )


def num_splits(rows: int, device: torch.device) -> int:
    """Splits per row so that about ``PROGRAMS_PER_SM`` programs per SM run (``PROGRAMS_PER_SM_FEW_ROWS``
    for at most ``FEW_ROWS`` rows), at most ``MAX_SPLITS`` (fixed per batch size: 66 for the 8 rows of one
    Llama-3.1-8B request on an H100 or H200, 3 for the 128 rows of 16 requests)."""
    per_sm = PROGRAMS_PER_SM_FEW_ROWS if rows <= FEW_ROWS else PROGRAMS_PER_SM
    return max(1, min(MAX_SPLITS, -(-per_sm * num_sms(device) // max(rows, 1))))


def decode_attention_triton(
    query: torch.Tensor,
    page_keys: torch.Tensor,
    page_values: torch.Tensor,
    block_table: torch.Tensor,
    pages: torch.Tensor,
    counts: torch.Tensor,
    columns: torch.Tensor,
    head_slots: int,
    scale: float,
    output: torch.Tensor,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> None:
    """Attend each decode request's query to its rows' selected and forced pages.

    Args:
        query, output: ``[B, Hq, D]`` one token per decode request (last dim contiguous).
        page_keys, page_values: ``[num_pages, N, D]`` by physical page id (strided views).
        block_table: ``int32 [B, max_blocks]`` the requests' block-table rows.
        pages: ``int32 [B * Hkv, K]`` selected logical pages of each row (valid below ``counts``).
        counts: ``int32 [B * Hkv]`` selected pages per row (0: forced pages only, or dense).
        columns: ``int32 [B, NUM_COLUMNS]`` decode columns (``policy.decode_columns``).
        head_slots: head slots per block (page id ``block * head_slots + head``).
        splits: programs per row (default ``num_splits``).
        block_n, num_warps, num_stages: the attention kernel's tile of tokens and launch settings
            (tuning knobs for ``benchmarks/bench_decode_attention_tuning_gpu.py``; the defaults are
            what serving uses).
    """
    b, hq, d = query.shape
    rows = counts.shape[0]
    if rows == 0:
        return
    hkv = rows // b
    g = hq // hkv
    n = page_keys.shape[1]
    assert query.stride(-1) == 1 and output.stride(-1) == 1 and pages.stride(-1) == 1
    assert columns.is_contiguous() and columns.shape == (b, NUM_COLUMNS) and block_table.stride(-1) == 1
    splits = splits or num_splits(rows, query.device)
    block_g = max(16, triton.next_power_of_2(g))
    block_d = max(16, triton.next_power_of_2(d))
    part_lse = torch.empty(rows * splits * g, dtype=torch.float32, device=query.device)
    part_o = torch.empty(rows * splits * g, block_d, dtype=torch.float32, device=query.device)
    low = query.is_cuda and page_keys.dtype in (torch.bfloat16, torch.float16)
    consts = dict(HKV=hkv, G=g, D=d, BLOCK_D=block_d)
    launch = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    pdl = launch_options(query.device)
    _decode_attn_kernel[(rows, splits)](
        query, page_keys, page_values, block_table, pages, counts, columns, part_o, part_lse,
        scale * LOG2E, query.stride(0), query.stride(1), page_keys.stride(0), page_keys.stride(1),
        page_values.stride(0), page_values.stride(1), block_table.stride(0), pages.stride(0), head_slots, splits,
        BLOCK_G=block_g, PAGE=n, BLOCK_N=block_n, NCOLS=NUM_COLUMNS, C_HEAD=HEAD, C_TAIL=TAIL, C_TOTAL=TOTAL,
        C_LAST=LAST, LOW_PRECISION=low, DOT_PRECISION="tf32" if low else "ieee", **launch, **consts, **pdl,
    )  # fmt: skip
    _decode_merge_kernel[(rows, g)](
        output, part_o, part_lse, output.stride(0), output.stride(1), splits, BLOCK_S=MERGE_SPLITS, num_warps=4,
        **consts, **pdl,
    )  # fmt: skip


def decode_attention_reference(
    query: torch.Tensor,
    page_keys: torch.Tensor,
    page_values: torch.Tensor,
    block_table: torch.Tensor,
    pages: torch.Tensor,
    counts: torch.Tensor,
    columns: torch.Tensor,
    head_slots: int,
    scale: float,
) -> torch.Tensor:
    """Torch twin of ``decode_attention_triton``: ``float32 [B, Hq, D]`` (zeros for empty rows)."""
    b, hq, d = query.shape
    rows = counts.shape[0]
    hkv = rows // b
    g = hq // hkv
    n = page_keys.shape[1]
    out = torch.zeros(b, hq, d, dtype=torch.float32)
    bt, sel, cnt, cols = block_table.cpu().long(), pages.cpu().long(), counts.cpu(), columns.cpu()
    keys, values, q = page_keys.cpu().float(), page_values.cpu().float(), query.cpu().float()
    for r in range(rows):
        req, kv = divmod(r, hkv)
        head, tail, total, last = (int(cols[req, c]) for c in (HEAD, TAIL, TOTAL, LAST))
        if total == 0:
            continue
        logical = torch.cat([sel[r, : int(cnt[r])], torch.arange(head), torch.arange(tail, total)])
        ids = bt[req, logical] * head_slots + kv
        kv_len = (logical.numel() - 1) * n + last
        k = keys[ids].reshape(-1, d)[:kv_len]
        v = values[ids].reshape(-1, d)[:kv_len]
        qr = q[req, kv * g : (kv + 1) * g]  # [G, D]
        w = torch.softmax(qr @ k.T * scale, dim=-1)
        out[req, kv * g : (kv + 1) * g] = w @ v
    return out
