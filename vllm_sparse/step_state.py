"""The per-step state of one layer policy: everything the layers of a scheduler step share.

The metadata builder plans a step's host-planned requests once per layer policy
(``SparseAttentionMetadata.plan_for`` -> ``policy.plan_step``), and every ``StepPlan`` it makes
carries one ``StepState`` (``plan.state``). The state holds what is derived from the plan and
would otherwise be rebuilt by every layer of the policy: device copies of the plan's numbers, the
forced part of the page tables, the step's sparse decode requests as one batch, and the
executors' per-step plans. Each part is made once per step, the executors' plans by the builder
(``Executor.prepare``), the rest by the first layer that reads it, then read by every later layer.
Nothing here waits for the device: every size comes from the host plan.

The device parts belong to one block table and one page layout (``on``): in an engine step every
layer passes the same ones; a caller that passes others (a test reusing a plan) has them rebuilt.
"""

from __future__ import annotations

import weakref
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from vllm_sparse.backend.cpu_attn_executor import DenseStep
    from vllm_sparse.backend.flash_rows import RowsStep
    from vllm_sparse.executors.flashinfer import PlannedStep
    from vllm_sparse.executors.triton_paged import PagedStep
    from vllm_sparse.layout import PageLayout
    from vllm_sparse.policy import StepPlan
    from vllm_sparse.selectors.base import Selection
    from vllm_sparse.selectors.decode_batch import DecodeBatch
    from vllm_sparse.tables import PageTables, StepRows


class PlannedPages(NamedTuple):
    """Host page counts of a plan over its ``B * Hkv`` rows (the page counters, ``vllm_sparse.stats``)."""

    sparse_rows: int  # rows of sparse requests
    attended: int  # pages the rows attend at most (``num_pages``)
    dense: int  # pages a dense backend attends (``total_pages``)
    prefill_attended: int  # the same two over rows of prefill chunks (query length > 1)
    prefill_dense: int


class AnchorScores:
    """Kascade's per-step anchor buffer: what an anchor layer measured, read by the reuse layers
    after it in the same step (``selectors.kascade``). It never leaves the device: the reuse layers
    index it with host-known sizes. One buffer serves every layer policy of a step (the builder's
    metadata hands the same one to each plan's state: the dense layer 0 is an anchor of sparse
    layers), and each anchor overwrites the previous one's scores, layers running in order.

    Attributes:
        layer: the anchor layer that wrote ``mass`` this step (-1: none yet).
        mass: per request of the plans, ``float32 [Hkv, P_past]`` the pooled post-softmax mass of
            each past page per KV head (``kernels.anchor_mass``), or ``None`` where the anchor did
            not score the request (it runs dense in every layer).
    """

    def __init__(self) -> None:
        self.layer = -1
        self.mass: list[torch.Tensor | None] = []


class StepState:
    """The shared state of one ``StepPlan`` (one layer policy, one scheduler step).

    Rows are request-major, ``row = request * Hkv + head``, over the plan's ``B`` requests.

    Attributes (the executors' per-step plans: ``None`` until that executor prepares the step; each
    remembers the shapes it was made for, and is made again when asked for others):
        flash_rows: ``backend.flash_rows.RowsStep``: FlashAttention's query offsets of the rows
            (``int32 [B * Hkv + 1]``) and the gather positions of their queries.
        flashinfer: ``executors.flashinfer.PlannedStep``: the planned FlashInfer wrapper and its
            page-index buffer (``int32 [total pages]``), rewritten by each layer.
        triton_paged: ``executors.triton_paged.PagedStep``: the Triton paged executor's work items
            (per (row, query block)) and split-KV geometry.
        cpu_dense: ``backend.cpu_attn_executor.DenseStep``: a dense step's requests as vLLM's CPU
            attention schedules them (query offsets, lengths and its scheduler metadata).
        block_table, layout: what the parts below are made from (set by ``on``).
        anchor: ``AnchorScores``, Kascade's anchor buffer of the step (shared by the states of
            one step's plans; a state of its own otherwise).

    Parts made from the step's block table and page layout on first use, then shared (properties
    below; shapes in their docs): ``forced_past`` (per request, its forced past pages), ``rows``
    (the forced part of the page tables), ``dense_tables`` (the tables of a step without a sparse
    request), ``no_selection`` (the selection of layers that select nothing), ``decode`` (the
    sparse decode requests as one batch) and, on the host, ``planned_pages`` (page counters).
    """

    # the cached properties made from ``block_table`` and ``layout`` (dropped when those change)
    _MADE_FROM_TABLE = ("forced_past", "rows", "dense_tables", "no_selection", "decode", "planned_pages")

    def __init__(self, plan: StepPlan):
        self._plan = weakref.ref(plan)  # (the plan owns the state: no reference cycle)
        self.block_table: torch.Tensor | None = None  # int [B, max_blocks], set by ``on``
        self.layout: PageLayout | None = None  # set by ``on``
        self.flash_rows: RowsStep | None = None
        self.flashinfer: PlannedStep | None = None
        self.triton_paged: PagedStep | None = None
        self.cpu_dense: DenseStep | None = None
        self.anchor = AnchorScores()

    @property
    def plan(self) -> StepPlan:
        return self._plan()

    def on(self, block_table: torch.Tensor, layout: PageLayout) -> StepState:
        """This state for the step's block table (``int [B, max_blocks]``, on the device the parts
        are made on) and the cache's page layout: other ones than last time drop the parts made
        from those (an engine step passes the same ones to every layer)."""
        if block_table is not self.block_table or layout != self.layout:
            for name in self._MADE_FROM_TABLE:
                self.__dict__.pop(name, None)
            self.block_table, self.layout = block_table, layout
        return self

    def _where(self) -> tuple[torch.Tensor, PageLayout]:
        if self.block_table is None or self.layout is None:
            raise RuntimeError("StepState.on(block_table, layout) must come before its device parts")
        return self.block_table, self.layout

    @cached_property
    def forced_past(self) -> tuple[torch.Tensor, ...]:
        """Per request, ``int64 [F']`` its forced past pages (sink, local window) on the device, for
        the sparse requests that select pages (empty for the others); one host-to-device copy."""
        block_table, _ = self._where()
        reqs = self.plan.requests
        host = [r.forced_past if r.sparse and r.num_select else r.forced[:0] for r in reqs]
        if not host:
            return ()
        dev = torch.cat(host).to(block_table.device, non_blocking=True)
        return dev.split([h.numel() for h in host])

    @cached_property
    def rows(self) -> StepRows:
        """``tables.StepRows``: the forced part of every page-table row (``int64 [B * Hkv, F_max]``
        physical page ids) and the rows' last-page lengths, on the device."""
        from vllm_sparse.tables import make_step_rows

        return make_step_rows(self.plan, *self._where())

    @cached_property
    def dense_tables(self) -> PageTables:
        """``tables.PageTables`` of a step without a sparse request (every row attends its forced
        pages, i.e. all its pages): one table for every layer of the step."""
        from vllm_sparse.tables import forced_only_tables

        return forced_only_tables(self.rows, self._where()[1].page_size)

    @cached_property
    def no_selection(self) -> Selection:
        """``selectors.base.Selection`` that selects nothing (``indices int64 [B * Hkv, max_select]``,
        ``counts int32 [B * Hkv]`` zero): the selection of layers whose requests all run dense."""
        from vllm_sparse.selectors.base import empty_selection

        block_table, layout = self._where()
        return empty_selection(self.plan, layout.num_kv_heads, block_table.device)

    @cached_property
    def decode(self) -> DecodeBatch | None:
        """``selectors.decode_batch.DecodeBatch``: the step's sparse decode requests (one query token
        each) as rows scored together by every selector (``None`` if there are none)."""
        from vllm_sparse.selectors.decode_batch import make_decode_batch

        return make_decode_batch(self.plan, *self._where())

    @cached_property
    def planned_pages(self) -> PlannedPages:
        """The plan's page counts over its ``B * Hkv`` rows, on the host."""
        hkv = self._where()[1].num_kv_heads
        reqs = self.plan.requests
        return PlannedPages(
            hkv * sum(r.sparse for r in reqs),
            hkv * sum(r.num_pages for r in reqs),
            hkv * sum(r.total_pages for r in reqs),
            hkv * sum(r.num_pages for r in reqs if r.query_len > 1),
            hkv * sum(r.total_pages for r in reqs if r.query_len > 1),
        )
