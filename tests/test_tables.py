"""Stage 3 (tables): vllm_sparse/tables.py."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    gen,
    query_start_loc,
    random_block_table,
    random_selection,
    single_thread,  # noqa: F401  (autouse fixture: one torch thread)
)

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import Selection
from vllm_sparse.tables import PageTables, build_page_tables, step_rows


def policy(dense=False, fraction=0.3, sink=4, local=8) -> LayerPolicy:
    return LayerPolicy(dense, Budget(fraction=fraction, min_tokens=0, max_tokens=None), sink, local, 0)


def build_case(reqs, n, hkv, meta_slots, seed, pol=None):
    g = gen(seed)
    seq_lens = [s for _, s in reqs]
    qsl = query_start_loc([ql for ql, _ in reqs])
    plan = plan_step(pol or policy(), n, qsl, seq_lens)
    sel, chosen = random_selection(plan, hkv, g)
    table, _ = random_block_table(seq_lens, n, g)
    layout = PageLayout(hkv, hkv + meta_slots, n, 8, "planes")
    return plan, sel, chosen, table, layout


REQS = [(13, 97), (1, 83), (9, 9), (8, 72), (1, 130), (40, 40), (3, 250)]


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("hkv", [1, 2, 5])
@pytest.mark.parametrize("meta_slots", [0, 1, 2])
def test_page_tables_brute_force(n, hkv, meta_slots):
    reqs = [(ql, s * max(1, n // 4)) if ql < s else (ql, s) for ql, s in REQS]
    plan, sel, chosen, table, layout = build_case(reqs, n, hkv, meta_slots, seed=n * 31 + hkv * 7 + meta_slots)
    assert plan.any_sparse
    pt = build_page_tables(plan, sel, table, layout)
    assert isinstance(pt, PageTables)
    rows = len(reqs) * hkv
    width = max(r.num_pages for r in plan.requests)
    assert pt.page_ids.shape == (rows, width)
    assert pt.counts.shape == (rows,) and pt.kv_lens.shape == (rows,)
    slots = hkv + meta_slots
    total_attended = 0
    for r, req in enumerate(plan.requests):
        block_to_page = {int(table[r, p]): p for p in range(req.total_pages)}
        seq = req.seq_len
        chunk = sorted({pos // n for pos in range(req.context_len, seq)})
        for kh in range(hkv):
            row = r * hkv + kh
            count = int(pt.counts[row])
            want_pages = sorted(set(req.forced.tolist()) | chosen[row])
            assert count == len(want_pages) == req.num_pages
            ids = pt.page_ids[row, :count].tolist()
            # physical ids = block * head_slots + head, never a metadata slot
            assert all(i % slots == kh for i in ids)
            logical = [block_to_page[i // slots] for i in ids]
            assert sorted(logical) == want_pages  # forced + chosen
            assert len(set(ids)) == len(ids)  # each page once
            assert logical[-len(chunk) :] == chunk  # chunk pages last, in order
            past = [p for p in logical if p not in chunk]
            assert logical[: len(past)] == past
            # the compacted row's tokens: every page full except the very last (seq tail)
            tokens = sum(min(seq, (p + 1) * n) - p * n for p in logical)
            last_len = seq - (math.ceil(seq / n) - 1) * n
            assert int(pt.kv_lens[row]) == tokens == (count - 1) * n + last_len
            total_attended += count
            if not req.sparse:
                assert logical == list(range(req.total_pages))
    assert pt.attended_pages == total_attended
    flags = [r % 2 == 0 for r in range(len(plan.requests))]
    want = sum(int(pt.counts[r * hkv + kh]) for r in range(len(flags)) if flags[r] for kh in range(hkv))
    assert pt.attended_pages_of(flags) == want > 0
    assert pt.attended_pages_of([False] * len(flags)) == 0
    assert pt.attended_pages_of([True] * len(flags)) == total_attended


def test_step_part_is_built_once_per_step():
    plan, sel, _, table, layout = build_case(REQS, 4, 2, 0, seed=5)
    a = build_page_tables(plan, sel, table, layout)
    rows = step_rows(plan, table, layout)
    assert step_rows(plan, table, layout) is rows is plan.state.rows  # the step's state, shared by layers
    b = build_page_tables(plan, sel, table, layout)
    assert torch.equal(a.page_ids, b.page_ids)
    dense_plan, _, _, _, _ = build_case(REQS, 4, 2, 0, seed=5, pol=policy(dense=True))
    d = build_page_tables(dense_plan, sel, table, layout)
    assert build_page_tables(dense_plan, sel, table, layout) is d  # one table for every layer
    assert d is dense_plan.state.dense_tables


def test_forced_pages_are_two_ranges():
    plan, _, _, _, _ = build_case(REQS, 4, 2, 0, seed=5)
    for req in plan.requests:
        head, tail = req.forced_head, req.forced_tail
        assert req.forced.tolist() == list(range(head)) + list(range(tail, req.total_pages))


def test_dense_step_tables_are_all_pages():
    reqs = [(5, 100), (1, 33), (16, 16)]
    plan, sel, _, table, layout = build_case(reqs, 16, 2, 1, seed=9, pol=policy(dense=True))
    pt = build_page_tables(plan, sel, table, layout)
    for r, (_, s) in enumerate(reqs):
        pages = math.ceil(s / 16)
        for kh in range(2):
            row = 2 * r + kh
            assert pt.counts[row] == pages and pt.kv_lens[row] == s
            assert pt.page_ids[row, :pages].tolist() == [int(b) * 3 + kh for b in table[r, :pages]]


def test_selection_order_does_not_matter():
    plan, sel, _, table, layout = build_case(REQS, 4, 2, 0, seed=21)
    a = build_page_tables(plan, sel, table, layout)
    flipped = Selection(sel.indices.clone(), sel.counts)
    for r, req in enumerate(plan.requests):
        k = req.num_select
        flipped.indices[2 * r : 2 * r + 2, :k] = sel.indices[2 * r : 2 * r + 2, :k].flip(1)
    b = build_page_tables(plan, flipped, table, layout)
    for row in range(a.page_ids.shape[0]):
        c = int(a.counts[row])
        assert torch.equal(a.page_ids[row, :c].sort().values, b.page_ids[row, :c].sort().values)
    assert torch.equal(a.kv_lens, b.kv_lens) and torch.equal(a.counts, b.counts)


@pytest.mark.parametrize("hkv", [1, 3])
def test_variable_counts_rows_hold_forced_plus_counted_picks(hkv):
    """Top-p style selections: fewer valid entries than ``num_select``, garbage after them."""
    n = 4
    plan, sel, chosen, table, layout = build_case(REQS, n, hkv, 1, seed=33 + hkv)
    g = gen(hkv)
    counts = torch.zeros_like(sel.counts)
    for r, req in enumerate(plan.requests):
        for kh in range(hkv):
            row = r * hkv + kh
            if req.sparse:
                counts[row] = int(torch.randint(0, req.num_select + 1, (1,), generator=g))
    short = Selection(sel.indices, counts)
    pt = build_page_tables(plan, short, table, layout)
    slots = hkv + 1
    for r, req in enumerate(plan.requests):
        block_to_page = {int(table[r, p]): p for p in range(req.total_pages)}
        last_len = req.seq_len - (req.total_pages - 1) * n
        for kh in range(hkv):
            row = r * hkv + kh
            c = int(counts[row])
            want = sorted(set(req.forced.tolist()) | set(sel.indices[row, :c].tolist()))
            count = int(pt.counts[row])
            assert count == len(want) == req.forced.numel() + c
            ids = pt.page_ids[row].tolist()
            assert sorted(block_to_page[i // slots] for i in ids[:count]) == want
            assert all(i % slots == kh and i // slots in block_to_page for i in ids[: req.num_pages])  # padding
            assert int(pt.kv_lens[row]) == (count - 1) * n + last_len
