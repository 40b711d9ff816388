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

Prefill chunks with ``quest.prefill_scores: exact`` (Quest's default) skip steps 1-2 and rank pages by
QuoKA's exact scores instead (``QuokaSelector.chunk_pages``: the cosine of subselected queries
with every key of a page). A bound is all a decode step can afford, since reading every past key
to rank pages costs as much as attending them; a chunk of thousands of queries reads the keys
once for all of them. On Qwen2.5-Coder-0.5B at 32K the bounds' ranking lost a quarter of the
multi-key answers even with dense decode; the exact scores recover most of it (README, issue 16).

The sparse decode requests of a step (one query each) are scored together: rows = decode
requests x KV heads, page lists padded to the longest request (padding and forced pages
excluded by a mask), one bounds launch, one GQA reduction and one top-k with the largest count;
each row keeps its own count. Prefill chunks go one request at a time.

Differences from the paper: Quest is decode-only and MHA; chunks (max over queries) and the
GQA reduction are our extensions, and sink/local pages are forced on top.
"""

from __future__ import annotations

from typing import Literal

import torch

from vllm_sparse.config import LayerPolicy
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.metadata.minmax_int8 import decode_minmax_int8
from vllm_sparse.policy import HEAD, TAIL, StepPlan
from vllm_sparse.selectors.base import Selection, chunk_queries, empty_selection
from vllm_sparse.selectors.decode_batch import DecodeBatch
from vllm_sparse.selectors.quoka import QuokaSelector

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


def page_upper_bounds_rows(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quest bounds of one query per slot (request) over the slot's pages, every KV head a row.

    Args:
        q: ``[S, Hq, D]`` one query per slot (a decode token).
        kmin, kmax: ``[num_blocks, Hkv, D]`` the metadata planes, or their ``int8`` codes with
        scale: ``float32 [num_blocks, Hkv]`` (``layout.PageMeta.mscale``; None: planes).
        blocks: ``int64 [S, P]`` physical block of each page of each slot.
    Returns:
        ``[S * Hkv, G, P]`` float32, row ``slot * Hkv + kv_head``: row by row what
        ``page_upper_bounds(q[slot:slot + 1], kmin[blocks[slot]].transpose(0, 1), ...)`` gives.
    """
    s, hq, d = q.shape
    hkv = kmin.shape[1]
    g, p = hq // hkv, blocks.shape[1]
    out = torch.empty(s * hkv, g, p, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 24) // max(1, p * hkv * d))  # slots at a time: bounds the gathered summaries
    for a in range(0, s, step):
        b = min(a + step, s)
        qg = q[a:b].float().view(b - a, hkv, g, d)
        lo, hi = kmin[blocks[a:b]].float(), kmax[blocks[a:b]].float()  # [s', P, Hkv, D]
        if scale is not None:
            lo, hi = decode_minmax_int8(lo, scale[blocks[a:b]]), decode_minmax_int8(hi, scale[blocks[a:b]])
        lo, hi = lo.transpose(1, 2), hi.transpose(1, 2)  # [s', Hkv, P, D]
        u = qg.clamp(min=0) @ hi.transpose(-1, -2) + qg.clamp(max=0) @ lo.transpose(-1, -2)  # [s', Hkv, G, P]
        out[a * hkv : b * hkv] = u.view(-1, g, p)
    return out


def _triton_ok(q: torch.Tensor, meta: PageMeta) -> bool:
    """Whether the Triton kernel scores (CUDA tensors it can read in place)."""
    return q.is_cuda and q.stride(-1) == 1 and meta.kmin.stride(-1) == 1


def _native_ok(q: torch.Tensor, meta: PageMeta, blocks: torch.Tensor) -> bool:
    """Whether the native CPU kernel scores (``kernels.cpu_native``: CPU tensors, library loaded)."""
    from vllm_sparse.kernels import cpu_native

    return cpu_native.usable(q, meta.kmin, meta.kmax, blocks)


def _bounds(q: torch.Tensor, meta: PageMeta, blocks: torch.Tensor) -> torch.Tensor:
    """``[Hkv, G, P]`` bounds of the pages in ``blocks`` (``int64 [P]``): the Triton kernel on CUDA,
    the native kernel on CPU (both read min/max in place), else the torch twin."""
    if _triton_ok(q, meta):
        from vllm_sparse.kernels.quest_score import page_upper_bounds_triton

        return page_upper_bounds_triton(q, meta.kmin, meta.kmax, blocks)
    if _native_ok(q, meta, blocks):
        from vllm_sparse.kernels import cpu_native

        return cpu_native.quest_bounds(q, meta.kmin, meta.kmax, blocks)
    return page_upper_bounds(q, meta.kmin[blocks].transpose(0, 1), meta.kmax[blocks].transpose(0, 1))


def _decode_bounds(query: torch.Tensor, meta: PageMeta, batch: DecodeBatch, int8: bool = False) -> torch.Tensor:
    """``[nd * Hkv, G, P_max]`` bounds of every decode row of the step (one launch on CUDA, one
    native call on CPU; from the INT8 codes of the planes with ``int8``, by the torch twin: the
    device decode path, ``select_decode``, reads them in its kernels); entries of padding pages are
    unspecified (the batch excludes them)."""
    if int8:
        return page_upper_bounds_rows(query[batch.tokens], meta.kmin8, meta.kmax8, batch.blocks, meta.mscale)
    if _triton_ok(query, meta):
        from vllm_sparse.kernels.quest_score import page_upper_bounds_rows_triton

        return page_upper_bounds_rows_triton(query, meta.kmin, meta.kmax, batch.tokens, batch.blocks, batch.num_pages)
    if _native_ok(query, meta, batch.blocks):
        from vllm_sparse.kernels import cpu_native

        return cpu_native.quest_bounds_rows(query[batch.tokens], meta.kmin, meta.kmax, batch.blocks)
    return page_upper_bounds_rows(query[batch.tokens], meta.kmin, meta.kmax, batch.blocks)


def group_scores(scores: torch.Tensor, excluded: torch.Tensor, rule: GqaReduce, scale: float) -> torch.Tensor:
    """Reduce per-head page scores over the GQA group to one ranking score per page.

    Args:
        scores: ``[R, G, P]`` per query head page scores.
        excluded: pages never picked: column indices ``int64 [F]`` (every row) or a mask
            ``bool [R, P]``; they score ``-inf`` (``union``: rank after every other page).
        rule: ``max``, ``sum`` (of per-head softmax-normalised scores) or ``union`` (rank merge:
            the negated first position of the page in the rank-major merge of the heads'
            rankings, so that the top ``k`` are the union of per-head top-``k_h``).
        scale: softmax scale of ``sum``.
    Returns:
        ``float32 [R, P]``, higher is better.
    """
    r, g, p = scores.shape
    if excluded.dtype == torch.bool:
        s = scores.masked_fill(excluded[:, None, :], float("-inf"))
    else:
        s = scores.index_fill(2, excluded, float("-inf"))  # (an index_put here would sync on CUDA)
    if rule == "max":
        return s.amax(dim=1)
    if rule == "sum":
        return torch.softmax(s * scale, dim=-1).sum(dim=1)
    if rule == "union":
        # Excluded pages score -inf, so they rank after every other page in each head and their
        # first merge position comes after every other page's: padded rows pick what they would alone.
        order = s.argsort(dim=-1, descending=True, stable=True)  # [R, G, P] pages by rank
        merged = order.transpose(1, 2).reshape(r, p * g)  # rank-major: rank 0 of every head, ...
        first = torch.full((r, p), p * g, dtype=torch.int64, device=s.device)
        pos = torch.arange(p * g, device=s.device).expand(r, -1)
        first.scatter_reduce_(1, merged, pos, "amin")  # first position of each page in the merge
        return -first.float()
    raise ValueError(f"unknown gqa_reduce {rule!r}")


def reduce_and_pick(
    scores: torch.Tensor, excluded: torch.Tensor, k: int, rule: GqaReduce, scale: float
) -> torch.Tensor:
    """Reduce per-head page scores over the GQA group and pick ``k`` pages per row.

    Args:
        scores: ``[R, G, P]`` per query head page scores (rows: the KV heads of one request, or
            (request, KV head) pairs of a decode batch).
        excluded: pages never picked: column indices ``int64 [F]`` (every row) or a mask
            ``bool [R, P]`` (forced pages and padding of each row).
        k: pages to pick, at most the pages not excluded of the row with the fewest (rows with
            fewer fill the remaining slots with excluded pages: callers cut each row at its count).
        rule: ``max``, ``sum`` (of per-head softmax-normalised scores) or ``union`` (rank merge).
        scale: softmax scale of ``sum``.
    Returns:
        ``int64 [R, k]`` picked pages, best first, distinct.
    """
    return torch.topk(group_scores(scores, excluded, rule, scale), k, dim=1).indices


class QuestSelector:
    fixed_counts = True  # exactly num_select pages per sparse row

    def __init__(
        self,
        gqa_reduce: GqaReduce = "max",
        scale: float | None = None,
        batch_decode: bool = True,
        query_window: int | None = None,
        prefill: QuokaSelector | None = None,
        decode_int8: bool = False,
    ):
        """``scale``: softmax scale for ``sum`` (default ``1/sqrt(D)``); ``batch_decode``: score the
        step's decode requests together (``False``: one request at a time, the reference);
        ``query_window``: prefill chunks take the max over their last ``query_window`` queries
        only (None: over every query of the chunk); ``prefill``: the selector that picks the pages
        of prefill chunks instead of the bounds (``quest.prefill_scores: exact``; None: bounds);
        ``decode_int8``: decode steps read the INT8 codes of the planes (``quest.decode_planes: int8``)."""
        self.decode_int8 = decode_int8
        self.prefill = prefill
        self.query_window = query_window
        self.gqa_reduce = gqa_reduce
        self.scale = scale
        self.batch_decode = batch_decode

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
        ``[num_blocks, Hkv, D]``; returns rows ``B * Hkv`` with ``counts == num_select``.

        Sparse decode requests (one query token each) are scored together: one bounds launch,
        one reduction and one top-k for all of them; prefill chunks one request at a time (by
        ``self.prefill`` where set)."""
        if meta is None or meta.kmin is None:
            raise ValueError("sparse_quest needs the key min/max planes (PageMeta.kmin/kmax)")
        hkv = layout.num_kv_heads
        state = plan.state.on(block_table, layout)
        sel = empty_selection(plan, hkv, query.device)
        scale = self.scale or query.shape[-1] ** -0.5
        batch = state.decode if self.batch_decode else None
        if batch is not None:
            scores = _decode_bounds(query, meta, batch, self.decode_int8)  # [nd * Hkv, G, P_max]
            top = reduce_and_pick(scores, batch.excluded, batch.max_select, self.gqa_reduce, scale)
            sel.indices[:, : batch.max_select].index_copy_(0, batch.rows, top)  # (no index_put: no sync)
            sel.counts.index_copy_(0, batch.rows, batch.counts)
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0 or (batch is not None and req.query_len == 1):
                continue
            if self.prefill is not None and req.query_len > 1:
                top = self.prefill.chunk_pages(query, r, req, page_keys, block_table, layout, state.forced_past[r])
            else:
                blocks = block_table[r, : req.num_past_pages].long()
                q = chunk_queries(query, req, self.query_window)
                if self.decode_int8 and req.query_len == 1:  # a decode step reads the INT8 codes
                    s_ = meta.mscale[blocks]
                    lo, hi = decode_minmax_int8(meta.kmin8[blocks], s_), decode_minmax_int8(meta.kmax8[blocks], s_)
                    scores = page_upper_bounds(q, lo.transpose(0, 1), hi.transpose(0, 1))  # ([P, Hkv, D] planes)
                else:
                    scores = _bounds(q, meta, blocks)  # [Hkv, G, P]
                top = reduce_and_pick(scores, state.forced_past[r], req.num_select, self.gqa_reduce, scale)
            rows = slice(r * hkv, (r + 1) * hkv)
            sel.indices[rows, : req.num_select] = top
            sel.counts[rows] = req.num_select
        return sel

    def select_decode(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        layout: PageLayout,
        meta: PageMeta | None,
        step: DecodeStep,
        policy: LayerPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``selectors.base.Selector.select_decode``: Quest bounds (the GQA rule over the group),
        then the best ``SELECT`` pages of each row; under the ``max`` rule, where the top-k runs one
        program a row, one launch does both (``select_top_pages_triton(quest=...)``)."""
        from vllm_sparse.kernels.page_topk import select_top_pages_triton, split_chunks
        from vllm_sparse.kernels.paged_attention import num_sms
        from vllm_sparse.kernels.quest_rows import QuestRows
        from vllm_sparse.kernels.quest_score import quest_decode_bounds_triton

        if meta is None or meta.kmin is None:
            raise ValueError("sparse_quest needs the key min/max planes (PageMeta.kmin/kmax)")
        kmin, kmax, mscale = (meta.kmin8, meta.kmax8, meta.mscale) if self.decode_int8 else (meta.kmin, meta.kmax, None)
        hkv, b = layout.num_kv_heads, step.num_reqs
        cols = step.columns[policy]
        q = query[:b]
        cap, counters = step.select_caps[policy], step.topk_counters
        rows = b * hkv
        if self.gqa_reduce == "max" and split_chunks(step.page_cap, rows, num_sms(q.device)) == 1:
            # many rows, one program each: bounds and top-k in one launch, each program scoring the pages it
            # ranks (few long rows split over programs score faster in a launch of their own)
            scores = torch.empty(rows, step.page_cap, dtype=torch.float32, device=q.device)
            quest = QuestRows(q, kmin, kmax, step.block_table, mscale)
            return select_top_pages_triton(scores, cols, hkv, cap, counters=counters, quest=quest)
        if self.gqa_reduce == "max":
            scores = quest_decode_bounds_triton(q, kmin, kmax, step.block_table, cols, step.page_cap, scale=mscale)
            return select_top_pages_triton(scores, cols, hkv, cap, counters=counters)
        bounds = quest_decode_bounds_triton(
            q, kmin, kmax, step.block_table, cols, step.page_cap, reduce_max=False, scale=mscale
        )
        p = torch.arange(step.page_cap, device=q.device)[None, :]
        lo = cols[:, HEAD].repeat_interleave(hkv)[:, None]
        hi = cols[:, TAIL].repeat_interleave(hkv)[:, None]
        scale = self.scale or q.shape[-1] ** -0.5
        scores = group_scores(bounds, (p < lo) | (p >= hi), self.gqa_reduce, scale)
        return select_top_pages_triton(scores, cols, hkv, cap, counters=counters)
