"""The pages each selector attends for one (layer, step) of one request, from captured queries and keys.

This is the engine's selection for a single request, built from the same functions: the policy's
``plan_request`` (budget, sink, local window, which pages are forced, how many are selected), the
queries each selector scores with (``selectors.base.chunk_queries``: the chunk, or its last
``chunk_query_window`` queries), and each selector's torch scoring:

* ``quest``: ``quest.page_upper_bounds`` on the pages' key min/max, ``quest.reduce_and_pick`` with
  the config's ``gqa_reduce`` (the ``QuestSelector`` decode path, and its prefill path under
  ``quest.prefill_scores: bounds``; under ``exact`` a chunk picks as ``quoka`` does);
* ``quoka``: ``quoka.subselect_queries`` + ``group_query`` + ``score_pages``, top-k past the forced
  pages (``QuokaSelector``'s torch path);
* ``twilight``: the base selector's candidates (``twilight.candidates``, its count from
  ``candidate_fraction``), the INT4 shadow estimate ``twilight.estimate_page_mass`` over forced +
  candidate pages, ``twilight.top_p_keep`` (``TwilightSelector``'s decode rule; a prefill chunk
  keeps every candidate unless ``twilight.prune_prefill``);
* ``compact``: the block means of the complete past blocks, ``compact.tile_block_keep`` and
  ``compact.union_counts`` (``compact.past_page_keep``, ``CompactSelector``'s path): every past page of a kept block, the pages of
  the incomplete last blocks always (``select_all``: no budget, alpha decides how many);
* ``kascade``: the anchor mass of the layer's anchor layer (``anchor_mass``: ``selectors.kascade.score_request``'s
  torch path, ``kernels.anchor_mass.anchor_page_mass`` with the config's tile over the queries of
  ``kascade.anchor_queries``), computed from the ANCHOR layer's queries and keys (the caller passes it
  to ``select`` for a reuse layer), then per KV head ``h`` the top ``num_select`` non-forced pages of
  the anchor's KV head ``head_map[h]`` (``KascadeSelector``'s torch path).

The cache holds the keys of one request contiguously (logical page ``p`` = positions
``[p * N, (p + 1) * N)``), so no block table is needed. A decode step is a chunk of one query.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm_sparse.config import SparseConfig
from vllm_sparse.kernels.anchor_mass import anchor_page_mass
from vllm_sparse.metadata.int4_shadow import dequantize_int4, quantize_int4
from vllm_sparse.policy import RequestPlan, plan_request
from vllm_sparse.selectors.base import chunk_queries
from vllm_sparse.selectors.compact import past_page_keep
from vllm_sparse.selectors.kascade import anchor_queries
from vllm_sparse.selectors.quest import page_upper_bounds, reduce_and_pick
from vllm_sparse.selectors.quoka import group_query, score_pages, subselect_queries
from vllm_sparse.selectors.twilight import estimate_page_mass, top_p_keep


@dataclass(frozen=True)
class PageChoice:
    """What one request attends in one layer and step.

    Attributes:
        plan: the policy's plan (``plan.sparse`` False: every page is attended).
        forced_past: ``int64 [F]`` forced pages among the past pages (sink, local window).
        selected: per KV head ``int64 [k_h]`` selected past pages (fixed-budget methods: ``k_h``
            is ``plan.num_select``; Twilight: its top-p count).
    """

    plan: RequestPlan
    forced_past: torch.Tensor
    selected: list[torch.Tensor]


def request_plan(config: SparseConfig, layer: int, query_len: int, seq_len: int, page_size: int) -> RequestPlan:
    """``plan_request`` of ``layer``'s policy for one request with ``seq_len`` tokens, the last
    ``query_len`` of them this step's; every layer is planned as a sparse one (dense layers and
    QuoKA's dense decode are measured too; the caller knows which ones the engine runs dense)."""
    policy = dataclasses.replace(config.for_layer(layer), dense=False, sparse_decode=True, sparse_prefill=True)
    return plan_request(policy, page_size, 0, query_len, seq_len)


def page_views(keys: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """``[Hkv, P, N, D]`` the first ``num_pages`` complete pages of ``keys [S, Hkv, D]``."""
    s, hkv, d = keys.shape
    return keys[: num_pages * page_size].view(num_pages, page_size, hkv, d).permute(2, 0, 1, 3)


def quest_pick(config: SparseConfig, q: torch.Tensor, paged: torch.Tensor, forced: torch.Tensor, k: int,
               scale: float) -> torch.Tensor:  # fmt: skip
    """Quest's ``int64 [Hkv, k]`` pages for queries ``q [C, Hq, D]`` over keys ``paged [Hkv, P, N, D]``."""
    bounds = page_upper_bounds(q, paged.amin(dim=2), paged.amax(dim=2))  # [Hkv, G, P]
    return reduce_and_pick(bounds, forced, k, config.quest.gqa_reduce, scale)


def quoka_pick(
    config: SparseConfig, q: torch.Tensor, paged: torch.Tensor, forced: torch.Tensor, k: int
) -> torch.Tensor:
    """QuoKA's ``int64 [Hkv, k]`` pages for queries ``q [C, Hq, D]`` over keys ``paged [Hkv, P, N, D]``."""
    qbar = group_query(subselect_queries(q, config.quoka.num_queries).float(), paged.shape[0])  # [Hkv, n, D]
    scores = score_pages(qbar, paged).index_fill(1, forced, float("-inf"))  # [Hkv, P]
    return torch.topk(scores, k, dim=1).indices


def twilight_keep(config: SparseConfig, q: torch.Tensor, paged: torch.Tensor, forced: torch.Tensor,
                  cand: torch.Tensor, scale: float) -> list[torch.Tensor]:  # fmt: skip
    """Twilight's kept pages per KV head: ``cand [Hkv, K]`` candidates pruned to top-p by the INT4
    shadow estimate of ``q [C, Hq, D]`` over ``paged [Hkv, P, N, D]`` (forced pages count to top-p)."""
    hkv, _, n, d = paged.shape
    codes, sc, zero = quantize_int4(paged)
    shadow = dequantize_int4(codes, sc, zero)  # [Hkv, P, N, D]
    pages = torch.cat([forced[None, :].expand(hkv, -1), cand], dim=1)  # [Hkv, F + K]
    keys = shadow[torch.arange(hkv)[:, None], pages].flatten(1, 2)  # [Hkv, (F + K) * N, D]
    mass = estimate_page_mass(q, keys, n, scale)  # [Hkv, G, F + K]
    f = forced.numel()
    keep = top_p_keep(mass[..., f:], mass[..., :f].sum(dim=-1), config.twilight.top_p)  # [Hkv, K]
    return [cand[h][keep[h]] for h in range(hkv)]


def paged_cache(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``keys [S, Hkv, D]`` as a paged cache over ``P = ceil(S / N)`` pages (the last one
    zero-padded): ``(page_keys [Hkv * P, N, D], page_ids int64 [Hkv, P])``, KV head ``h``'s page
    ``p`` at id ``h * P + p``."""
    s, hkv, d = keys.shape
    p = -(-s // page_size)
    padded = torch.cat([keys, keys.new_zeros(p * page_size - s, hkv, d)])
    page_keys = page_views(padded, p, page_size).reshape(hkv * p, page_size, d)
    return page_keys, torch.arange(hkv * p, device=keys.device).view(hkv, p)


def anchor_mass(config: SparseConfig, queries: torch.Tensor, keys: torch.Tensor, page_size: int,
                scale: float) -> torch.Tensor:  # fmt: skip
    """``float32 [Hkv, P]`` Kascade's anchor mass of one step over its ``P = (S - C) // N`` past
    pages, from an anchor layer's ``queries [C, Hq, D]`` and ``keys [S, Hkv, D]``: the torch path of
    ``selectors.kascade.score_request`` (``kascade.tile``; the chunk's queries, or its last
    ``config.query_window()`` of them)."""
    c, s = queries.shape[0], keys.shape[0]
    req = request_plan(config, 0, c, s, page_size)  # (only its query and context lengths are read)
    q, context = anchor_queries(queries, req, config.query_window())
    page_keys, page_ids = paged_cache(keys, page_size)
    mass = anchor_page_mass(q, page_keys, page_ids, context, scale, config.kascade.tile, config.kascade.tile_stride)
    return mass[:, : req.num_past_pages]  # the chunk's own pages are not past pages


def kascade_pick(config: SparseConfig, layer: int, mass: torch.Tensor, forced: torch.Tensor, k: int) -> torch.Tensor:
    """Kascade's ``int64 [Hkv, k]`` pages of ``layer``: per KV head ``h`` the top ``k`` non-forced
    pages of the anchor mass ``mass [Hkv, P]`` of the anchor's KV head ``head_map[h]``."""
    heads = config.kascade.local_head_map(layer, None)
    if heads is not None:  # reuse KV head h reads anchor head heads[h]
        mass = mass.index_select(0, torch.tensor(heads, dtype=torch.int64, device=mass.device))
    return torch.topk(mass.index_fill(1, forced, float("-inf")), k, dim=1).indices


def select(config: SparseConfig, layer: int, queries: torch.Tensor, keys: torch.Tensor, page_size: int,
           scale: float, anchor: torch.Tensor | None = None) -> PageChoice:  # fmt: skip
    """The pages ``config.method`` attends for one step of one request.

    Args:
        queries: ``[C, Hq, D]`` the step's queries, positions ``S - C .. S - 1``.
        keys: ``[S, Hkv, D]`` every key up to and including the step's.
        page_size: ``N``.
        scale: the softmax scale.
        anchor: Kascade: ``float32 [Hkv, P]`` the step's anchor mass of ``layer``'s anchor layer
            (``anchor_mass`` of that layer's queries and keys); None: ``layer`` is an anchor, its
            own ``queries`` and ``keys`` give it. Other methods ignore it.
    """
    c, s = queries.shape[0], keys.shape[0]
    plan = request_plan(config, layer, c, s, page_size)
    forced = plan.forced[plan.forced < plan.num_past_pages]
    if not plan.sparse or plan.num_select == 0:
        return PageChoice(plan, forced, [torch.zeros(0, dtype=torch.int64)] * keys.shape[1])
    paged = page_views(keys, plan.num_past_pages, page_size)  # [Hkv, P, N, D]
    q = chunk_queries(queries, plan, config.query_window())
    k = plan.num_select
    method = config.method
    base = config.twilight.candidates if method == "twilight" else method
    if method == "kascade":
        mass = anchor_mass(config, queries, keys, page_size, scale) if anchor is None else anchor
        return PageChoice(plan, forced, list(kascade_pick(config, layer, mass, forced, k)))
    if method == "compact":
        return PageChoice(plan, forced, compact_keep(config, plan, q, keys, forced, page_size, scale))
    if base == "quest" and c > 1 and config.quest_prefill_scores() == "exact":  # a chunk: QuoKA's scores
        picked = quoka_pick(config, chunk_queries(queries, plan, config.chunk_query_window or None), paged, forced, k)
    elif base == "quest":
        picked = quest_pick(config, q, paged, forced, k, scale)
    elif base == "quoka":
        picked = quoka_pick(config, q, paged, forced, k)
    else:
        raise ValueError(f"no recall measure for method {method!r}")
    if method == "twilight" and (c == 1 or config.twilight.prune_prefill):  # chunks keep every candidate by default
        return PageChoice(plan, forced, twilight_keep(config, q, paged, forced, picked, scale))
    return PageChoice(plan, forced, list(picked))


def compact_keep(config: SparseConfig, plan: RequestPlan, q: torch.Tensor, keys: torch.Tensor,
                 forced: torch.Tensor, page_size: int, scale: float) -> list[torch.Tensor]:  # fmt: skip
    """Compact's kept past pages per KV head (forced pages left out) for scored queries ``q [C', Hq, D]``
    over contiguous ``keys [S, Hkv, D]``: ``selectors.compact.past_page_keep`` over their block means."""
    bt = config.compact.pages_per_block(page_size) * page_size
    s, hkv, d = keys.shape
    nb = plan.seq_len // bt  # complete blocks
    mean_k = keys[: nb * bt].view(nb, bt, hkv, d).mean(dim=1, dtype=torch.float32).permute(1, 0, 2)  # [Hkv, nb, D]
    keep, _ = past_page_keep(q, mean_k, plan, forced, config.compact, scale)
    return [keep[h].nonzero().flatten() for h in range(hkv)]
