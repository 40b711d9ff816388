"""Stage 2 (select): vllm_sparse/selectors/quest.py against brute-force loops, with page summaries
written by vllm_sparse/metadata/page_minmax.py into the cache's metadata slots."""

from __future__ import annotations

import math
import zlib

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
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import QuestSelector, Selection, make_selector
from vllm_sparse.selectors.quest import page_upper_bounds, reduce_and_pick


def paged_batch_with_meta(seq_lens, hkv, n, d, order="planes", dtype=torch.float32, seed=0, method="quest"):
    planes = MetaPlanes.for_method(method, hkv, n, d, dtype)
    batch = make_paged_batch(seq_lens, hkv, n, d, order=order, meta_slots=planes.num_slots, dtype=dtype, seed=seed)
    layout = PageLayout.of(batch.kv_cache, hkv, order)
    meta = planes.views(batch.kv_cache)
    slots = torch.cat(
        [batch.block_table[r, torch.arange(s) // n].long() * n + torch.arange(s) % n for r, s in enumerate(seq_lens)]
    )
    write_page_minmax(layout, batch.kv_cache, meta, slots)
    return batch, layout, meta


# ---------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------


def brute_bounds(q, kmin, kmax):
    """``[C, Hq, D]``, ``[Hkv, P, D]`` -> ``[Hkv, G, P]`` float64, loop over channels."""
    c, hq, d = q.shape
    hkv, p, _ = kmin.shape
    g = hq // hkv
    out = torch.full((hkv, g, p), -math.inf, dtype=torch.float64)
    for h in range(hq):
        kh = h // g
        for pg in range(p):
            for i in range(c):
                s = sum(
                    max(float(q[i, h, ch]) * float(kmax[kh, pg, ch]), float(q[i, h, ch]) * float(kmin[kh, pg, ch]))
                    for ch in range(d)
                )
                out[kh, h % g, pg] = max(out[kh, h % g, pg], s)
    return out


@pytest.mark.parametrize("c,hkv,g,p", [(1, 1, 1, 3), (3, 2, 2, 4), (5, 1, 4, 2)])
def test_page_upper_bounds_brute_force(c, hkv, g, p):
    d = 6
    gg = gen(c + 10 * hkv + 100 * g)
    q = randn(c, hkv * g, d, g=gg)
    a, b = randn(hkv, p, d, g=gg), randn(hkv, p, d, g=gg)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    torch.testing.assert_close(
        page_upper_bounds(q, kmin, kmax).double(), brute_bounds(q, kmin, kmax), rtol=1e-5, atol=1e-5
    )


def test_bound_is_an_upper_bound_of_every_key_in_the_page():
    gg = gen(5)
    keys = randn(2, 7, 16, 32, g=gg)  # [Hkv, P, N, D]
    q = randn(9, 6, 32, g=gg)  # G = 3
    u = page_upper_bounds(q, keys.amin(dim=2), keys.amax(dim=2))  # [Hkv, G, P]
    for h in range(6):
        dots = torch.einsum("cd,pnd->cpn", q[:, h], keys[h // 3])  # [C, P, N]
        assert bool((dots.amax(dim=(0, 2)) <= u[h // 3, h % 3] + 1e-4).all())


def test_query_blocks_give_the_same_bounds(monkeypatch):
    gg = gen(9)
    q = randn(70, 4, 8, g=gg)
    a, b = randn(2, 5, 8, g=gg), randn(2, 5, 8, g=gg)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    whole = page_upper_bounds(q, kmin, kmax)
    monkeypatch.setattr("vllm_sparse.selectors.quest.QUERY_BLOCK", 16)
    torch.testing.assert_close(page_upper_bounds(q, kmin, kmax), whole)


# ---------------------------------------------------------------------------------------------
# GQA reduction
# ---------------------------------------------------------------------------------------------


def brute_pick(scores, excluded, k, rule, scale):
    """``[Hkv, G, P]`` -> list of sets per KV head."""
    hkv, g, p = scores.shape
    out = []
    for kh in range(hkv):
        cand = [pg for pg in range(p) if pg not in excluded]
        if rule == "max":
            val = {pg: max(float(scores[kh, i, pg]) for i in range(g)) for pg in cand}
        elif rule == "sum":
            val = {pg: 0.0 for pg in cand}
            for i in range(g):
                z = sum(math.exp(float(scores[kh, i, x]) * scale) for x in cand)
                for pg in cand:
                    val[pg] += math.exp(float(scores[kh, i, pg]) * scale) / z
        if rule in ("max", "sum"):
            out.append(set(sorted(cand, key=lambda x: -val[x])[:k]))
            continue
        ranked = [sorted(cand, key=lambda x: -float(scores[kh, i, x])) for i in range(g)]
        picked: list[int] = []
        for rank in range(len(cand)):
            for i in range(g):
                if len(picked) < k and ranked[i][rank] not in picked:
                    picked.append(ranked[i][rank])
        out.append(set(picked))
    return out


@pytest.mark.parametrize("rule", ["max", "sum", "union"])
@pytest.mark.parametrize("hkv,g,p,k", [(1, 1, 6, 2), (2, 4, 12, 5), (3, 3, 9, 1), (1, 5, 20, 12)])
def test_reduce_and_pick_brute_force(rule, hkv, g, p, k):
    gg = gen(zlib.crc32(repr((rule, hkv, g, p, k)).encode()) % 1000)  # stable across processes
    scores = randn(hkv, g, p, g=gg) * 4
    excluded = [0, p - 1]
    got = reduce_and_pick(scores, torch.tensor(excluded), k, rule, 0.5)
    assert got.shape == (hkv, k)
    want = brute_pick(scores, set(excluded), k, rule, 0.5)
    for kh in range(hkv):
        assert len(set(got[kh].tolist())) == k
        assert set(got[kh].tolist()) == want[kh], (kh, rule)


def test_union_takes_every_heads_favourite():
    # head 0 loves page 1, head 1 loves page 4; max would take the two best of head 0
    scores = torch.tensor([[[0.0, 9.0, 8.0, 7.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0, 2.0, 0.0]]])
    assert set(reduce_and_pick(scores, torch.tensor([0]), 2, "union", 1.0)[0].tolist()) == {1, 4}
    assert set(reduce_and_pick(scores, torch.tensor([0]), 2, "max", 1.0)[0].tolist()) == {1, 2}


# ---------------------------------------------------------------------------------------------
# QuestSelector on a paged cache
# ---------------------------------------------------------------------------------------------


def sparse_policy(fraction=0.3, sink=4, local=8) -> LayerPolicy:
    return LayerPolicy(False, Budget(fraction=fraction, min_tokens=0, max_tokens=None), sink, local, 0)


@pytest.mark.parametrize("order", ["planes", "interleaved"])
@pytest.mark.parametrize("rule", ["max", "sum", "union"])
@pytest.mark.parametrize("hkv,group", [(2, 2), (1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quest_selector_matches_brute_force(order, rule, hkv, group, dtype):
    n, d = 4, 8
    reqs = [(13, 97), (1, 83), (9, 9), (8, 72), (1, 130)]
    seq_lens = [s for _, s in reqs]
    seed = 3 * hkv + group + 7 * (order == "planes") + 11 * (dtype == torch.bfloat16)
    batch, layout, meta = paged_batch_with_meta(seq_lens, hkv, n, d, order, dtype, seed)
    qsl = query_start_loc([ql for ql, _ in reqs])
    plan = plan_step(sparse_policy(), n, qsl, seq_lens)
    assert [r.sparse for r in plan.requests] == [True, True, False, True, True]
    query = randn(qsl[-1], hkv * group, d, g=gen(seed + 1))
    sel = QuestSelector(rule)(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)
    scale = d**-0.5
    for r, req in enumerate(plan.requests):
        for kh in range(hkv):
            row = r * hkv + kh
            if not req.sparse:
                assert int(sel.counts[row]) == 0
                continue
            assert int(sel.counts[row]) == req.num_select
            # brute force from the token-level keys of the request (not the stored summaries)
            keys = batch.keys[r][: req.num_past_pages * n].float().view(req.num_past_pages, n, hkv, d)
            kmin, kmax = keys.amin(dim=1).transpose(0, 1), keys.amax(dim=1).transpose(0, 1)
            q = query[req.query_start : req.query_start + req.query_len]
            scores = brute_bounds(q[:, kh * group : (kh + 1) * group], kmin[kh : kh + 1], kmax[kh : kh + 1])
            want = brute_pick(scores.float(), set(req.forced.tolist()), req.num_select, rule, scale)[0]
            assert set(sel.indices[row, : req.num_select].tolist()) == want, (r, kh)


@pytest.mark.parametrize("rule", ["max", "sum", "union"])
@pytest.mark.parametrize("query_len", [1, 12])
def test_planted_key_page_is_selected(rule, query_len):
    n, d, hkv, group = 4, 16, 2, 3
    seq = 200 + query_len
    batch, layout, meta = paged_batch_with_meta([seq], hkv, n, d, seed=11)
    plan = plan_step(sparse_policy(fraction=0.08), n, [0, query_len], [seq])
    req = plan.requests[0]
    assert req.sparse and req.num_select >= 1
    query, direction, planted = plant_aligned_keys(batch.kv_cache, layout, batch.block_table, req, hkv, group, d)
    for kh, (_, block) in planted.items():  # keep the page bounds true to the planted keys
        meta.kmax[block, kh] = torch.maximum(meta.kmax[block, kh], 10 * direction[kh])
        meta.kmin[block, kh] = torch.minimum(meta.kmin[block, kh], 10 * direction[kh])
    planted = {kh: pg for kh, (pg, _) in planted.items()}
    sel = QuestSelector(rule)(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)
    for kh, pg in planted.items():
        assert pg in sel.indices[kh, : sel.counts[kh]].tolist(), (kh, pg)


def test_quest_needs_metadata_and_make_selector():
    s = make_selector(SparseConfig(method="quest", quest={"gqa_reduce": "union"}))
    assert isinstance(s, QuestSelector) and s.gqa_reduce == "union"
    batch = make_paged_batch([100], 1, 4, 8)
    layout = PageLayout.of(batch.kv_cache, 1, "planes")
    plan = plan_step(sparse_policy(), 4, [0, 1], [100])
    with pytest.raises(ValueError, match="min/max"):
        s(torch.ones(1, 2, 8), layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, None)


# ---------------------------------------------------------------------------------------------
# Decode batching: the step's decode requests scored together == one request at a time
# ---------------------------------------------------------------------------------------------

# decode requests of different lengths, a prefill chunk, a dense decode (too short) and a dense chunk
MIXED = [(1, 97), (13, 120), (1, 83), (1, 9), (1, 150), (9, 9), (1, 61), (1, 130)]


def assert_same_selection(got, want):
    assert torch.equal(got.counts, want.counts)
    for row in range(want.counts.numel()):
        k = int(want.counts[row])
        assert set(got.indices[row, :k].tolist()) == set(want.indices[row, :k].tolist()), row
        assert len(set(got.indices[row, :k].tolist())) == k, row


def mixed_step(hkv, group, seed, dtype=torch.float32, order="planes", n=4, d=8, reqs=MIXED):
    seq_lens = [s for _, s in reqs]
    batch, layout, meta = paged_batch_with_meta(seq_lens, hkv, n, d, order, dtype, seed)
    qsl = query_start_loc([ql for ql, _ in reqs])
    plan = plan_step(sparse_policy(), n, qsl, seq_lens)
    query = randn(qsl[-1], hkv * group, d, g=gen(seed + 1), dtype=dtype)
    return (query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)


@pytest.mark.parametrize("rule", ["max", "sum", "union"])
@pytest.mark.parametrize("hkv,group", [(2, 2), (1, 3), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_selects_like_per_request(rule, hkv, group, dtype, monkeypatch):
    from vllm_sparse.selectors import quest

    args = mixed_step(hkv, group, seed=hkv + 3 * group + (dtype == torch.bfloat16), dtype=dtype)
    plan = args[4]
    decodes = [r.sparse and r.query_len == 1 for r in plan.requests]
    assert sum(decodes) >= 4 and len({r.num_past_pages for r in plan.requests if r.sparse}) > 3
    assert any(r.sparse and r.query_len > 1 for r in plan.requests) and not all(r.sparse for r in plan.requests)
    want = QuestSelector(rule, batch_decode=False)(*args)
    calls = []
    per_request = quest._bounds
    monkeypatch.setattr(quest, "_bounds", lambda q, m, b: calls.append(q.shape[0]) or per_request(q, m, b))
    got = QuestSelector(rule)(*args)
    assert calls == [13]  # only the prefill chunk went one request at a time
    assert_same_selection(got, want)
    got_again = QuestSelector(rule)(*args)  # the per-step batch kept in plan.state.decode
    assert_same_selection(got_again, want)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("hkv,group", [(2, 2), (1, 3)])
def test_exact_prefill_scores_chunks_like_quoka_and_decodes_by_bounds(hkv, group, window):
    """``quest.prefill_scores: exact``: a mixed step's prefill rows are QuoKA's selection (its
    query subselection and cosine scores, every query unless a window is set), its decode rows
    the bounds' selection; ``make_selector`` builds it by default, ``bounds`` restores the bounds."""
    from vllm_sparse.selectors import QuokaSelector

    args = mixed_step(hkv, group, seed=40 + hkv + group)
    plan = args[4]
    hkv_rows = lambda pred: [r * hkv + h for r, q in enumerate(plan.requests) if q.sparse and pred(q)  # noqa: E731
                             for h in range(hkv)]  # fmt: skip
    prefill, decode = hkv_rows(lambda q: q.query_len > 1), hkv_rows(lambda q: q.query_len == 1)
    assert prefill and decode
    got = QuestSelector("max", prefill=QuokaSelector(4, query_window=window))(*args)
    chunks = QuokaSelector(4, query_window=window)(*args)
    bounds = QuestSelector("max")(*args)
    for rows, want in ((prefill, chunks), (decode, bounds)):
        idx = torch.tensor(rows)
        assert_same_selection(
            Selection(got.indices[idx], got.counts[idx]), Selection(want.indices[idx], want.counts[idx])
        )
    cfg = SparseConfig(method="quest", quoka={"num_queries": 4}, chunk_query_window=window or 0)
    assert_same_selection(make_selector(cfg)(*args), got)
    by_bounds = SparseConfig(method="quest", quest={"prefill_scores": "bounds"}, chunk_query_window=window or 0)
    assert_same_selection(make_selector(by_bounds)(*args), QuestSelector("max", query_window=window)(*args))
    pre = torch.tensor(prefill)
    assert not torch.equal(got.indices[pre], bounds.indices[pre])  # the two rules differ on these chunks


def test_decode_bounds_rows_match_per_request_twin():
    from vllm_sparse.selectors.quest import page_upper_bounds_rows

    gg = gen(21)
    hkv, group, d, nb = 2, 3, 8, 30
    a, b = randn(nb, hkv, d, g=gg), randn(nb, hkv, d, g=gg)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    q = randn(4, hkv * group, d, g=gg)
    blocks = torch.stack([torch.randperm(nb, generator=gg)[:11] for _ in range(4)])
    got = page_upper_bounds_rows(q, kmin, kmax, blocks)
    for s in range(4):
        want = page_upper_bounds(q[s : s + 1], kmin[blocks[s]].transpose(0, 1), kmax[blocks[s]].transpose(0, 1))
        torch.testing.assert_close(got[s * hkv : (s + 1) * hkv], want)


def test_twilight_candidates_follow_quests_prefill_rule():
    """Twilight's Quest candidates rank prefill pages by exact scores when its chunks attend them all
    (the default), by the bounds when its top-p prunes them (``prune_prefill``), unless set."""
    from vllm_sparse.selectors import QuokaSelector, TwilightSelector

    tw = make_selector(SparseConfig(method="twilight"))
    assert isinstance(tw, TwilightSelector) and not tw.prune_prefill
    assert isinstance(tw.base.prefill, QuokaSelector)
    assert tw.base.prefill.query_window is None  # every query, while the estimate keeps its window of 64
    assert tw.query_window == 64
    pruned = make_selector(SparseConfig(method="twilight", twilight={"prune_prefill": True}))
    assert pruned.prune_prefill and pruned.base.prefill is None
    exact = make_selector(
        SparseConfig(method="twilight", twilight={"prune_prefill": True}, quest={"prefill_scores": "exact"})
    )
    assert isinstance(exact.base.prefill, QuokaSelector)
    assert SparseConfig(method="quest").quest_prefill_scores() == "exact"
    assert SparseConfig(method="twilight").quest_prefill_scores() == "exact"
    assert SparseConfig(method="twilight", twilight={"prune_prefill": True}).quest_prefill_scores() == "bounds"
    assert SparseConfig(method="twilight", quest={"prefill_scores": "bounds"}).quest_prefill_scores() == "bounds"
