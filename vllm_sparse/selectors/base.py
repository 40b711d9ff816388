"""Stage 2, select: the contract every selector returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_sparse.config import LayerPolicy
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.policy import StepPlan


@dataclass(frozen=True)
class Selection:
    """Pages picked per (request, KV head) row, rows request-major: ``row = request * Hkv + head``.

    Attributes:
        indices: ``int64 [rows, max_select]`` logical page numbers within the request; entries at
            or past ``counts[row]`` are padding and must be ignored.
        counts: ``int32 [rows]`` valid entries per row (0 for dense requests).
        unions: block-union selectors (compact): ``int64 [6]`` (kept, scored) past blocks per
            ``stats.UNION_STAGES`` stage, for the stats counters (on the device); else None.
    """

    indices: torch.Tensor
    counts: torch.Tensor
    unions: torch.Tensor | None = None


class Selector(Protocol):
    # True: every sparse row returns exactly ``num_select`` pages, so executors can plan the row
    # lengths on the host (FlashInfer); False: counts vary per row and are known only on the device.
    fixed_counts: bool

    def __call__(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        block_table: torch.Tensor,
        layout: PageLayout,
        plan: StepPlan,
        meta: PageMeta | None = None,
    ) -> Selection:
        """Score the past pages of every sparse request and keep at most ``plan`` 's number of them.

        Args:
            query: ``[T, Hq, D]`` this step's queries (post-RoPE).
            page_keys: ``[num_pages, N, D]`` keys by physical page id (``PageLayout.page_keys``).
            block_table: ``int [B, max_blocks]`` physical block of each logical page.
            layout: the cache's page layout.
            plan: the step plan of this layer (which requests are sparse, how many pages).
            meta: views of the page metadata planes, for methods that keep them (else ``None``).
        Returns:
            rows with ``counts <= num_select`` of the request (fixed-budget methods return exactly
            ``num_select``; top-p methods fewer).
        """
        ...

    def select_decode(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        layout: PageLayout,
        meta: PageMeta | None,
        step: DecodeStep,
        policy: LayerPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection of a step's decode block, every length read on the device: fixed launches
        for a batch size (CUDA-graph safe), no host sync.

        Args:
            query: ``[>= B, Hq, D]``, the decode block's tokens first (one per request).
            page_keys: ``[num_pages, N, D]`` keys by physical page id.
            step: the step's decode block; its ``columns[policy]`` (``policy.decode_columns``) say
                how many pages each request selects among ``[HEAD, TAIL)``.
        Returns:
            ``(pages int32 [B * Hkv, K_cap], counts int32 [B * Hkv])``: logical pages of each row,
            valid below ``counts`` (``SELECT``, or fewer for top-p methods).
        """
        ...


def empty_selection(plan: StepPlan, num_kv_heads: int, device: torch.device) -> Selection:
    """A selection of nothing, to fill: ``indices int64 [B * Hkv, max_select]``, ``counts int32
    [B * Hkv]``, zeros (``StepState.no_selection`` keeps one per step for layers that select nothing)."""
    rows = len(plan.requests) * num_kv_heads
    return Selection(
        torch.zeros(rows, plan.max_select, dtype=torch.int64, device=device),
        torch.zeros(rows, dtype=torch.int32, device=device),
    )


def past_page_ids(block_table: torch.Tensor, request: int, num_past: int, layout: PageLayout) -> torch.Tensor:
    """Physical ids of one request's past pages, ``int64 [Hkv, num_past]``."""
    blocks = block_table[request, :num_past].long()
    heads = torch.arange(layout.num_kv_heads, device=blocks.device)
    return layout.page_ids(blocks[None, :], heads[:, None])


def chunk_queries(query: torch.Tensor, req, window: int | None) -> torch.Tensor:
    """The queries a request's chunk scores pages with: ``query[start : start + len]`` ``[L, Hq, D]``,
    or only its last ``window`` of them (an observation window, as SnapKV's: the chunk's last
    tokens, such as the question after a long document, are what the next tokens build on)."""
    end = req.query_start + req.query_len
    start = req.query_start if window is None else max(req.query_start, end - window)
    return query[start:end]


def forced_past(req, device: torch.device) -> torch.Tensor:
    """Forced pages among a request's past pages (sink, local window): ``int64 [F']`` on ``device``,
    copied at each call (a step's selectors read ``StepState.forced_past``, copied once per step)."""
    return req.forced_past.to(device)
