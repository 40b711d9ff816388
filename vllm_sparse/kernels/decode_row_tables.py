"""Page tables of decode rows for a paged attention kernel: each (request, KV head) row's selected and forced pages
as physical page ids, in the order the Triton decode kernel reads them (``kernels.decode_attention``); twin:
``decode_row_tables_reference``.

Row ``r = request * Hkv + head`` lists its ``counts[r]`` selected logical pages, then its forced pages ``[0, HEAD) +
[TAIL, TOTAL)`` (``policy.decode_columns``), each mapped through the request's block-table row to the page id
``block * head_slots + head`` of the head-major cache. The last entry is the row's last page, which holds ``LAST``
tokens, so a kernel that reads ``(entries - 1) * N + LAST`` tokens of the row (FlashAttention's ``seqused_k``) reads
exactly what the Triton decode kernel reads. One program per row, whose loop runs as far as the row's entries (read
on the device): the launch is the same for any lengths, so it captures into a CUDA graph once per batch size.
Entries past a row's count are left as they were (a paged kernel never reads past ``seqused_k``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.policy import HEAD, LAST, NUM_COLUMNS, TAIL, TOTAL

BLOCK = 256


@triton.jit
def decode_row_extent(
    cols_ptr, count_ptr, row, HKV: tl.constexpr, NCOLS: tl.constexpr, C_HEAD: tl.constexpr, C_TAIL: tl.constexpr,
    C_TOTAL: tl.constexpr, C_LAST: tl.constexpr,
):  # fmt: skip
    """A decode row's request, its forced ranges ``[0, head) + [tail, total)``, ``last`` tokens in its last page,
    ``k_sel`` selected pages and ``n_pages`` pages in all (meaningful where ``total > 0``; 0 marks padding)."""
    req = row // HKV
    cb = cols_ptr + req * NCOLS
    head = tl.load(cb + C_HEAD)
    tail = tl.load(cb + C_TAIL)
    total = tl.load(cb + C_TOTAL)
    last = tl.load(cb + C_LAST)
    k_sel = tl.load(count_ptr + row)
    return req, head, tail, total, last, k_sel, k_sel + head + total - tail


@triton.jit
def decode_row_logical_pages(j, mask, k_sel, head, tail, sel_row):
    """Logical page of the row's ``j``-th entries (``j < k_sel``: its selection ``sel_row[j]``; then the forced
    pages in order); ``mask``: the entries that exist."""
    is_sel = j < k_sel
    jf = j - k_sel
    forced = tl.where(jf < head, jf, tail + jf - head)
    picked = tl.load(sel_row + j, mask=mask & is_sel, other=0)
    return tl.where(is_sel, picked, forced)


@triton.jit(do_not_specialize=["stride_bt", "stride_sel", "stride_tab", "head_slots"])
def _decode_row_tables_kernel(
    bt_ptr,
    sel_ptr,
    count_ptr,
    cols_ptr,
    table_ptr,
    lens_ptr,
    stride_bt,
    stride_sel,
    stride_tab,
    head_slots,
    HKV: tl.constexpr,
    PAGE: tl.constexpr,
    NCOLS: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    C_TOTAL: tl.constexpr,
    C_LAST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    kv = row % HKV
    req, head, tail, total, last, k_sel, n_pages = decode_row_extent(
        cols_ptr, count_ptr, row, HKV, NCOLS, C_HEAD, C_TAIL, C_TOTAL, C_LAST
    )
    n_pages = tl.where(total > 0, n_pages, 0)
    tl.store(lens_ptr + row, tl.where(total > 0, (n_pages - 1) * PAGE + last, 0))
    sel_row = sel_ptr + row.to(tl.int64) * stride_sel
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    tab_row = table_ptr + row.to(tl.int64) * stride_tab
    for start in range(0, n_pages, BLOCK):
        j = start + tl.arange(0, BLOCK)
        jm = j < n_pages
        logical = decode_row_logical_pages(j, jm, k_sel, head, tail, sel_row)
        blk = tl.load(bt_row + logical, mask=jm, other=0)
        tl.store(tab_row + j, blk * head_slots + kv, mask=jm)


def decode_row_tables_triton(
    block_table: torch.Tensor,
    pages: torch.Tensor,
    counts: torch.Tensor,
    columns: torch.Tensor,
    head_slots: int,
    page_size: int,
    table: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Write each decode row's page table and token count (one launch).

    Args:
        block_table: ``int32 [B, max_blocks]`` the decode requests' block-table rows.
        pages: ``int32 [B * Hkv, K]`` selected logical pages of each row (valid below ``counts``).
        counts: ``int32 [B * Hkv]`` selected pages per row.
        columns: ``int32 [B, NUM_COLUMNS]`` decode columns (``policy.decode_columns``).
        head_slots: head slots per block (page id ``block * head_slots + head``).
        page_size: ``N`` tokens per page.
        table: ``int32 [B * Hkv, W]`` written: row ``r``'s page ids in its first ``entries`` columns
            (``W`` at least the widest row: ``TOTAL`` pages bound every row).
        lens: ``int32 [B * Hkv]`` written: the tokens of each row (0 where ``TOTAL`` is 0: padding).
    """
    rows = counts.shape[0]
    if rows == 0:
        return
    b = columns.shape[0]
    assert columns.is_contiguous() and columns.shape == (b, NUM_COLUMNS) and rows % b == 0
    assert block_table.stride(-1) == 1 and pages.stride(-1) == 1 and table.stride(-1) == 1
    _decode_row_tables_kernel[(rows,)](
        block_table, pages, counts, columns, table, lens, block_table.stride(0), pages.stride(0), table.stride(0),
        head_slots, HKV=rows // b, PAGE=page_size, NCOLS=NUM_COLUMNS, C_HEAD=HEAD, C_TAIL=TAIL, C_TOTAL=TOTAL,
        C_LAST=LAST, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip


def decode_row_tables_reference(
    block_table: torch.Tensor,
    pages: torch.Tensor,
    counts: torch.Tensor,
    columns: torch.Tensor,
    head_slots: int,
    page_size: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Torch twin of ``decode_row_tables_triton``: ``(per row an int64 tensor of its page ids, int32 [B * Hkv] lens)``."""
    b = columns.shape[0]
    rows = counts.shape[0]
    hkv = rows // b
    bt, sel, cnt, cols = block_table.cpu().long(), pages.cpu().long(), counts.cpu(), columns.cpu()
    tables, lens = [], torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        req, kv = divmod(r, hkv)
        head, tail, total, last = (int(cols[req, c]) for c in (HEAD, TAIL, TOTAL, LAST))
        if total == 0:
            tables.append(torch.zeros(0, dtype=torch.int64))
            continue
        logical = torch.cat([sel[r, : int(cnt[r])], torch.arange(head), torch.arange(tail, total)])
        tables.append(bt[req, logical] * head_slots + kv)
        lens[r] = (logical.numel() - 1) * page_size + last
    return tables, lens
