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

from vllm_sparse.config import LayerPolicy
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.policy import RequestPlan, StepPlan
from vllm_sparse.selectors.base import Selection, chunk_queries, empty_selection, past_page_ids


def query_mean_similarity(q: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``float32 [Hq, C]``: ``(q . mean) / ||q||`` for ``q [C, Hq, D]`` and ``mean float32 [Hq, D]``
    (the cosine to the head's mean up to a per-head constant). Triton on CUDA, torch elsewhere."""
    if q.is_cuda and q.stride(-1) == 1:
        from vllm_sparse.kernels.quoka_query import query_mean_similarity_triton

        return query_mean_similarity_triton(q, mean)
    qf = q.float()
    return ((qf * mean).sum(-1) / qf.norm(dim=-1).clamp_min(1e-12)).T


def subselect_queries(q: torch.Tensor, num_queries: int) -> torch.Tensor:
    """The ``num_queries`` queries per head least similar to the head's mean query.

    Args:
        q: ``[C, Hq, D]`` (any float dtype; kept).
    Returns:
        ``[min(C, num_queries), Hq, D]``, ordered by rank (most dissimilar first) when subselected.
    """
    c, hq, _ = q.shape
    if c <= num_queries:
        return q
    mean = q.sum(dim=0, dtype=torch.float32) / c  # [Hq, D]
    sim = query_mean_similarity(q, mean)  # [Hq, C]
    idx = torch.topk(sim, num_queries, dim=1, largest=False).indices  # [Hq, NQ], ascending
    return q[idx.T, torch.arange(hq, device=q.device)[None, :]]


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
    """Page scores ``[Hkv, P]``: the Triton kernel on CUDA, the native kernel on CPU (both read the
    keys in place), else the torch twin."""
    if qbar.is_cuda and page_keys.stride(-1) == 1:
        from vllm_sparse.kernels.quoka_score import score_pages_triton

        return score_pages_triton(qbar, page_keys, ids.contiguous())
    from vllm_sparse.kernels import cpu_native

    if cpu_native.usable(qbar, page_keys, ids):
        return cpu_native.quoka_score(qbar, page_keys, ids)
    return score_pages(qbar, page_keys[ids])


def _score_topk(qbar: torch.Tensor, page_keys: torch.Tensor, ids: torch.Tensor, excluded, k: int):
    """Fused native CPU scoring + excluded mask + top-k (``int64 [R, k]``), or ``None`` where the
    native kernels do not apply (GPU tensors, no compiler, ``VLLM_SPARSE_NATIVE=0``)."""
    from vllm_sparse.kernels import cpu_native

    if not cpu_native.usable(qbar, page_keys, ids, excluded):
        return None
    return cpu_native.quoka_score_topk(qbar, page_keys, ids, excluded, k)


def _top_pages(qbar: torch.Tensor, page_keys: torch.Tensor, ids: torch.Tensor, excluded, k: int) -> torch.Tensor:
    """Indices ``int64 [R, k]`` into ``ids``' columns of the ``k`` best-scoring pages per row.

    Args:
        qbar: ``float32 [R, nq, D]`` grouped queries; ids: ``int [R, P]`` physical pages;
        excluded: column indices ``int64 [F]`` (every row) or a mask ``bool [R, P]`` never picked.
    """
    top = _score_topk(qbar, page_keys, ids, excluded, k)
    if top is not None:
        return top
    scores = _score(qbar, page_keys, ids)  # [R, P]
    if excluded.dtype == torch.bool:
        scores.masked_fill_(excluded, float("-inf"))
    else:
        scores.index_fill_(1, excluded, float("-inf"))  # no sync (index_put would)
    return torch.topk(scores, k, dim=1).indices


class QuokaSelector:
    fixed_counts = True  # exactly num_select pages per sparse row

    def __init__(self, num_queries: int = 64, query_window: int | None = None):
        """``num_queries``: queries kept per chunk and query head (N_Q); ``query_window``: prefill
        chunks subselect among their last ``query_window`` queries only (None: every query)."""
        self.num_queries = num_queries
        self.query_window = query_window

    def __call__(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        block_table: torch.Tensor,
        layout: PageLayout,
        plan: StepPlan,
        meta: PageMeta | None = None,
    ) -> Selection:
        """See ``selectors.base.Selector``; query ``[T, Hq, D]``, returns rows ``B * Hkv``; no metadata.

        Sparse decode requests (one query token each) are scored together in one batch; prefill
        chunks one request at a time.
        """
        hkv = layout.num_kv_heads
        state = plan.state.on(block_table, layout)
        sel = empty_selection(plan, hkv, query.device)
        batch = state.decode
        if batch is not None:
            q = query[batch.tokens]  # [nd, Hq, D]
            qbar = group_query(q.float(), hkv).transpose(0, 1).reshape(-1, 1, q.shape[-1])  # [nd * Hkv, 1, D]
            top = _top_pages(qbar, page_keys, batch.page_ids, batch.excluded, batch.max_select)
            sel.indices[batch.rows, : batch.max_select] = top
            sel.counts[batch.rows] = batch.counts
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0 or (batch is not None and req.query_len == 1):
                continue
            top = self.chunk_pages(query, r, req, page_keys, block_table, layout, state.forced_past[r])
            rows = slice(r * hkv, (r + 1) * hkv)
            sel.indices[rows, : req.num_select] = top
            sel.counts[rows] = req.num_select
        return sel

    def chunk_pages(
        self,
        query: torch.Tensor,
        r: int,
        req: RequestPlan,
        page_keys: torch.Tensor,
        block_table: torch.Tensor,
        layout: PageLayout,
        forced_past: torch.Tensor,
    ) -> torch.Tensor:
        """The pages request ``r`` 's chunk selects (the steps above for one request).

        Args:
            query: ``[T, Hq, D]`` the step's queries; the chunk's are ``req`` 's rows of it.
            page_keys: ``[num_pages, N, D]`` keys by physical page id.
            block_table: ``int [B, max_blocks]``.
            forced_past: ``int64 [F]`` past pages never picked (sink, local window).
        Returns:
            ``int64 [Hkv, req.num_select]`` logical pages, best first.
        """
        q = subselect_queries(chunk_queries(query, req, self.query_window), self.num_queries)
        qbar = group_query(q.float(), layout.num_kv_heads)  # [Hkv, n, D]
        ids = past_page_ids(block_table, r, req.num_past_pages, layout)  # [Hkv, P]
        return _top_pages(qbar, page_keys, ids, forced_past, req.num_select)

    def select_decode(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        layout: PageLayout,
        meta: PageMeta | None,
        step: DecodeStep,
        policy: LayerPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``selectors.base.Selector.select_decode``: the cosine of the group's mean unit query
        with every key of a page (max over the page), then the best ``SELECT`` pages of each row."""
        from vllm_sparse.kernels.page_topk import select_top_pages_triton
        from vllm_sparse.kernels.quoka_score import quoka_decode_scores_triton

        hkv, b = layout.num_kv_heads, step.num_reqs
        cols = step.columns[policy]
        scores = quoka_decode_scores_triton(
            query[:b], page_keys, step.block_table, cols, hkv, layout.num_head_slots, step.page_cap
        )
        return select_top_pages_triton(scores, cols, hkv, step.select_caps[policy], counters=step.topk_counters)
