"""The sparse decode requests of a host-planned step as one batch of rows, shared by every selector.

A step's sparse decode requests (one query token each, ``nd`` of them) are scored together: rows
are (decode request, KV head) pairs, request-major, their past pages padded to the longest
request and the padding and forced pages masked out. ``DecodeBatch`` holds those rows; it is made
once per step (``StepState.decode``) and read by every layer of the policy and by every selector
(Quest's bounds, QuoKA's cosine scores, Twilight's mass estimate over its base's candidates).
The common columns are made with the batch; what only one selector reads is made the first time
that selector asks for it (``cached_property``), from host-known sizes: no device-to-host sync.

This is the host-planned decode path (CPUs, engines without the device decode path); GPU decode
steps go through ``decode_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import StepPlan


@dataclass(frozen=True)
class DecodeBatch:
    """The step's sparse decode requests, as device columns ``int64 [nd]`` and host maxima.

    Attributes:
        req, tokens: request index in the plan and its query token.
        past: past pages; ``[0, head_end) + [tail, past)`` are the forced ones (sink, local window).
        head_end, tail: the forced ranges' bounds.
        num_select: pages each request selects.
        max_select: ``K_max``, the most pages a request selects (host).
        max_past: ``P_max``, the most past pages of a request (host).
        max_forced: ``F_max``, the most forced past pages of a request (host).
        block_table: ``int [B, max_blocks]`` the step's block table (device).
        layout: the cache's page layout (``Hkv = layout.num_kv_heads``).
    """

    req: torch.Tensor
    tokens: torch.Tensor
    past: torch.Tensor
    head_end: torch.Tensor
    tail: torch.Tensor
    num_select: torch.Tensor
    max_select: int
    max_past: int
    max_forced: int
    block_table: torch.Tensor
    layout: PageLayout

    def _per_row(self, x: torch.Tensor) -> torch.Tensor:
        """``[nd, ...]`` per request -> ``[nd * Hkv, ...]`` per row."""
        return x.repeat_interleave(self.layout.num_kv_heads, dim=0)

    @cached_property
    def rows(self) -> torch.Tensor:
        """``int64 [nd * Hkv]`` the selection rows (``request * Hkv + head``) of the batch's rows."""
        hkv = self.layout.num_kv_heads
        heads = torch.arange(hkv, device=self.req.device)
        return (self.req[:, None] * hkv + heads[None, :]).reshape(-1)

    @cached_property
    def counts(self) -> torch.Tensor:
        """``int32 [nd * Hkv]`` pages each row selects."""
        return self._per_row(self.num_select).to(torch.int32)

    @cached_property
    def num_pages(self) -> torch.Tensor:
        """``int32 [nd]`` past pages of each request."""
        return self.past.to(torch.int32)

    @cached_property
    def _past_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.arange(self.max_past, device=self.req.device)[None, :]
        past = self.past[:, None]
        excluded = (p >= past) | (p < self.head_end[:, None]) | (p >= self.tail[:, None])
        return torch.minimum(p, past - 1), excluded

    @cached_property
    def blocks(self) -> torch.Tensor:
        """``int64 [nd, P_max]`` physical block of each past page (padding: the last past page)."""
        page, _ = self._past_columns
        return self.block_table.long()[self.req[:, None], page].contiguous()

    @cached_property
    def excluded(self) -> torch.Tensor:
        """``bool [nd * Hkv, P_max]`` the columns never picked: forced pages and padding."""
        return self._per_row(self._past_columns[1])

    @cached_property
    def page_ids(self) -> torch.Tensor:
        """``int64 [nd * Hkv, P_max]`` physical page ids of each row's past pages (QuoKA)."""
        heads = torch.arange(self.layout.num_kv_heads, device=self.blocks.device)
        return self.layout.page_ids(self.blocks[:, None, :], heads[None, :, None]).reshape(-1, self.max_past)

    @cached_property
    def table(self) -> torch.Tensor:
        """``int64 [nd * W]`` the requests' block-table rows, flattened (Twilight)."""
        return self._table.reshape(-1)

    @cached_property
    def _table(self) -> torch.Tensor:
        return self.block_table.long()[self.req]  # [nd, W]

    @cached_property
    def row_table(self) -> torch.Tensor:
        """``int64 [nd * Hkv]`` offset of each row's request in ``table`` (Twilight)."""
        slot = torch.arange(self.req.numel(), device=self.req.device)
        return self._per_row(slot * self._table.shape[1])

    @cached_property
    def forced_blocks(self) -> torch.Tensor:
        """``int64 [nd * Hkv, F_max]`` blocks of each row's forced past pages, ``-1`` padding (Twilight)."""
        f = torch.arange(self.max_forced, device=self.req.device)[None, :]
        head_end = self.head_end[:, None]
        page = torch.where(f < head_end, f, self.tail[:, None] + f - head_end)
        valid = page < self.past[:, None]
        forced = self._table.gather(1, torch.where(valid, page, 0)).masked_fill_(~valid, -1)  # [nd, F_max]
        return self._per_row(forced)

    @cached_property
    def cand_valid(self) -> torch.Tensor:
        """``bool [nd * Hkv, K_max]`` each row's candidate columns (below its ``num_select``; Twilight)."""
        k = torch.arange(self.max_select, device=self.req.device)[None, :]
        return self._per_row(k < self.num_select[:, None])


def make_decode_batch(plan: StepPlan, block_table: torch.Tensor, layout: PageLayout) -> DecodeBatch | None:
    """The sparse decode requests of ``plan`` (``None`` if there are none): one host-to-device copy.

    Args:
        block_table: ``int [B, max_blocks]`` the step's block table (device).
    """
    reqs = [(r, q) for r, q in enumerate(plan.requests) if q.sparse and q.num_select and q.query_len == 1]
    if not reqs:
        return None
    host = torch.tensor(
        [[r, q.query_start, q.num_past_pages, q.forced_head, q.forced_tail, q.num_select] for r, q in reqs],
        dtype=torch.int64,
    ).to(block_table.device, non_blocking=True)
    return DecodeBatch(
        *(host[:, i] for i in range(6)),
        max_select=max(q.num_select for _, q in reqs),
        max_past=max(q.num_past_pages for _, q in reqs),
        max_forced=max(q.forced_head + max(0, q.num_past_pages - q.forced_tail) for _, q in reqs),
        block_table=block_table,
        layout=layout,
    )
