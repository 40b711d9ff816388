"""CompactAttention-FP: FlashPrefill's block scores, thresholded per query tile and head, lowered
to one page set per (request, KV head) by a union over the chunk's tiles and the group's heads.

A block is ``bp`` whole pages (``compact.block_pages``; default about 128 tokens), ``B = bp * N``
tokens: block ``j`` holds positions ``[j * B, (j + 1) * B)``. Per sparse prefill request, whose
scored queries (the whole chunk unless ``chunk_query_window`` is set) sit at positions
``start .. seq - 1`` and whose past is ``ctx`` tokens:

1. mean-pool the keys of every complete block before the sequence's end: ``mean_k [Hkv, nb, D]``,
   ``nb = seq // B`` (float32, from the cache in place);
2. cut the scored queries into tiles of ``compact.tile`` rows from the first one; per tile and
   query head, ``s[i, j] = q_i . mean_k[j] * scale`` for every row ``i`` that sees the whole of
   block ``j`` (its last token at or before the row's position: FlashPrefill's causal rule, so a
   block in the chunk counts only for the rows after it);
3. per block ``m_j = max_i s[i, j]`` and ``S_j = sum_i exp(s[i, j] - m_j)``; ``w_j = S_j *
   exp(m_j - max_j m_j)``; FlashPrefill's score is ``w_j / sum_j w_j``. A past block (``j < ctx //
   B``) is kept where ``score_j >= alpha * max_j score_j`` (``alpha = compact.block_threshold``),
   decided as ``w_j >= alpha * max_j w_j``: the normaliser cancels. The chunk's own complete blocks
   enter the maximum and the normaliser as in FlashPrefill (they are attended anyway);
4. union over the tiles (per query head), then over the ``G`` query heads of each KV head;
5. a row's pages: every page of a kept block, plus the past pages of the block that holds the
   chunk's first token (FlashPrefill's diagonal block, which its window keeps), less the forced
   pages (sink, local window), which the tables add with the chunk's own pages.

Rows therefore carry a variable number of pages (``Selection.counts``, on the device; the policy
caps them at every non-forced past page: ``LayerPolicy.select_all``); no budget enters. Sizes
come from the host plan, so nothing here waits for the device. The selection carries the kept and
scored past blocks of each stage (per tile and head, per head, per KV head: ``Selection.unions``),
which the attention impl adds to the layer's stats counters (``stats.record_unions``).

The tile statistics (``m_j``, ``S_j``) come from ``kernels.block_scores``: one Triton launch per request
on CUDA where the shapes fit, else its torch twin.

Decode steps run dense (the paper's method is prefill-only; ``sparse_decode: true`` is refused
at engine start).
"""

from __future__ import annotations

import torch

from vllm_sparse.config import CompactOptions, LayerPolicy
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.kernels.block_scores import tile_block_stats, tile_block_stats_triton, triton_fits
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.policy import RequestPlan, StepPlan
from vllm_sparse.selectors.base import Selection, chunk_queries, empty_selection, past_page_ids

#: key elements gathered at a time for the block means
MEAN_ELEMENTS = 1 << 25


def block_means(page_keys: torch.Tensor, page_ids: torch.Tensor, block_pages: int) -> torch.Tensor:
    """``float32 [Hkv, nb, D]`` mean key of each block of ``block_pages`` complete pages.

    Args:
        page_keys: ``[num_pages, N, D]`` keys by physical page id.
        page_ids: ``int64 [Hkv, nb * block_pages]`` physical ids of the blocks' pages, in order.
    """
    hkv, pages = page_ids.shape
    n, d = page_keys.shape[1:]
    nb = pages // block_pages
    out = torch.empty(hkv, nb, d, dtype=torch.float32, device=page_keys.device)
    step = max(1, MEAN_ELEMENTS // (hkv * block_pages * n * d))  # blocks gathered at a time
    for a in range(0, nb, step):
        b = min(a + step, nb)
        keys = page_keys[page_ids[:, a * block_pages : b * block_pages]]  # [Hkv, pages, N, D], cache dtype
        out[:, a:b] = keys.reshape(hkv, b - a, -1, d).mean(dim=2, dtype=torch.float32)
    return out


def tile_block_keep(
    q: torch.Tensor, mean_k: torch.Tensor, first_pos: int, block_tokens: int, num_past_blocks: int,
    scale: float, alpha: float, tile: int,
) -> torch.Tensor:  # fmt: skip
    """FlashPrefill's decision per (query tile, query head) over the past blocks.

    Args:
        q: ``[C, Hq, D]`` scored queries at positions ``first_pos .. first_pos + C - 1``.
        mean_k: ``float32 [Hkv, nb, D]`` block mean keys (``block_means``), ``nb >= num_past_blocks``.
        block_tokens: ``B``; blocks ``j < num_past_blocks`` are the candidates (seen by every row).
        alpha: keep blocks whose score reaches ``alpha`` times the tile's best (0: every block).
        tile: rows per tile.
    Returns:
        ``bool [Hkv, G, T, num_past_blocks]`` with ``T = ceil(C / tile)``: from the tile statistics
        (``kernels.block_scores``: Triton on CUDA where the shapes fit, else the torch twin),
        ``w_j = S_j exp(m_j - max_j m_j)`` kept where ``w_j >= alpha * max_j w_j``.
    """
    if num_past_blocks == 0:
        hkv, hq = mean_k.shape[0], q.shape[1]
        return torch.empty(hkv, hq // hkv, -(-q.shape[0] // tile), 0, dtype=torch.bool, device=q.device)
    stats_of = tile_block_stats_triton if triton_fits(q, tile) else tile_block_stats
    m, s = stats_of(q, mean_k, first_pos, block_tokens, scale, tile)  # [Hkv, G, T, nb]
    w = s * torch.exp(m - m.amax(dim=3, keepdim=True))  # 0 where no row of the tile sees the block
    return w[..., :num_past_blocks] >= alpha * w.amax(dim=3, keepdim=True)


def union_counts(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two unions of a request's tile decisions and their stats.

    Args:
        keep: ``bool [Hkv, G, T, nbp]`` per KV head, query head, tile and past block.
    Returns:
        ``(groups bool [Hkv, nbp], counts int64 [6])``: the blocks each KV head keeps, and (kept,
        scored) blocks per tile and head, per head (after the tile union), per KV head (after the
        group union).
    """
    heads = keep.any(dim=2)  # [Hkv, G, nbp]
    groups = heads.any(dim=1)  # [Hkv, nbp]
    out = []
    for x in (keep, heads, groups):  # (sizes as fills, not host copies: nothing waits for the device)
        out += [x.sum(), torch.full((), x.numel(), dtype=torch.int64, device=x.device)]
    return groups, torch.stack(out)


def past_page_keep(
    q: torch.Tensor, mean_k: torch.Tensor, req: RequestPlan, forced_past: torch.Tensor, options: CompactOptions,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The past pages a request keeps per KV head, from its block mean keys.

    Args:
        q: ``[C', Hq, D]`` the scored queries, the step's last positions.
        mean_k: ``float32 [Hkv, nb, D]`` the mean key of every complete block up to ``req.seq_len``.
        forced_past: ``int64 [F']`` the request's forced past pages (left out of the result).
    Returns:
        ``(keep bool [Hkv, num_past], counts int64 [6])``: every page of each kept complete past block
        and every page after the last one (the block the chunk starts in), less ``forced_past``;
        ``union_counts``'s stage counts.
    """
    bp = options.pages_per_block(req.page_size)
    bt = bp * req.page_size
    nbp = req.context_len // bt  # complete past blocks: the candidates
    tiles = tile_block_keep(q, mean_k, req.seq_len - q.shape[0], bt, nbp, scale, options.block_threshold, options.tile)
    groups, counts = union_counts(tiles)
    keep = torch.ones(mean_k.shape[0], req.num_past_pages, dtype=torch.bool, device=q.device)  # diagonal block's pages
    keep[:, : nbp * bp] = groups.repeat_interleave(bp, dim=1)
    keep.index_fill_(1, forced_past, False)  # (not ``keep[:, i] = False``: its scalar is a host copy, a sync)
    return keep, counts


def request_pages(
    query: torch.Tensor, page_keys: torch.Tensor, block_table: torch.Tensor, layout: PageLayout, r: int,
    req: RequestPlan, forced_past: torch.Tensor, options: CompactOptions, scale: float, window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The past pages request ``r`` of a plan keeps per KV head (``past_page_keep`` over the block
    means gathered from the cache in place).

    Args:
        query: ``[T, Hq, D]`` the step's queries; block_table ``int [B, max_blocks]``.
        forced_past: ``int64 [F']`` the request's forced past pages (left out of the result).
    Returns:
        ``(keep bool [Hkv, num_past], counts int64 [6])`` (``union_counts``).
    """
    bp = options.pages_per_block(layout.page_size)
    nb = req.seq_len // (bp * layout.page_size)  # complete blocks
    ids = past_page_ids(block_table, r, nb * bp, layout)  # [Hkv, nb * bp]
    q = chunk_queries(query, req, window)
    return past_page_keep(q, block_means(page_keys, ids, bp), req, forced_past, options, scale)


class CompactSelector:
    fixed_counts = False  # the threshold keeps a different number of pages per row

    def __init__(self, options: CompactOptions, scale: float | None = None, query_window: int | None = None):
        self.options = options
        self.scale = scale
        self.query_window = query_window

    def __call__(self, query: torch.Tensor, page_keys: torch.Tensor, block_table: torch.Tensor, layout: PageLayout,
                 plan: StepPlan, meta: PageMeta | None = None) -> Selection:  # fmt: skip
        """See ``selectors.base.Selector``: rows ``B * Hkv``, each its kept past pages ascending,
        ``counts <= num_select``; dense requests (decode rows, as the policy plans them) select nothing."""
        hkv = layout.num_kv_heads
        state = plan.state.on(block_table, layout)
        sel = empty_selection(plan, hkv, query.device)
        scale = self.scale or query.shape[-1] ** -0.5
        total = None
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0:
                continue
            keep, counts = request_pages(
                query, page_keys, block_table, layout, r, req, state.forced_past[r], self.options, scale,
                self.query_window,
            )  # fmt: skip
            order = (~keep).to(torch.int8).argsort(dim=1, stable=True)  # kept pages first, ascending
            rows = slice(r * hkv, (r + 1) * hkv)
            sel.indices[rows, : req.num_select] = order[:, : req.num_select]
            sel.counts[rows] = keep.sum(dim=1).to(torch.int32)
            total = counts if total is None else total + counts
        return Selection(sel.indices, sel.counts, total)

    def select_decode(self, query: torch.Tensor, page_keys: torch.Tensor, layout: PageLayout,
                      meta: PageMeta | None, step: DecodeStep, policy: LayerPolicy):  # fmt: skip
        """Never called: compact decodes dense (``sparse_decode: true`` is refused at start)."""
        raise NotImplementedError("sparse_compact decodes dense; it has no decode selection")
