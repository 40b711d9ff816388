"""The per-step state (vllm_sparse/step_state.py): one object per step plan, its parts made once and
shared by layers and selectors, remade for another block table or layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import single_thread  # noqa: F401  (autouse fixture: one torch thread)
from test_selector_twilight import mixed_step

from vllm_sparse.policy import StepPlan
from vllm_sparse.selectors import QuestSelector, QuokaSelector, TwilightSelector
from vllm_sparse.selectors import decode_batch as decode_batch_module
from vllm_sparse.step_state import PlannedPages, StepState
from vllm_sparse.tables import build_page_tables


def test_every_plan_carries_one_state():
    *_, plan, _ = mixed_step(2, 2, seed=1)
    assert isinstance(plan.state, StepState) and plan.state.plan is plan
    assert not hasattr(StepPlan, "cached")
    again = dataclasses.replace(plan)
    assert again == plan and again.state is not plan.state  # a new plan, a new state
    with pytest.raises(RuntimeError):
        plan.state.rows  # noqa: B018  (the device parts need ``on`` first)


def test_one_decode_batch_serves_every_selector_and_layer(monkeypatch):
    args = mixed_step(2, 2, seed=3)
    plan = args[4]
    made = []
    make = decode_batch_module.make_decode_batch
    monkeypatch.setattr(decode_batch_module, "make_decode_batch", lambda *a: made.append(1) or make(*a))
    for selector in (QuestSelector(), TwilightSelector(QuestSelector(), 0.9), QuokaSelector()):
        for _layer in range(2):
            selector(*args)
    assert len(made) == 1
    batch = plan.state.decode
    decodes = [r for r, q in enumerate(plan.requests) if q.sparse and q.num_select and q.query_len == 1]
    assert batch.req.tolist() == decodes
    assert batch.rows.tolist() == [r * 2 + h for r in decodes for h in range(2)]
    assert batch.page_ids.shape == batch.excluded.shape == (2 * len(decodes), batch.max_past)
    assert batch.forced_blocks.shape == (2 * len(decodes), batch.max_forced)


def test_parts_are_made_once_and_remade_for_other_inputs():
    query, pk, table, layout, plan, meta = mixed_step(2, 2, seed=5)
    state = plan.state.on(table, layout)
    rows, forced, decode = state.rows, state.forced_past, state.decode
    assert plan.state.on(table, layout).rows is rows and state.forced_past is forced and state.decode is decode
    for r, req in enumerate(plan.requests):
        if req.sparse and req.num_select:
            assert torch.equal(forced[r], req.forced_past)
    other = table.clone()
    assert plan.state.on(other, layout).rows is not rows  # another block table: made again
    assert plan.state.decode.block_table is other
    wider = dataclasses.replace(layout, num_head_slots=layout.num_head_slots + 1)
    assert plan.state.on(other, wider).rows is not plan.state.on(other, layout).rows


def test_planned_pages_and_tables_of_a_dense_step():
    query, pk, table, layout, plan, meta = mixed_step(2, 2, seed=7)
    state = plan.state.on(table, layout)
    hkv = layout.num_kv_heads
    assert state.planned_pages == PlannedPages(
        hkv * sum(r.sparse for r in plan.requests),
        hkv * sum(r.num_pages for r in plan.requests),
        hkv * sum(r.total_pages for r in plan.requests),
        hkv * sum(r.num_pages for r in plan.requests if r.query_len > 1),
        hkv * sum(r.total_pages for r in plan.requests if r.query_len > 1),
    )
    dense = StepPlan(plan.page_size, tuple(dataclasses.replace(r, sparse=False, num_select=0) for r in plan.requests))
    dense_state = dense.state.on(table, layout)
    tables = build_page_tables(dense, dense_state.no_selection, table, layout)
    assert tables is dense_state.dense_tables is build_page_tables(dense, dense_state.no_selection, table, layout)
    none = dense_state.no_selection
    assert none.counts.eq(0).all() and none.counts.numel() == 2 * len(plan.requests)
