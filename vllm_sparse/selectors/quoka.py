"""QuoKA: query-oriented KV selection (the chunk's most mean-dissimilar queries vote by cosine).

Per sparse request and KV head, for a chunk of C queries (a decode step is a chunk of one):

1. keep the ``num_queries`` queries of each query head least cosine-similar to that head's mean
   query over the chunk (all of them when C <= num_queries);
2. unit-normalise them and average over the G query heads of the group, pairing queries by
   rank (QuoKA's pre-aggregation: mean over heads of cosines == dot with the mean unit query);
3. cosine-score every past key, take the max over the kept queries;
4. a page scores the max of its tokens; the top ``plan.num_select`` pages that are not forced
   (sink, local window) are selected.

Differences from the paper: selection is per page (vLLM block) instead of per token, and the
sink and local window are forced on top; see docs in README.
"""

from __future__ import annotations

import torch

from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.policy import StepPlan
from vllm_sparse.selectors.base import Selection, empty_selection, forced_past, past_page_ids


def subselect_queries(q: torch.Tensor, num_queries: int) -> torch.Tensor:
    """The ``num_queries`` queries per head least similar to the head's mean query.

    Args:
        q: ``[C, Hq, D]`` float32.
    Returns:
        ``[min(C, num_queries), Hq, D]``, ordered by rank (most dissimilar first) when subselected.
    """
    if q.shape[0] <= num_queries:
        return q
    mean = q.mean(dim=0, keepdim=True)  # [1, Hq, D]
    sim = torch.nn.functional.cosine_similarity(q, mean, dim=-1)  # [C, Hq]
    idx = torch.topk(-sim, num_queries, dim=0).indices  # [NQ, Hq]
    return torch.gather(q, 0, idx[:, :, None].expand(-1, -1, q.shape[-1]))


def group_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Unit-normalise ``[n, Hq, D]`` queries and average over each GQA group -> ``[Hkv, n, D]``."""
    n, hq, d = q.shape
    unit = torch.nn.functional.normalize(q, dim=-1)
    return unit.view(n, num_kv_heads, hq // num_kv_heads, d).mean(dim=2).transpose(0, 1)


def score_pages(qbar: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Page scores ``[Hkv, P]`` from grouped queries ``[Hkv, n, D]`` and keys ``[Hkv, P, N, D]``."""
    # Channel-major keys [Hkv, D, P*N] (how the CPU cache stores K) make one GEMM per KV head
    # instead of one per page, and the unit keys are never materialised: cos = (q . k) / |k|.
    h, p, n, d = keys.shape
    kt = keys.permute(0, 3, 1, 2).reshape(h, d, p * n).float()
    inv_norm = kt.pow(2).sum(dim=1).clamp_min(1e-24).rsqrt()  # [Hkv, P*N]
    dots = torch.bmm(qbar, kt)  # [Hkv, nq, P*N]
    return (dots.amax(dim=1) * inv_norm).view(h, p, n).amax(dim=-1)


def _score(qbar: torch.Tensor, page_keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Page scores ``[Hkv, P]``: the Triton kernel on CUDA (keys read in place), the torch twin elsewhere."""
    if qbar.is_cuda and page_keys.stride(-1) == 1:
        from vllm_sparse.kernels.quoka_score import score_pages_triton

        return score_pages_triton(qbar, page_keys, ids.contiguous())
    return score_pages(qbar, page_keys[ids])


class QuokaSelector:
    def __init__(self, num_queries: int = 64):
        self.num_queries = num_queries

    def __call__(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        block_table: torch.Tensor,
        layout: PageLayout,
        plan: StepPlan,
        meta: PageMeta | None = None,
    ) -> Selection:
        """See ``selectors.base.Selector``; query ``[T, Hq, D]``, returns rows ``B * Hkv``; no metadata."""
        hkv = layout.num_kv_heads
        sel = empty_selection(plan, hkv, query.device)
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0:
                continue
            q = query[req.query_start : req.query_start + req.query_len].float()
            qbar = group_query(subselect_queries(q, self.num_queries), hkv)
            ids = past_page_ids(block_table, r, req.num_past_pages, layout)  # [Hkv, P]
            scores = _score(qbar, page_keys, ids)  # [Hkv, P]
            forced = forced_past(req, scores.device)
            scores[:, forced] = float("-inf")
            top = torch.topk(scores, req.num_select, dim=1).indices
            rows = slice(r * hkv, (r + 1) * hkv)
            sel.indices[rows, : req.num_select] = top
            sel.counts[rows] = req.num_select
        return sel
