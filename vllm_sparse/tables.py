"""Stage 3, tables: Selection + forced pages -> ragged per-(request, KV head) page tables.

Each row lists physical page ids in ascending position order, never a page twice. The chunk's
pages (or the decode tail) come last, complete except the very last page, so a kernel that aligns
the causal mask bottom-right over the row's compacted tokens masks exactly as dense attention does:
every earlier entry is a complete past page, every later-than-allowed token is in the chunk.
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
            entries at or past ``counts[row]`` are padding.
        counts: ``int32 [rows]`` pages per row.
        kv_lens: ``int32 [rows]`` valid tokens of the row's compacted pages (the last may be partial).
    """

    page_ids: torch.Tensor
    counts: torch.Tensor
    kv_lens: torch.Tensor

    @property
    def attended_pages(self) -> int:
        return int(self.counts.sum())


def logical_rows(plan: StepPlan, selection: Selection, request: int, num_kv_heads: int) -> torch.Tensor:
    """Ascending logical pages of one request's rows: ``int64 [Hkv, F + num_select]``.

    Row ``h`` holds its ``F + selection.counts[row]`` valid pages first, ascending; the rest are
    padding, equal to ``total_pages`` (past every real page). Computed on the device, no sync.
    """
    req = plan.requests[request]
    forced = req.forced_on(selection.indices.device)[None, :].expand(num_kv_heads, -1)
    if req.num_select == 0:
        return forced
    rows = slice(request * num_kv_heads, (request + 1) * num_kv_heads)
    picked = selection.indices[rows, : req.num_select]
    valid = torch.arange(req.num_select, device=picked.device)[None, :] < selection.counts[rows, None]
    picked = torch.where(valid, picked, torch.full_like(picked, req.total_pages))
    return torch.cat([forced, picked], dim=1).sort(dim=1).values


def build_page_tables(
    plan: StepPlan, selection: Selection, block_table: torch.Tensor, layout: PageLayout
) -> PageTables:
    """Args: block_table ``int [B, max_blocks]`` (logical page -> block); returns ``PageTables``.

    Rows carry ``F + selection.counts[row]`` pages (F = the request's forced pages); padding
    entries past a row's count hold a valid page id of the same row, so gathers stay in bounds
    and ``kv_lens`` masks them out.
    """
    hkv, n = layout.num_kv_heads, layout.page_size
    device = block_table.device
    num_rows = len(plan.requests) * hkv
    width = max((r.num_pages for r in plan.requests), default=0)
    page_ids = torch.zeros(num_rows, width, dtype=torch.int64, device=device)
    counts = torch.empty(num_rows, dtype=torch.int32, device=device)
    kv_lens = torch.empty(num_rows, dtype=torch.int32, device=device)
    heads = torch.arange(hkv, device=device)[:, None]
    sel_counts = selection.counts.to(device)
    for r, req in enumerate(plan.requests):
        logical = logical_rows(plan, selection, r, hkv).to(device)
        blocks = block_table[r].long()[logical.clamp(max=req.total_pages - 1)]  # [Hkv, F + k]
        rows = slice(r * hkv, (r + 1) * hkv)
        page_ids[rows, : logical.shape[1]] = layout.page_ids(blocks, heads)
        last_len = req.seq_len - (req.total_pages - 1) * n
        row_counts = req.forced.numel() + (sel_counts[rows] if req.num_select else 0)
        counts[rows] = row_counts
        kv_lens[rows] = (counts[rows] - 1) * n + last_len
    return PageTables(page_ids, counts, kv_lens)
