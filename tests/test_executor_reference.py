"""Stage 4 (execute): vllm_sparse/executors/reference.py over tables from vllm_sparse/tables.py,
against brute-force attention computed from token-level K/V by true position."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    brute_attention,
    gen,
    make_paged_batch,
    query_start_loc,
    randn,
    random_selection,
    single_thread,  # noqa: F401  (autouse fixture: one torch thread)
)

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.executors import reference_executor
from vllm_sparse.executors.reference import attend_request
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import empty_selection
from vllm_sparse.tables import PageTables, build_page_tables

DENSE = LayerPolicy(True, Budget(), 16, 512, 4096)


def sparse_policy(fraction=0.3) -> LayerPolicy:
    return LayerPolicy(False, Budget(fraction=fraction, min_tokens=0, max_tokens=None), 4, 8, 0)


TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}

# (query_len, seq_len): prefill chunk starting inside a page, decode rows, a first chunk,
# a page-aligned chunk, a chunk ending on a page boundary
MIXED = [(13, 97), (1, 83), (9, 9), (8, 72), (1, 130), (20, 52), (1, 1)]


def run_pipeline(reqs, pol, hkv, group, n, d, order, meta_slots, dtype, scale, seed, selection="empty"):
    seq_lens = [s for _, s in reqs]
    qsl = query_start_loc([ql for ql, _ in reqs])
    batch = make_paged_batch(seq_lens, hkv, n, d, order=order, meta_slots=meta_slots, dtype=dtype, seed=seed)
    layout = PageLayout.of(batch.kv_cache, hkv, order)
    plan = plan_step(pol, n, qsl, seq_lens)
    if selection == "empty":
        sel, chosen = empty_selection(plan, hkv, torch.device("cpu")), None
    else:
        sel, chosen = random_selection(plan, hkv, gen(seed + 2))
    tables = build_page_tables(plan, sel, batch.block_table, layout)
    query = randn(qsl[-1], hkv * group, d, g=gen(seed + 1), dtype=dtype)
    output = torch.full_like(query, float("nan"))
    reference_executor(
        query, layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache), tables, plan, scale, output
    )
    assert not output.isnan().any()  # every query row written
    return batch, plan, query, output, chosen


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("n", [4, 16])
@pytest.mark.parametrize("order,meta_slots", [("planes", 0), ("interleaved", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_plan_equals_dense_causal_attention(group, n, order, meta_slots, dtype):
    hkv, d = 2, 16
    scale = 1 / math.sqrt(d)
    batch, plan, query, out, _ = run_pipeline(
        MIXED, DENSE, hkv, group, n, d, order, meta_slots, dtype, scale, seed=group * 10 + n
    )
    assert not plan.any_sparse
    for r, req in enumerate(plan.requests):
        toks = slice(req.query_start, req.query_start + req.query_len)
        want = brute_attention(query[toks], batch.keys[r], batch.values[r], req.context_len, scale)
        torch.testing.assert_close(out[toks].double(), want, **TOL[dtype], msg=lambda m, r=r: f"request {r}: {m}")


@pytest.mark.parametrize("scale", [0.05, 0.7, 2.0])
@pytest.mark.parametrize("group", [1, 4])
def test_dense_other_scales(scale, group):
    hkv, d, n = 2, 8, 4
    batch, plan, query, out, _ = run_pipeline(
        MIXED[:3], DENSE, hkv, group, n, d, "planes", 0, torch.float32, scale, seed=3
    )
    for r, req in enumerate(plan.requests):
        toks = slice(req.query_start, req.query_start + req.query_len)
        want = brute_attention(query[toks], batch.keys[r], batch.values[r], req.context_len, scale)
        torch.testing.assert_close(out[toks].double(), want, rtol=1e-5, atol=1e-5)


SPARSE_REQS = [(13, 97), (1, 83), (9, 9), (8, 72), (1, 130), (6, 150)]


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("order,meta_slots", [("planes", 1), ("interleaved", 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.9])
def test_sparse_selection_equals_attention_over_chosen_pages(group, n, order, meta_slots, dtype, scale):
    hkv, d = 2, 16
    scale = 1 / math.sqrt(d) if scale is None else scale
    batch, plan, query, out, chosen = run_pipeline(
        SPARSE_REQS,
        sparse_policy(),
        hkv,
        group,
        n,
        d,
        order,
        meta_slots,
        dtype,
        scale,
        seed=group + 3 * n,
        selection="random",
    )
    assert sum(r.sparse for r in plan.requests) >= 4
    for r, req in enumerate(plan.requests):
        toks = slice(req.query_start, req.query_start + req.query_len)
        visible = [set(req.forced.tolist()) | chosen[r * hkv + kh] for kh in range(hkv)]
        if req.sparse:
            assert visible[0] != visible[1] or req.num_select == 0  # different pages per KV head
            assert all(len(v) < req.total_pages for v in visible)
        want = brute_attention(
            query[toks], batch.keys[r], batch.values[r], req.context_len, scale, visible_pages=visible, page_size=n
        )
        torch.testing.assert_close(out[toks].double(), want, **TOL[dtype], msg=lambda m, r=r: f"request {r}: {m}")
        if req.sparse and dtype == torch.float32:  # the result really differs from dense attention
            dense = brute_attention(query[toks], batch.keys[r], batch.values[r], req.context_len, scale)
            assert not torch.allclose(out[toks].double(), dense, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("group", [1, 4])
def test_mixed_batch_equals_per_request_runs(group):
    hkv, d, n = 2, 8, 4
    scale = 0.4
    batch, plan, query, out, _ = run_pipeline(
        SPARSE_REQS, sparse_policy(), hkv, group, n, d, "planes", 0, torch.float32, scale, 5, selection="random"
    )
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    sel = random_selection(plan, hkv, gen(5 + 2))[0]
    tables = build_page_tables(plan, sel, batch.block_table, layout)
    for r, req in enumerate(plan.requests):
        toks = slice(req.query_start, req.query_start + req.query_len)
        one = plan_step(sparse_policy(), n, [0, req.query_len], [req.seq_len])
        assert one.requests[0].forced.tolist() == req.forced.tolist()
        rows = slice(r * hkv, (r + 1) * hkv)
        t1 = PageTables(tables.page_ids[rows], tables.counts[rows], tables.kv_lens[rows])
        o1 = torch.empty(req.query_len, hkv * group, d)
        reference_executor(
            query[toks], layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache), t1, one, scale, o1
        )
        torch.testing.assert_close(o1, out[toks], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("c,kv_len", [(1, 1), (1, 9), (5, 5), (5, 12), (3, 16)])
def test_attend_request_bottom_right_mask(c, kv_len):
    """Compacted rows: query i of C sees compacted token j iff j <= kv_len - C + i."""
    hkv, group, d, t = 2, 3, 8, 16
    g = gen(c * 100 + kv_len)
    q = randn(c, hkv, group, d, g=g)
    k = randn(hkv, t, d, g=g)
    v = randn(hkv, t, d, g=g)
    out = attend_request(q, k, v, torch.full((hkv,), kv_len, dtype=torch.int32), 0.5)
    assert out.shape == (c, hkv, group, d)
    for i in range(c):
        for kh in range(hkv):
            lim = kv_len - c + i
            for gi in range(group):
                w = torch.softmax((k[kh, : lim + 1] @ q[i, kh, gi]).double() * 0.5, 0)
                torch.testing.assert_close(out[i, kh, gi].double(), w @ v[kh, : lim + 1].double(), rtol=1e-5, atol=1e-5)
