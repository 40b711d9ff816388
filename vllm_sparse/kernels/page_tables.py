"""Triton page-table fill (stage 3, per layer); twin: the torch path of ``vllm_sparse.tables``.

One launch writes every row of a step's tables: a row's selected pages (logical -> block through
the block table -> physical id ``block * head_slots + head``), then its forced pages (physical
ids built once per step), then padding (the row's first forced page); and the row's page count
and token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["width", "max_select", "stride_sel", "stride_forced"])
def _fill_tables_kernel(
    sel_ptr,
    sel_count_ptr,
    bt_ptr,
    req_ptr,
    head_ptr,
    forced_ptr,
    num_forced_ptr,
    last_len_ptr,
    out_ptr,
    counts_ptr,
    kv_lens_ptr,
    width,
    max_select,
    stride_sel,
    stride_bt,
    stride_forced,
    head_slots,
    page_size,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    count = tl.load(sel_count_ptr + r).to(tl.int64)
    nf = tl.load(num_forced_ptr + r).to(tl.int64)
    req = tl.load(req_ptr + r).to(tl.int64)
    head = tl.load(head_ptr + r).to(tl.int64)
    is_sel = j < count
    logical = tl.load(sel_ptr + r * stride_sel + j, mask=is_sel & (j < max_select), other=0).to(tl.int64)
    block = tl.load(bt_ptr + req * stride_bt + logical, mask=is_sel, other=0).to(tl.int64)
    fj = tl.where(is_sel, 0, j - count)
    fj = tl.where(fj < nf, fj, 0)  # padding: the row's first forced page
    forced = tl.load(forced_ptr + r * stride_forced + fj, mask=j < width, other=0)
    ids = tl.where(is_sel, block * head_slots + head, forced)
    tl.store(out_ptr + r * width + j, ids, mask=j < width)
    if tl.program_id(1) == 0:
        total = (count + nf).to(tl.int32)
        tl.store(counts_ptr + r, total)
        tl.store(kv_lens_ptr + r, (total - 1) * page_size + tl.load(last_len_ptr + r))


def fill_page_tables_triton(
    sel_indices: torch.Tensor,
    sel_counts: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    head: torch.Tensor,
    forced_ids: torch.Tensor,
    num_forced: torch.Tensor,
    last_len: torch.Tensor,
    width: int,
    head_slots: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``[selected | forced | padding]`` physical page ids.

    Args:
        sel_indices: ``int64 [rows, max_select]`` logical pages (valid below ``sel_counts``).
        sel_counts: ``int32 [rows]``.
        block_table: ``int [B, max_blocks]``; req, head: ``int64 [rows]`` request and KV head.
        forced_ids: ``int64 [rows, F_max]`` physical ids of the forced pages; num_forced,
            last_len: ``int32 [rows]``.
        width: columns of the table (``max num_select + F``).
    Returns:
        ``(page_ids int64 [rows, width], counts int32 [rows], kv_lens int32 [rows])``.
    """
    rows = req.numel()
    device = req.device
    page_ids = torch.empty(rows, width, dtype=torch.int64, device=device)
    counts = torch.empty(rows, dtype=torch.int32, device=device)
    kv_lens = torch.empty(rows, dtype=torch.int32, device=device)
    if rows == 0 or width == 0:
        return page_ids, counts.zero_(), kv_lens.zero_()
    assert sel_indices.stride(-1) == 1 and block_table.stride(-1) == 1 and forced_ids.stride(-1) == 1
    block = 256  # fixed: a width-dependent tile would compile a kernel per width met while serving
    _fill_tables_kernel[(rows, triton.cdiv(width, block))](
        sel_indices,
        sel_counts,
        block_table,
        req,
        head,
        forced_ids,
        num_forced,
        last_len,
        page_ids,
        counts,
        kv_lens,
        width,
        sel_indices.shape[1],
        sel_indices.stride(0),
        block_table.stride(0),
        forced_ids.stride(0),
        head_slots,
        page_size,
        BLOCK=block,
    )
    return page_ids, counts, kv_lens
