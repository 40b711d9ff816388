"""Stage 2 (select): vllm_sparse/selectors/quoka.py against brute-force loops."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    gen,
    make_paged_batch,
    plant_aligned_keys,
    query_start_loc,
    randn,
    single_thread,  # noqa: F401  (autouse fixture: one torch thread)
)

from vllm_sparse.config import Budget, LayerPolicy, SparseConfig
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import QuokaSelector, make_selector
from vllm_sparse.selectors.quoka import group_query, score_pages, subselect_queries


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(a @ b / (a.norm() * b.norm()))


# ---------------------------------------------------------------------------------------------
# subselect_queries
# ---------------------------------------------------------------------------------------------


def brute_subselect(q: torch.Tensor, num: int) -> torch.Tensor:
    c, hq, d = q.shape
    if c <= num:
        return q
    out = torch.empty(num, hq, d, dtype=q.dtype)
    for h in range(hq):
        mean = q[:, h].double().mean(dim=0)
        sims = [(cos(q[i, h], mean), i) for i in range(c)]
        sims.sort()  # least similar first
        for rank, (_, i) in enumerate(sims[:num]):
            out[rank, h] = q[i, h]
    return out


@pytest.mark.parametrize("c", [1, 2, 5, 16, 33])
@pytest.mark.parametrize("num", [1, 4, 16, 64])
@pytest.mark.parametrize("hq,d", [(1, 8), (6, 16)])
def test_subselect_queries(c, num, hq, d):
    q = randn(c, hq, d, g=gen(c * 100 + num + hq)) + 0.3  # a shared offset: the mean is not ~0
    got = subselect_queries(q, num)
    want = brute_subselect(q, num)
    assert got.shape == (min(c, num), hq, d)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_subselect_keeps_the_outliers():
    g = gen(7)
    base = torch.ones(16)
    q = (base + 0.05 * randn(20, 2, 16, g=g)).clone()
    q[3, 0] = -base  # opposite of the mean
    q[11, 1] = randn(16, g=g)  # unrelated direction
    got = subselect_queries(q, 1)
    assert torch.equal(got[0, 0], q[3, 0]) and torch.equal(got[0, 1], q[11, 1])


# ---------------------------------------------------------------------------------------------
# group_query and score_pages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hkv,group", [(1, 1), (2, 1), (1, 4), (2, 7), (3, 2)])
@pytest.mark.parametrize("n", [1, 5])
def test_group_query(hkv, group, n):
    d = 8
    q = randn(n, hkv * group, d, g=gen(hkv * 10 + group + n)) * 3
    got = group_query(q, hkv)
    assert got.shape == (hkv, n, d)
    want = torch.zeros(hkv, n, d, dtype=torch.float64)
    for kh in range(hkv):
        for i in range(n):
            for gi in range(group):
                v = q[i, kh * group + gi].double()
                want[kh, i] += v / v.norm() / group
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def brute_page_scores(kept: torch.Tensor, keys: torch.Tensor, hkv: int) -> torch.Tensor:
    """kept ``[n, Hq, D]`` queries, keys ``[Hkv, P, N, D]`` -> ``[Hkv, P]``: max over tokens of the page of
    max over kept queries of the mean over the GQA group of cosine(q, k)."""
    hq = kept.shape[1]
    group = hq // hkv
    _, p, npg, _ = keys.shape
    out = torch.empty(hkv, p, dtype=torch.float64)
    kept = kept.double()
    for kh in range(hkv):
        qs = kept[:, kh * group : (kh + 1) * group]  # [n, G, D]
        qs = qs / qs.norm(dim=-1, keepdim=True)
        for pg in range(p):
            best = -float("inf")
            for t in range(npg):
                k = keys[kh, pg, t].double()
                cosines = qs @ (k / k.norm())  # [n, G]: cosine of each kept query of each group head
                best = max(best, float(cosines.mean(dim=1).max()))
            out[kh, pg] = best
    return out


@pytest.mark.parametrize("hkv,group", [(1, 1), (2, 4), (1, 7)])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("pages,page_size", [(1, 1), (5, 4), (3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_pages(hkv, group, n_q, pages, page_size, dtype):
    d = 8
    g = gen(hkv + 10 * group + 100 * n_q + 1000 * pages)
    kept = randn(n_q, hkv * group, d, g=g)
    keys = randn(hkv, pages, page_size, d, g=g, dtype=dtype) * 2
    got = score_pages(group_query(kept, hkv), keys)
    assert got.shape == (hkv, pages)
    want = brute_page_scores(kept, keys, hkv)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# QuokaSelector on a paged cache
# ---------------------------------------------------------------------------------------------


def sparse_policy(**kw) -> LayerPolicy:
    args = {"fraction": 0.3, "lo": 0, "hi": None, "sink": 4, "local": 8, "dense_below": 0}
    args.update(kw)
    return LayerPolicy(
        False,
        Budget(fraction=args["fraction"], min_tokens=args["lo"], max_tokens=args["hi"]),
        args["sink"],
        args["local"],
        args["dense_below"],
    )


def brute_selection(batch, plan, query, num_queries, r, kh):
    """Brute-force top-k set of non-forced past pages for (request r, KV head kh), from token-level K."""
    req = plan.requests[r]
    n = plan.page_size
    hkv = batch.num_kv_heads
    q = query[req.query_start : req.query_start + req.query_len]
    kept = brute_subselect(q, num_queries)
    keys = batch.keys[r][: req.num_past_pages * n].float()  # [past tokens, Hkv, D]
    keys = keys.view(req.num_past_pages, n, hkv, -1).permute(2, 0, 1, 3)  # [Hkv, P, N, D]
    group = q.shape[1] // hkv
    scores = brute_page_scores(kept[:, kh * group : (kh + 1) * group], keys[kh : kh + 1], 1)
    forced = set(req.forced.tolist())
    cand = [(float(scores[0, pg]), pg) for pg in range(req.num_past_pages) if pg not in forced]
    cand.sort(reverse=True)
    # no ties at the cut: the brute-force top-k is well defined
    if 0 < req.num_select < len(cand):
        assert cand[req.num_select - 1][0] > cand[req.num_select][0]
    return {pg for _, pg in cand[: req.num_select]}


def check_selection(batch, plan, query, num_queries, sel):
    hkv = batch.num_kv_heads
    rows = len(plan.requests) * hkv
    assert sel.indices.shape == (rows, plan.max_select)
    assert sel.counts.shape == (rows,) and sel.counts.dtype == torch.int32
    for r, req in enumerate(plan.requests):
        for kh in range(hkv):
            row = r * hkv + kh
            count = int(sel.counts[row])
            if not req.sparse:
                assert count == 0
                continue
            assert count == req.num_select
            got = sel.indices[row, :count].tolist()
            assert len(set(got)) == len(got)
            assert all(0 <= pg < req.num_past_pages for pg in got)
            assert not set(got) & set(req.forced.tolist())
            assert set(got) == brute_selection(batch, plan, query, num_queries, r, kh), (r, kh)


@pytest.mark.parametrize("order", ["planes", "interleaved"])
@pytest.mark.parametrize("meta_slots", [0, 1])
@pytest.mark.parametrize("hkv,group", [(2, 2), (1, 3)])
@pytest.mark.parametrize("num_queries", [4, 64])
def test_quoka_selector_matches_brute_force(order, meta_slots, hkv, group, num_queries):
    n, d = 4, 16
    # (query_len, seq_len): chunk starting inside a page, decode row, first chunk (dense),
    # page-aligned chunk, long decode
    reqs = [(13, 97), (1, 83), (9, 9), (8, 72), (1, 130)]
    seq_lens = [s for _, s in reqs]
    seed = 17 * (order == "planes") + 5 * meta_slots + 3 * hkv + group + num_queries
    batch = make_paged_batch(seq_lens, hkv, n, d, order=order, meta_slots=meta_slots, seed=seed)
    qsl = query_start_loc([ql for ql, _ in reqs])
    plan = plan_step(sparse_policy(), n, qsl, seq_lens)
    assert [r.sparse for r in plan.requests] == [True, True, False, True, True]
    assert all(r.num_select > 0 for r in plan.requests if r.sparse)
    query = randn(qsl[-1], hkv * group, d, g=gen(seed + 1)) + 0.2
    layout = PageLayout.of(batch.kv_cache, hkv, order)
    assert layout.num_meta_slots == meta_slots
    sel = QuokaSelector(num_queries)(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan)
    check_selection(batch, plan, query, num_queries, sel)


def test_quoka_selector_dense_step_gives_zero_counts():
    n, d, hkv = 4, 8, 2
    batch = make_paged_batch([50, 60], hkv, n, d, seed=3)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    p = LayerPolicy(True, Budget(fraction=0.1, min_tokens=0, max_tokens=None), 0, 0, 0)
    plan = plan_step(p, n, [0, 1, 11], [50, 60])
    query = randn(11, 4, d, g=gen(4))
    sel = QuokaSelector(8)(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan)
    assert sel.counts.tolist() == [0, 0, 0, 0]
    assert sel.indices.shape == (4, 0)


@pytest.mark.parametrize("order", ["planes", "interleaved"])
@pytest.mark.parametrize("query_len", [1, 12])
def test_planted_key_page_is_selected(order, query_len):
    n, d, hkv, group = 4, 16, 2, 3
    seq = 200 + query_len
    batch = make_paged_batch([seq], hkv, n, d, order=order, meta_slots=1, seed=11)
    layout = PageLayout.of(batch.kv_cache, hkv, order)
    plan = plan_step(sparse_policy(fraction=0.08), n, [0, query_len], [seq])
    req = plan.requests[0]
    assert req.sparse and req.num_select >= 1
    # one strongly aligned key per head, in a different non-forced past page per head
    query, _, planted = plant_aligned_keys(batch.kv_cache, layout, batch.block_table, req, hkv, group, d)
    planted = {kh: pg for kh, (pg, _) in planted.items()}
    sel = QuokaSelector(64)(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan)
    for kh, pg in planted.items():
        row = sel.indices[kh, : sel.counts[kh]].tolist()
        assert pg in row, (kh, pg, row)
    if req.num_select == 1:
        assert sel.indices[0, 0] != sel.indices[1, 0]


def test_make_selector():
    s = make_selector(SparseConfig(quoka={"num_queries": 5}))
    assert isinstance(s, QuokaSelector) and s.num_queries == 5
    from vllm_sparse.selectors import CompactSelector

    assert isinstance(make_selector(SparseConfig(method="compact")), CompactSelector)
