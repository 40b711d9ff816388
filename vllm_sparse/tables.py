"""Stage 3, tables: Selection + forced pages -> ragged per-(request, KV head) page tables.

A row lists each attended page once: the selected past pages first (in selection order), then the
forced pages ascending (sink, local window, then the chunk's pages, or the decode tail). Only the
chunk's tokens can be causally masked, and they come last, complete except the very last page, so
a kernel that aligns the causal mask bottom-right over the row's compacted tokens masks exactly
as dense attention does; the order of the fully visible past pages does not change the result.

Everything that depends only on the step (which pages are forced, the rows' last-page lengths)
is built once per step on the device (``StepState.rows``, on the plan's ``state``) and shared by
every layer; a layer adds its selected pages with a handful of batched device ops, no host loop
over requests and no device-to-host sync. Steps without a sparse request reuse one table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import StepPlan
from vllm_sparse.selectors.base import Selection


@dataclass(frozen=True)
class PageTables:
    """Rows are request-major: ``row = request * Hkv + head``.

    Attributes:
        page_ids: ``int64 [rows, max_pages]`` physical page ids (``block * head_slots + head``);
            entries at or past ``counts[row]`` are padding (a valid page id of the same row).
        counts: ``int32 [rows]`` pages per row.
        kv_lens: ``int32 [rows]`` valid tokens of the row's compacted pages (the last may be partial).
    """

    page_ids: torch.Tensor
    counts: torch.Tensor
    kv_lens: torch.Tensor

    @property
    def attended_pages(self) -> int:
        return int(self.counts.sum())

    def attended_pages_of(self, requests: list[bool]) -> int:
        """Pages attended by the rows of the flagged requests (one flag per request; rows
        request-major, the same number per request)."""
        if not any(requests):
            return 0
        per_request = self.counts.numel() // len(requests)
        flags = torch.tensor(requests, dtype=torch.bool, device=self.counts.device)
        return int(self.counts[flags.repeat_interleave(per_request)].sum())


@dataclass(frozen=True)
class StepRows:
    """The per-step part of the tables, on the device (rows request-major).

    Attributes:
        req, head: ``int64 [rows]`` request and KV head of each row.
        forced_ids: ``int64 [rows, F_max]`` physical ids of the row's forced pages, ascending,
            padded with the row's first page.
        num_forced: ``int32 [rows]``.
        last_len: ``int32 [rows]`` tokens in the request's last page.
        width: pages of the widest row (``max num_select + F``), known on the host.
        max_select: ``max num_select`` over the requests.
        forced_src, forced_dst: ``int64 [E]`` flat positions of the valid forced entries in
            ``forced_ids`` and in a ``[rows, width]`` table whose rows select nothing.
        forced_row: ``int64 [E]`` row of each valid forced entry.
        block_table: ``int64 [B, max_blocks]`` the step's block table.
    """

    req: torch.Tensor
    head: torch.Tensor
    forced_ids: torch.Tensor
    num_forced: torch.Tensor
    last_len: torch.Tensor
    width: int
    max_select: int
    forced_src: torch.Tensor
    forced_dst: torch.Tensor
    forced_row: torch.Tensor
    block_table: torch.Tensor


def make_step_rows(plan: StepPlan, block_table: torch.Tensor, layout: PageLayout) -> StepRows:
    """The per-step part of the tables (``StepState.rows`` makes it once per step).

    Args: block_table ``int [B, max_blocks]`` (device); rows ``B * Hkv`` of ``layout.num_kv_heads``.
    """
    hkv, n = layout.num_kv_heads, layout.page_size
    device = block_table.device
    reqs = plan.requests
    # per request on the host: forced = [0, a) + [b, total)
    host = torch.tensor(
        [
            [r.forced_head, r.forced_tail, r.total_pages, r.seq_len - (r.total_pages - 1) * n]
            for r in reqs
        ],
        dtype=torch.int64,
    ).repeat_interleave(hkv, dim=0)  # [rows, 4]
    num_forced_host = host[:, 0] + host[:, 2] - host[:, 1]
    f_max = int(num_forced_host.max())
    width = max(r.num_pages for r in reqs)
    rows = len(reqs) * hkv
    dev = torch.cat([host, num_forced_host[:, None]], dim=1).to(device, non_blocking=True)
    a, b, last_len, num_forced = dev[:, 0:1], dev[:, 1:2], dev[:, 3], dev[:, 4]
    row = torch.arange(rows, device=device)
    req, head = row // hkv, row % hkv
    e = torch.arange(f_max, device=device)[None, :]
    valid = e < num_forced[:, None]
    logical = torch.where(e < a, e, b + e - a).masked_fill_(~valid, 0)
    block_table = block_table.long()
    blocks = block_table[req[:, None], logical]
    forced_ids = layout.page_ids(blocks, head[:, None])
    # valid entries' positions, from host-known counts (no nonzero, which would sync)
    forced_row = torch.repeat_interleave(row, num_forced, output_size=int(num_forced_host.sum()))
    starts = torch.cumsum(num_forced, 0) - num_forced
    within = torch.arange(forced_row.numel(), device=device) - starts[forced_row]
    forced_src = forced_row * f_max + within
    forced_dst = forced_row * width + within
    return StepRows(
        req,
        head,
        forced_ids,
        num_forced.int(),
        last_len.int(),
        width,
        plan.max_select,
        forced_src,
        forced_dst,
        forced_row,
        block_table,
    )


def step_rows(plan: StepPlan, block_table: torch.Tensor, layout: PageLayout) -> StepRows:
    """The per-step part of the tables, made once per step and shared by layers (``StepState.rows``)."""
    return plan.state.on(block_table, layout).rows


def forced_only_tables(s: StepRows, page_size: int) -> PageTables:
    """The tables of rows that select nothing: every row its forced pages (``page_ids int64 [rows,
    width]``, ``counts``/``kv_lens int32 [rows]``); a step's one copy is ``StepState.dense_tables``."""
    counts = s.num_forced
    return PageTables(s.forced_ids[:, : s.width], counts, (counts - 1) * page_size + s.last_len)


def build_page_tables(
    plan: StepPlan, selection: Selection, block_table: torch.Tensor, layout: PageLayout
) -> PageTables:
    """Args: block_table ``int [B, max_blocks]`` (logical page -> block); selection rows
    ``B * Hkv``; returns ``PageTables`` whose rows carry ``selection.counts[row] + F`` pages.
    """
    state = plan.state.on(block_table, layout)
    s = state.rows
    n = layout.page_size
    if s.max_select == 0:  # no sparse request: one table for every layer of the step
        return state.dense_tables
    sel_counts = selection.counts.to(torch.int32)
    if sel_counts.is_cuda:
        from vllm_sparse.kernels.page_tables import fill_page_tables_triton

        return PageTables(*fill_page_tables_triton(
            selection.indices, sel_counts, s.block_table, s.req, s.head, s.forced_ids, s.num_forced,
            s.last_len, s.width, layout.num_head_slots, n,
        ))  # fmt: skip
    return _fill_torch(s, selection.indices, sel_counts, layout)


def _fill_torch(s: StepRows, sel_indices: torch.Tensor, sel_counts: torch.Tensor, layout: PageLayout) -> PageTables:
    """The torch twin of ``kernels.page_tables.fill_page_tables_triton``."""
    rows, n, k = s.req.numel(), layout.page_size, s.max_select
    page_ids = s.forced_ids[:, :1].expand(rows, s.width).contiguous()  # padding: a page of the row
    valid = torch.arange(k, device=page_ids.device)[None, :] < sel_counts[:, None]
    logical = torch.where(valid, sel_indices[:, :k], 0)  # padding may hold anything
    picked = s.block_table[s.req[:, None], logical]
    page_ids[:, :k] = layout.page_ids(picked, s.head[:, None])
    # forced pages right after each row's selected ones
    dst = s.forced_dst + sel_counts.long()[s.forced_row]
    page_ids.view(-1)[dst] = s.forced_ids.view(-1)[s.forced_src]
    counts = sel_counts + s.num_forced
    return PageTables(page_ids, counts, (counts - 1) * n + s.last_len)
