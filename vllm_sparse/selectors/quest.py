"""Quest: per-page upper bounds of q.k from the page's channel-wise key min and max.

Per sparse request and KV head, with the page summaries ``kmin, kmax`` kept in the page's
metadata slots (``metadata/page_minmax.py``):

1. every query head scores every past page with ``U = sum_c max(q_c * kmax_c, q_c * kmin_c)``,
   an upper bound of ``q.k`` over the keys of the page (computed as ``q+ . kmax + q- . kmin``);
   in a prefill chunk the page's score is the max over the chunk's queries;
2. the G query heads of a KV head are reduced by ``gqa_reduce``:
   * ``max``: the largest bound over the group;
   * ``sum``: each head's bounds are normalised to a distribution over the candidate pages
     (softmax of ``U * scale``, i.e. the bound read as a logit), then summed over the group;
   * ``union``: per-head rankings merged rank by rank (every head's best page, then every head's
     second, ...) until the budget is full: the union of per-head top-k_h with the largest
     k_h that fits the budget, so the count stays the budget;
3. the top ``plan.num_select`` pages that are not forced (sink, local window) are selected.

Differences from the paper: Quest is decode-only and MHA; chunks (max over queries) and the
GQA reduction are our extensions, and sink/local pages are forced on top.
"""

from __future__ import annotations

from typing import Literal

import torch

from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.policy import StepPlan
from vllm_sparse.selectors.base import Selection, empty_selection, forced_past

GqaReduce = Literal["max", "sum", "union"]
QUERY_BLOCK = 256  # chunk queries scored at a time (bounds the [Hkv, G, C, P] intermediate)


def page_upper_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest bounds of every query head for every page, max over the chunk's queries.

    Args:
        q: ``[C, Hq, D]`` queries (any float dtype; computed in float32).
        kmin, kmax: ``[Hkv, P, D]`` page summaries of the KV heads.
    Returns:
        ``[Hkv, G, P]`` float32: ``max_c sum_d max(q[c,h,d] * kmax[p,d], q[c,h,d] * kmin[p,d])``
        for query head ``h = kv_head * G + g``.
    """
    c, hq, d = q.shape
    hkv = kmin.shape[0]
    g = hq // hkv
    kmin, kmax = kmin.float(), kmax.float()
    best = None
    for start in range(0, c, QUERY_BLOCK):
        qb = q[start : start + QUERY_BLOCK].float()
        qg = qb.view(-1, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)  # [Hkv, G*c, D]
        u = qg.clamp(min=0) @ kmax.transpose(1, 2) + qg.clamp(max=0) @ kmin.transpose(1, 2)
        u = u.view(hkv, g, -1, u.shape[-1]).amax(dim=2)  # [Hkv, G, P]
        best = u if best is None else torch.maximum(best, u)
    return best


def reduce_and_pick(scores: torch.Tensor, excluded: torch.Tensor, k: int, rule: GqaReduce, scale: float) -> torch.Tensor:
    """Reduce per-head page scores over the GQA group and pick ``k`` pages per KV head.

    Args:
        scores: ``[Hkv, G, P]`` per query head page scores.
        excluded: ``int64 [F]`` pages never picked (forced ones).
        k: pages to pick, ``<= P - F``.
        rule: ``max``, ``sum`` (of per-head softmax-normalised scores) or ``union`` (rank merge).
        scale: softmax scale of ``sum``.
    Returns:
        ``int64 [Hkv, k]`` picked pages (distinct, not excluded; order unspecified).
    """
    hkv, g, p = scores.shape
    s = scores.clone()
    s[:, :, excluded] = float("-inf")
    if rule == "max":
        return torch.topk(s.amax(dim=1), k, dim=1).indices
    if rule == "sum":
        return torch.topk(torch.softmax(s * scale, dim=-1).sum(dim=1), k, dim=1).indices
    if rule == "union":
        order = s.argsort(dim=-1, descending=True, stable=True)  # [Hkv, G, P] pages by rank
        merged = order.transpose(1, 2).reshape(hkv, p * g)  # rank-major: rank 0 of every head, ...
        first = torch.full((hkv, p), p * g, dtype=torch.int64, device=s.device)
        pos = torch.arange(p * g, device=s.device).expand(hkv, -1)
        first.scatter_reduce_(1, merged, pos, "amin")  # first position of each page in the merge
        return first.argsort(dim=1)[:, :k]
    raise ValueError(f"unknown gqa_reduce {rule!r}")


class QuestSelector:
    def __init__(self, gqa_reduce: GqaReduce = "max", scale: float | None = None):
        """``scale``: softmax scale for ``sum`` (default ``1/sqrt(D)``)."""
        self.gqa_reduce = gqa_reduce
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
        """See ``selectors.base.Selector``; query ``[T, Hq, D]``, reads ``meta.kmin/kmax``
        ``[num_blocks, Hkv, D]``; returns rows ``B * Hkv`` with ``counts == num_select``."""
        if meta is None or meta.kmin is None:
            raise ValueError("sparse_quest needs the key min/max planes (PageMeta.kmin/kmax)")
        hkv = layout.num_kv_heads
        sel = empty_selection(plan, hkv, query.device)
        scale = self.scale or query.shape[-1] ** -0.5
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0:
                continue
            blocks = block_table[r, : req.num_past_pages].long()
            kmin = meta.kmin[blocks].transpose(0, 1)  # [Hkv, P, D]
            kmax = meta.kmax[blocks].transpose(0, 1)
            q = query[req.query_start : req.query_start + req.query_len]
            scores = page_upper_bounds(q, kmin, kmax)  # [Hkv, G, P]
            top = reduce_and_pick(scores, forced_past(req, scores.device), req.num_select, self.gqa_reduce, scale)
            rows = slice(r * hkv, (r + 1) * hkv)
            sel.indices[rows, : req.num_select] = top
            sel.counts[rows] = req.num_select
        return sel
