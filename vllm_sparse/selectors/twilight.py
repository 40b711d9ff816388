"""Twilight: candidates from a base selector, pruned to a top-p attention-mass page set.

Per sparse request and KV head:

1. the base selector (Quest by default) proposes ``plan.num_select`` candidate past pages (the
   policy sets that to ``twilight.candidate_fraction`` of the context, clamped by the budget's
   ``max_tokens``); a prefill chunk, unless ``prune_prefill``, attends them all, and the policy
   then asks it for the budget's pages instead; a decode step goes on:
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
kept whole) and the forced sink/local pages count towards ``top_p``. The paper is decode-only, and
so is the pruning by default; with ``prune_prefill`` a chunk is pruned by the mean distribution
over its (last ``query_window``) queries, and its own tokens do not enter the estimate.

The sparse decode requests of a step (one query each) go together: their candidate rows
(requests x KV heads, padded to the largest count) are estimated in one batch, pruned by one
sort + cumulative sum, and written with per-row counts that stay on the device; prefill chunks
go one request at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_sparse.config import LayerPolicy
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.metadata.int4_shadow import dequantize_int4
from vllm_sparse.policy import HEAD, PAST, TAIL, StepPlan
from vllm_sparse.selectors.base import Selection, Selector, chunk_queries, empty_selection
from vllm_sparse.selectors.decode_batch import DecodeBatch

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


def estimate_page_mass_rows(
    q: torch.Tensor, meta: PageMeta, blocks: torch.Tensor, page_size: int, scale: float
) -> torch.Tensor:
    """Estimated attention mass per page of one decode query per slot, every KV head a row.

    Args:
        q: ``[S, Hq, D]`` one query per slot (request).
        meta: the shadow planes (``codes/scale/zero``).
        blocks: ``int64 [S * Hkv, P]`` physical block of each page of row ``slot * Hkv + kv_head``;
            ``-1`` marks padding (zero mass, outside the softmax).
        page_size: ``N``.
        scale: softmax scale.
    Returns:
        ``[S * Hkv, G, P]`` float32: row by row what ``estimate_page_mass`` gives for the row's
        query heads and valid pages.
    """
    s, hq, d = q.shape
    rows, p = blocks.shape
    hkv = rows // s
    g = hq // hkv
    qr = q.float().view(rows, g, d)  # row slot * Hkv + kv: query heads kv * G ... kv * G + G - 1
    heads = torch.arange(rows, device=blocks.device)[:, None] % hkv
    out = torch.empty(rows, g, p, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 22) // max(1, p * page_size * d))  # rows at a time: bounds the dequantized keys
    for a in range(0, rows, step):
        b = min(a + step, rows)
        blk, hd = blocks[a:b].clamp(min=0), heads[a:b]
        keys = dequantize_int4(meta.codes[blk, hd], meta.scale[blk, hd], meta.zero[blk, hd])  # [r, P, N, D]
        logits = torch.bmm(qr[a:b], keys.flatten(1, 2).transpose(1, 2)) * scale  # [r, G, P * N]
        pad = (blocks[a:b] < 0).repeat_interleave(page_size, dim=1)  # [r, P * N]
        w = torch.softmax(logits.masked_fill(pad[:, None, :], float("-inf")), dim=-1)
        out[a:b] = w.view(b - a, g, p, page_size).sum(dim=-1)
    return out


def _triton_ok(q: torch.Tensor) -> bool:
    """Whether the Triton kernels estimate (CUDA tensors)."""
    return q.is_cuda


def _page_mass(q: torch.Tensor, meta: PageMeta, blocks: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """``[Hkv, G, P]`` estimated mass of the pages in ``blocks`` (``int64 [Hkv, P]``): the Triton
    kernel on CUDA (shadows read in place, never dequantized to memory), the torch twin elsewhere."""
    if _triton_ok(q):
        from vllm_sparse.kernels.twilight_estimate import estimate_page_mass_triton

        return estimate_page_mass_triton(q, meta.codes, meta.scale, meta.zero, blocks, scale)
    heads = torch.arange(blocks.shape[0], device=blocks.device)[:, None]
    keys = dequantize_int4(meta.codes[blocks, heads], meta.scale[blocks, heads], meta.zero[blocks, heads])
    return estimate_page_mass(q, keys.flatten(1, 2), page_size, scale)


def _rows_page_mass(q: torch.Tensor, meta: PageMeta, blocks: torch.Tensor, page_size: int, scale: float):
    """``[S * Hkv, G, P]`` estimated mass of decode rows (``blocks [S * Hkv, P]``, ``-1`` padding):
    one Triton launch per pass on CUDA, the torch twin elsewhere."""
    if _triton_ok(q):
        from vllm_sparse.kernels.twilight_estimate import estimate_page_mass_rows_triton

        return estimate_page_mass_rows_triton(q, meta.codes, meta.scale, meta.zero, blocks, scale)
    return estimate_page_mass_rows(q, meta, blocks, page_size, scale)


def top_p_keep(cand_mass: torch.Tensor, forced_mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest per-head page sets reaching ``top_p``, united over the GQA group.

    Args:
        cand_mass: ``[Hkv, G, K]`` mass of each candidate page per query head.
        forced_mass: ``[Hkv, G]`` mass already attended through forced pages.
        top_p: target mass (``>= 1``: every candidate is kept).
    Returns:
        ``bool [Hkv, K]``: candidate kept by at least one head of the group.
    """
    if top_p >= 1.0:  # every candidate (exactly: no rounding of the cumulative mass decides)
        return torch.ones(cand_mass.shape[0], cand_mass.shape[2], dtype=torch.bool, device=cand_mass.device)
    mass, order = cand_mass.sort(dim=-1, descending=True)
    before = mass.cumsum(dim=-1) - mass  # mass of the heavier pages, [Hkv, G, K]
    need = top_p - forced_mass  # [Hkv, G]
    keep_sorted = before < need[..., None]  # page needed while the target is not reached yet
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep.any(dim=1)


class TwilightSelector:
    fixed_counts = False  # top-p: fewer pages per row, counted on the device

    def __init__(
        self,
        base: Selector,
        top_p: float = 0.95,
        scale: float | None = None,
        batch_decode: bool = True,
        query_window: int | None = None,
        prune_prefill: bool = False,
    ):
        """``base``: candidate selector; ``scale``: softmax scale (default ``1/sqrt(D)``);
        ``batch_decode``: estimate the step's decode requests together (``False``: one request at
        a time, the reference); ``prune_prefill``: prune prefill chunks' candidates too (False: a
        chunk attends every candidate); ``query_window``: pruned chunks estimate the mass from their
        last ``query_window`` queries only (None: every query)."""
        self.query_window = query_window
        self.prune_prefill = prune_prefill
        self.base = base
        self.top_p = top_p
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
        """See ``selectors.base.Selector``; query ``[T, Hq, D]``, reads ``meta.codes``
        ``[num_blocks, Hkv, N, D/2]`` and ``meta.scale/zero [num_blocks, Hkv, N]``; returns rows
        ``B * Hkv`` with ``counts <= num_select``, kept pages first.

        Sparse decode requests (one query token each) are estimated and pruned together, their
        variable counts staying on the device; prefill chunks keep their candidates, or under
        ``prune_prefill`` are pruned one request at a time."""
        if meta is None or meta.codes is None:
            raise ValueError("sparse_twilight needs the INT4 key shadow planes (PageMeta.codes)")
        cand = self.base(query, page_keys, block_table, layout, plan, meta)
        hkv, n = layout.num_kv_heads, layout.page_size
        state = plan.state.on(block_table, layout)
        sel = empty_selection(plan, hkv, query.device)
        scale = self.scale or query.shape[-1] ** -0.5
        batch = state.decode if self.batch_decode else None
        if batch is not None:
            self._decode(query, meta, batch, cand, sel, n, scale)
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0 or (batch is not None and req.query_len == 1):
                continue
            rows = slice(r * hkv, (r + 1) * hkv)
            k = req.num_select
            picked = cand.indices[rows, :k]  # [Hkv, K] logical candidate pages
            if req.query_len > 1 and not self.prune_prefill:  # a chunk attends every candidate
                sel.indices[rows, :k] = picked
                sel.counts[rows] = cand.counts[rows]
                continue
            forced = state.forced_past[r]
            pages = torch.cat([forced[None, :].expand(hkv, -1), picked], dim=1)  # [Hkv, F + K]
            blocks = block_table[r].long()[pages]  # [Hkv, F + K]
            q = chunk_queries(query, req, self.query_window)
            mass = _page_mass(q, meta, blocks, n, scale)  # [Hkv, G, F + K]
            f = forced.numel()
            keep = top_p_keep(mass[..., f:], mass[..., :f].sum(dim=-1), self.top_p)  # [Hkv, K]
            order = (~keep).to(torch.int8).argsort(dim=1, stable=True)  # kept pages first
            sel.indices[rows, :k] = picked.gather(1, order)
            sel.counts[rows] = keep.sum(dim=1).to(torch.int32)
        return sel

    def _decode(self, query, meta, batch: DecodeBatch, cand: Selection, sel: Selection, n: int, scale: float):
        """Every decode row at once: rows' pages are ``[candidates | forced past pages]``, each part
        padded (block ``-1``) to the step's largest count; no host sync."""
        k = batch.max_select
        picked = cand.indices.index_select(0, batch.rows)[:, :k]  # [R, K_max] logical candidates
        valid = batch.cand_valid
        flat = batch.row_table[:, None] + picked.masked_fill(~valid, 0)  # into the decode requests' table rows
        cand_blocks = batch.table.take(flat).masked_fill_(~valid, -1)
        blocks = torch.cat([cand_blocks, batch.forced_blocks], dim=1)  # [R, K_max + F_max]
        mass = _rows_page_mass(query.index_select(0, batch.tokens), meta, blocks, n, scale)  # [R, G, K_max + F_max]
        keep = top_p_keep(mass[..., :k], mass[..., k:].sum(dim=-1), self.top_p) & valid  # [R, K_max]
        order = (~keep).to(torch.int8).argsort(dim=1, stable=True)  # kept, other candidates, padding
        sel.indices[:, :k].index_copy_(0, batch.rows, picked.gather(1, order))  # (no index_put: no sync)
        sel.counts.index_copy_(0, batch.rows, keep.sum(dim=1).to(torch.int32))

    def select_decode(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        layout: PageLayout,
        meta: PageMeta | None,
        step: DecodeStep,
        policy: LayerPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``selectors.base.Selector.select_decode``: the base selector's candidates, pruned by
        the INT4 mass estimate to a top-p set per row (kept candidates first). Shapes are fixed by
        the step (``B``, ``K_cap`` candidates and ``F_cap`` forced past pages per row), so the same
        launches serve every replay: the estimate builds each row's page list in the kernel (its
        ``cnt`` candidates, then its forced past pages; twin ``decode_row_pages``) and reads each
        page's shadow once for the whole group; the top-p kernel normalises the page log-masses."""
        from vllm_sparse.kernels.top_p import top_p_select_triton
        from vllm_sparse.kernels.twilight_estimate import decode_page_lse_triton

        if meta is None or meta.codes is None:
            raise ValueError("sparse_twilight needs the INT4 key shadow planes (PageMeta.codes)")
        cand, cand_counts = self.base.select_decode(query, page_keys, layout, meta, step, policy)
        b = step.num_reqs
        scale = self.scale or query.shape[-1] ** -0.5
        lse, num_valid = decode_page_lse_triton(
            query[:b], meta.codes, meta.scale, meta.zero, step.block_table, step.columns[policy], cand, cand_counts,
            scale, forced_cap(policy, layout.page_size),
        )  # fmt: skip
        return top_p_select_triton(lse, cand_counts, cand, self.top_p, num_valid, log_mass=True)


def forced_cap(policy: LayerPolicy, page_size: int) -> int:
    """The most forced past pages (sink, local window) a decode row of ``policy`` can have."""
    n = page_size
    return -(-policy.sink_tokens // n) + -(-policy.local_tokens // n) + 1


def decode_row_pages(
    cand: torch.Tensor,
    cand_counts: torch.Tensor,
    columns: torch.Tensor,
    block_table: torch.Tensor,
    num_kv_heads: int,
    forced_cap: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages each decode row estimates (twin of the page lists ``decode_page_lse_triton`` builds).

    Args:
        cand: ``int [B * Hkv, K]`` candidate pages, valid below ``cand_counts``.
        cand_counts: ``int [B * Hkv]``.
        columns: ``int32 [B, NUM_COLUMNS]`` decode columns.
        block_table: ``int [B, max_blocks]``.
        num_kv_heads: ``Hkv``.
        forced_cap: ``F`` (``forced_cap``).
    Returns:
        ``(blocks int64 [B * Hkv, K + F], num_valid int32 [B * Hkv])``: per row the blocks of its
        ``cnt`` candidates, then of its forced past pages ``[0, HEAD) + [TAIL, PAST)`` (none when
        ``cnt = 0``), then ``-1`` padding from ``num_valid`` on.
    """
    rows, k = cand.shape
    dev = cand.device
    req = torch.arange(rows, device=dev) // num_kv_heads
    head, tail, past = (columns[req, c].long()[:, None] for c in (HEAD, TAIL, PAST))
    cnt = cand_counts.long()[:, None]
    # the forced past pages [0, HEAD) + [TAIL, PAST) are a prefix of f = 0, 1, ...: f < fcnt
    fcnt = torch.where(cnt > 0, head + (past - tail).clamp(min=0), 0)
    col = torch.arange(k + forced_cap, device=dev)[None, :]
    f = col - cnt
    page = torch.where(col < cnt, F.pad(cand.long(), (0, forced_cap)), torch.where(f < head, f, tail + f - head))
    valid = col < cnt + fcnt
    blocks = block_table.long()[req[:, None], torch.where(valid, page, 0)].masked_fill_(~valid, -1)
    return blocks, (cnt + fcnt)[:, 0].to(torch.int32)
