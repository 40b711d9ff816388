"""The row geometry of a step plan, shared by the executors that run (request, KV head) rows: per row
its query tokens, pages and offsets (host), and the positions of its ragged entries (device).

Rows are request-major (``row = request * Hkv + head``); everything is built from lengths the plan
knows on the host, so nothing here waits for the GPU.
"""

from __future__ import annotations

import torch

from vllm_sparse.policy import StepPlan


def row_lengths(plan: StepPlan, hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host ``int64 [rows]`` query tokens, pages, last-page tokens and query start of every row."""
    n = plan.page_size
    per_req = torch.tensor(
        [[r.query_len, r.num_pages, r.seq_len - (r.total_pages - 1) * n, r.query_start] for r in plan.requests],
        dtype=torch.int64,
    ).repeat_interleave(hkv, dim=0)
    return per_req[:, 0], per_req[:, 1], per_req[:, 2], per_req[:, 3]


def indptr(lengths: torch.Tensor) -> torch.Tensor:
    """Host ``int32 [rows + 1]`` offsets of rows of host ``lengths``."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def ragged_positions(lengths: torch.Tensor, starts: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of host ``lengths``: ``(row, starts[row] + i)`` of every entry ``i < lengths[row]``,
    built on ``device`` from the host-known total (no sync)."""
    total = int(lengths.sum())
    lens = lengths.to(device, non_blocking=True)
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens
    within = torch.arange(total, device=device) - first[row]
    return row, starts.to(device, non_blocking=True)[row] + within
