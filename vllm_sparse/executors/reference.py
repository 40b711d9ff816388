"""Torch gather + attention over the selected pages: the test oracle, and the CPU executor for now."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables


def attend_request(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of one request's queries over its rows' compacted pages.

    The mask is bottom-right aligned: query ``i`` of ``C`` sees compacted token ``j`` when
    ``j <= kv_len - C + i`` (see ``tables``).

    Args:
        q: ``[C, Hkv, G, D]``.
        keys, values: ``[Hkv, P * N, D]`` the rows' pages, gathered.
        kv_lens: ``[Hkv]`` valid tokens per row.
    Returns:
        ``[C, Hkv, G, D]``.
    """
    c = q.shape[0]
    t = keys.shape[1]
    j = torch.arange(t, device=q.device)
    i = torch.arange(c, device=q.device)
    limit = kv_lens.to(q.device).long()[:, None, None] - c + i[None, :, None]  # [Hkv, C, 1]
    mask = (j[None, None, :] <= limit)[:, None]  # [Hkv, 1, C, T]
    g = q.shape[2]
    # K/V expanded (a view) to the G query heads: torch's CPU kernel is ~5x slower when it
    # broadcasts a single KV head itself.
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),  # [Hkv, G, C, D]
        keys[:, None].expand(-1, g, -1, -1),
        values[:, None].expand(-1, g, -1, -1),
        attn_mask=mask,
        scale=scale,
    )
    return out.permute(2, 0, 1, 3)


def reference_executor(
    query: torch.Tensor,
    page_keys: torch.Tensor,
    page_values: torch.Tensor,
    tables: PageTables,
    plan: StepPlan,
    scale: float,
    output: torch.Tensor,
) -> None:
    """See ``executors.base.Executor``; shapes: query/output ``[T, Hq, D]``, pages ``[P, N, D]``."""
    num_rows = tables.page_ids.shape[0]
    hkv = num_rows // max(len(plan.requests), 1)
    _, n, d = page_keys.shape
    for r, req in enumerate(plan.requests):
        rows = slice(r * hkv, (r + 1) * hkv)
        ids = tables.page_ids[rows, : req.num_pages]  # [Hkv, P]
        keys = page_keys[ids].reshape(hkv, -1, d)
        values = page_values[ids].reshape(hkv, -1, d)
        toks = slice(req.query_start, req.query_start + req.query_len)
        q = query[toks].view(req.query_len, hkv, -1, d)
        out = attend_request(q, keys, values, tables.kv_lens[rows], scale)
        output[toks] = out.reshape(req.query_len, -1, d).to(output.dtype)
