"""Twilight: candidates from a base selector, pruned to a top-p attention-mass page set.

Per sparse request and KV head:

1. the base selector (Quest by default) proposes ``plan.num_select`` candidate past pages (the
   policy caps that at ``twilight.candidate_fraction`` of the context and at the budget);
2. every query head estimates its attention weights over the candidate tokens and the forced
   past tokens (sink, local window) from the INT4 key shadows
   (``metadata/int4_shadow.py``): ``softmax(q . k_int4 * scale)``; in a prefill chunk the
   weights are averaged over the chunk's queries (a decode step is a chunk of one);
3. a page's mass is the sum of its tokens' weights; the head keeps the smallest set of candidate
   pages, by descending mass, whose mass plus the forced pages' mass reaches ``top_p``
   (sort + cumulative sum: exact, no binary-search tolerance);
4. the kept sets of the G query heads are united per KV head. Rows therefore carry a variable
   number of pages (``Selection.counts``), at most the candidate count.

Differences from the paper: pages rather than tokens are kept (a page with a heavy token is
kept whole), the forced sink/local pages count towards ``top_p`` (the chunk's own tokens do not
enter the estimate), and chunks use the mean distribution over their queries; the paper is
decode-only.
"""

from __future__ import annotations

import torch

from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.metadata.int4_shadow import dequantize_int4
from vllm_sparse.policy import StepPlan
from vllm_sparse.selectors.base import Selection, Selector, empty_selection, forced_past

QUERY_BLOCK = 128  # chunk queries estimated at a time


def estimate_page_mass(q: torch.Tensor, keys: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """Estimated attention mass per page, mean over the chunk's queries.

    Args:
        q: ``[C, Hq, D]`` queries.
        keys: ``[Hkv, P * N, D]`` float32 (dequantized shadow) keys of ``P`` pages.
        page_size: ``N``.
        scale: softmax scale.
    Returns:
        ``[Hkv, G, P]`` float32: ``mean_c sum_{t in page} softmax_t(q[c, h] . keys[t] * scale)``.
    """
    c, hq, d = q.shape
    hkv, t, _ = keys.shape
    g = hq // hkv
    total = torch.zeros(hkv, g, t, dtype=torch.float32, device=q.device)
    for start in range(0, c, QUERY_BLOCK):
        qb = q[start : start + QUERY_BLOCK].float()
        qg = qb.view(-1, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)  # [Hkv, G*c, D]
        w = torch.softmax(qg @ keys.transpose(1, 2) * scale, dim=-1)  # [Hkv, G*c, T]
        total += w.view(hkv, g, -1, t).sum(dim=2)
    return (total / c).view(hkv, g, t // page_size, page_size).sum(dim=-1)


def top_p_keep(cand_mass: torch.Tensor, forced_mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest per-head page sets reaching ``top_p``, united over the GQA group.

    Args:
        cand_mass: ``[Hkv, G, K]`` mass of each candidate page per query head.
        forced_mass: ``[Hkv, G]`` mass already attended through forced pages.
        top_p: target mass.
    Returns:
        ``bool [Hkv, K]``: candidate kept by at least one head of the group.
    """
    mass, order = cand_mass.sort(dim=-1, descending=True)
    before = mass.cumsum(dim=-1) - mass  # mass of the heavier pages, [Hkv, G, K]
    need = top_p - forced_mass  # [Hkv, G]
    keep_sorted = before < need[..., None]  # page needed while the target is not reached yet
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep.any(dim=1)


class TwilightSelector:
    def __init__(self, base: Selector, top_p: float = 0.95, scale: float | None = None):
        """``base``: candidate selector; ``scale``: softmax scale (default ``1/sqrt(D)``)."""
        self.base = base
        self.top_p = top_p
        self.scale = scale

    def __call__(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        block_table: torch.Tensor,
        layout: PageLayout,
        plan: StepPlan,
        meta: PageMeta | None = None,
    ) -> Selection:
        """See ``selectors.base.Selector``; query ``[T, Hq, D]``, reads ``meta.codes``
        ``[num_blocks, Hkv, N, D/2]`` and ``meta.scale/zero [num_blocks, Hkv, N]``; returns rows
        ``B * Hkv`` with ``counts <= num_select``, kept pages first."""
        if meta is None or meta.codes is None:
            raise ValueError("sparse_twilight needs the INT4 key shadow planes (PageMeta.codes)")
        cand = self.base(query, page_keys, block_table, layout, plan, meta)
        hkv, n = layout.num_kv_heads, layout.page_size
        sel = empty_selection(plan, hkv, query.device)
        scale = self.scale or query.shape[-1] ** -0.5
        heads = torch.arange(hkv, device=query.device)[:, None]
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0:
                continue
            rows = slice(r * hkv, (r + 1) * hkv)
            k = req.num_select
            picked = cand.indices[rows, :k]  # [Hkv, K] logical candidate pages
            forced = forced_past(req, picked.device)
            pages = torch.cat([forced[None, :].expand(hkv, -1), picked], dim=1)  # [Hkv, F + K]
            blocks = block_table[r].long()[pages]
            keys = dequantize_int4(meta.codes[blocks, heads], meta.scale[blocks, heads], meta.zero[blocks, heads])
            q = query[req.query_start : req.query_start + req.query_len]
            mass = estimate_page_mass(q, keys.flatten(1, 2), n, scale)  # [Hkv, G, F + K]
            f = forced.numel()
            keep = top_p_keep(mass[..., f:], mass[..., :f].sum(dim=-1), self.top_p)  # [Hkv, K]
            order = (~keep).to(torch.int8).argsort(dim=1, stable=True)  # kept pages first
            sel.indices[rows, :k] = picked.gather(1, order)
            sel.counts[rows] = keep.sum(dim=1).to(torch.int32)
        return sel
