"""Stage 2 (select): vllm_sparse/selectors/twilight.py against brute force, its variable-count rows
through tables + the reference executor, and the policy's method-specific cap."""

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
    single_thread,  # noqa: F401  (autouse fixture: one torch thread)
)

from vllm_sparse.config import Budget, LayerPolicy, SparseConfig
from vllm_sparse.executors.reference import reference_executor
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import dequantize_int4, quantize_int4, write_int4_shadow
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import plan_request, plan_step
from vllm_sparse.selectors import QuestSelector, TwilightSelector, make_selector
from vllm_sparse.selectors.base import Selection
from vllm_sparse.selectors.twilight import estimate_page_mass, top_p_keep
from vllm_sparse.tables import build_page_tables


def paged_batch_with_meta(seq_lens, hkv, n, d, order="planes", dtype=torch.float32, seed=0):
    planes = MetaPlanes.for_method("twilight", hkv, n, d, dtype)
    batch = make_paged_batch(seq_lens, hkv, n, d, order=order, meta_slots=planes.num_slots, dtype=dtype, seed=seed)
    layout = PageLayout.of(batch.kv_cache, hkv, order)
    meta = planes.views(batch.kv_cache)
    slots = torch.cat(
        [batch.block_table[r, torch.arange(s) // n].long() * n + torch.arange(s) % n for r, s in enumerate(seq_lens)]
    )
    write_page_minmax(layout, batch.kv_cache, meta, slots)
    write_int4_shadow(meta, torch.cat(batch.keys), slots, n, dtype)
    return batch, layout, meta


class FixedCandidates:
    """A base selector returning given candidate pages per row (ignores the queries)."""

    def __init__(self, picks: dict[int, list[int]]):
        self.picks = picks

    def __call__(self, query, page_keys, block_table, layout, plan, meta=None):
        rows = len(plan.requests) * layout.num_kv_heads
        idx = torch.full((rows, plan.max_select), 999, dtype=torch.int64)
        cnt = torch.zeros(rows, dtype=torch.int32)
        for row, pages in self.picks.items():
            idx[row, : len(pages)] = torch.tensor(pages)
            cnt[row] = len(pages)
        return Selection(idx, cnt)


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c,hkv,g,p,n", [(1, 1, 1, 3, 4), (5, 2, 3, 4, 2), (300, 1, 2, 3, 4)])
def test_estimate_page_mass_brute_force(c, hkv, g, p, n):
    d = 8
    gg = gen(c + hkv + g)
    q = randn(c, hkv * g, d, g=gg)
    keys = randn(hkv, p * n, d, g=gg) * 2
    got = estimate_page_mass(q, keys, n, 0.4)
    want = torch.zeros(hkv, g, p, dtype=torch.float64)
    for h in range(hkv * g):
        w = torch.softmax(q[:, h].double() @ keys[h // g].double().T * 0.4, dim=-1)  # [C, P*N]
        want[h // g, h % g] = w.mean(dim=0).view(p, n).sum(dim=-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def brute_keep(mass, forced_mass, top_p):
    hkv, g, k = mass.shape
    out = []
    for kh in range(hkv):
        union = set()
        for i in range(g):
            order = sorted(range(k), key=lambda j: -float(mass[kh, i, j]))
            acc = float(forced_mass[kh, i])
            for j in order:
                if acc >= top_p:
                    break
                union.add(j)
                acc += float(mass[kh, i, j])
        out.append(union)
    return out


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95, 1.0])
def test_top_p_keep_brute_force(top_p):
    gg = gen(int(top_p * 100))
    raw = torch.rand(3, 4, 11, generator=gg) ** 4
    forced = torch.rand(3, 4, generator=gg) * 0.3
    mass = raw / raw.sum(dim=-1, keepdim=True) * (1 - forced[..., None])
    got = top_p_keep(mass, forced, top_p)
    for kh, want in enumerate(brute_keep(mass, forced, top_p)):
        assert set(torch.nonzero(got[kh]).flatten().tolist()) == want


def test_top_p_keep_forced_mass_already_enough():
    mass = torch.tensor([[[0.01, 0.02, 0.01]]])
    assert not top_p_keep(mass, torch.tensor([[0.96]]), 0.95).any()


# ---------------------------------------------------------------------------------------------
# The selector
# ---------------------------------------------------------------------------------------------


def sparse_policy(fraction=0.5, sink=4, local=8, cap=None) -> LayerPolicy:
    return LayerPolicy(False, Budget(fraction=fraction, min_tokens=0, max_tokens=None), sink, local, 0, cap)


@pytest.mark.parametrize("prune_prefill", [True, False])
@pytest.mark.parametrize("order", ["planes", "interleaved"])
@pytest.mark.parametrize("top_p", [0.5, 0.9])
@pytest.mark.parametrize("hkv,group", [(2, 2), (1, 3)])
def test_twilight_matches_brute_force(order, top_p, hkv, group, prune_prefill):
    """Decode rows keep the brute-force top-p set of their candidates; prefill chunks the same under
    ``prune_prefill``, else every candidate."""
    n, d = 4, 16
    reqs = [(13, 97), (1, 83), (9, 9), (1, 130)]
    seq_lens = [s for _, s in reqs]
    seed = hkv + 5 * group + int(10 * top_p) + (order == "planes")
    batch, layout, meta = paged_batch_with_meta(seq_lens, hkv, n, d, order, seed=seed)
    qsl = query_start_loc([ql for ql, _ in reqs])
    plan = plan_step(sparse_policy(), n, qsl, seq_lens)
    g = gen(seed + 1)
    picks = {}
    for r, req in enumerate(plan.requests):
        if req.sparse:
            free = [p for p in range(req.num_past_pages) if p not in set(req.forced.tolist())]
            for kh in range(hkv):
                perm = torch.randperm(len(free), generator=g)[: req.num_select].tolist()
                picks[r * hkv + kh] = [free[i] for i in perm]
    query = randn(qsl[-1], hkv * group, d, g=g) * 3  # peaked attention: top-p keeps few pages
    scale = d**-0.5
    sel = TwilightSelector(FixedCandidates(picks), top_p, prune_prefill=prune_prefill)(
        query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta
    )
    varied = set()
    for r, req in enumerate(plan.requests):
        for kh in range(hkv):
            row = r * hkv + kh
            count = int(sel.counts[row])
            if not req.sparse:
                assert count == 0
                continue
            got = sel.indices[row, :count].tolist()
            if req.query_len > 1 and not prune_prefill:  # a chunk attends every candidate, in order
                assert got == picks[row], (r, kh)
                continue
            # brute force: dequantized shadows of the request's own keys, float64
            forced = [p for p in req.forced.tolist() if p < req.num_past_pages]
            pages = forced + picks[row]
            k = batch.keys[r].view(-1, hkv, d)
            toks = torch.tensor([p * n + t for p in pages for t in range(n)])
            codes, sc, zr = quantize_int4(k[toks, kh])
            khat = dequantize_int4(codes, sc, zr).double()
            q = query[req.query_start : req.query_start + req.query_len, kh * group : (kh + 1) * group].double()
            union = set()
            for i in range(group):
                w = torch.softmax(q[:, i] @ khat.T * scale, dim=-1).mean(dim=0).view(len(pages), n).sum(dim=-1)
                acc = float(w[: len(forced)].sum())
                for j in sorted(range(len(forced), len(pages)), key=lambda j: -float(w[j])):
                    if acc >= top_p:
                        break
                    union.add(pages[j])
                    acc += float(w[j])
            assert set(got) == union and len(got) == len(union), (r, kh)
            assert set(sel.indices[row, : req.num_select].tolist()) == set(picks[row])  # a permutation
            varied.add(count)
    assert len(varied) > 1 or not prune_prefill  # per-row budgets really vary (two decode rows alone may tie)


def test_top_p_one_keeps_every_candidate_and_quest_is_the_default_base():
    n, d, hkv = 4, 8, 2
    batch, layout, meta = paged_batch_with_meta([120], hkv, n, d, seed=4)
    plan = plan_step(sparse_policy(fraction=0.4), n, [0, 1], [120])
    query = randn(1, hkv * 2, d, g=gen(5))
    s = make_selector(SparseConfig(method="twilight", twilight={"top_p": 1.0}))
    assert isinstance(s, TwilightSelector) and isinstance(s.base, QuestSelector)
    sel = s(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)
    cand = QuestSelector()(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)
    k = plan.requests[0].num_select
    assert sel.counts.tolist() == [k, k]
    for row in range(hkv):
        assert set(sel.indices[row, :k].tolist()) == set(cand.indices[row, :k].tolist())


def test_planted_page_alone_reaches_top_p():
    n, d, hkv, group = 4, 16, 1, 2
    batch, layout, meta = paged_batch_with_meta([200], hkv, n, d, seed=8)
    plan = plan_step(sparse_policy(fraction=0.5, sink=0, local=0), n, [0, 1], [200])
    req = plan.requests[0]
    direction = randn(d, g=gen(9))
    direction = direction / direction.norm()
    query = (20 * direction).expand(1, group, d).clone()
    target = 17
    block = int(batch.block_table[0, target])
    keys = layout.keys(batch.kv_cache)
    keys[block, 0, 1] = 5 * direction
    write_int4_shadow(meta, keys[block, 0, 1].view(1, 1, d), torch.tensor([block * n + 1]), n)
    write_page_minmax(layout, batch.kv_cache, meta, torch.tensor([block * n + n - 1]))
    sel = TwilightSelector(QuestSelector(), 0.9)(
        query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta
    )  # one query: a decode step, pruned whatever prune_prefill says
    assert req.num_select > 5
    assert sel.counts.tolist() == [1] and sel.indices[0, 0] == target


# ---------------------------------------------------------------------------------------------
# Variable counts through tables and the executor
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 4])
def test_variable_counts_through_tables_and_executor(group):
    n, d, hkv = 4, 16, 2
    reqs = [(13, 97), (1, 83), (9, 9), (1, 130)]
    seq_lens = [s for _, s in reqs]
    batch, layout, meta = paged_batch_with_meta(seq_lens, hkv, n, d, seed=group)
    qsl = query_start_loc([ql for ql, _ in reqs])
    plan = plan_step(sparse_policy(), n, qsl, seq_lens)
    query = randn(qsl[-1], hkv * group, d, g=gen(group + 3)) * 3
    sel = TwilightSelector(QuestSelector(), 0.7, prune_prefill=True)(
        query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta
    )
    tables = build_page_tables(plan, sel, batch.block_table, layout)
    assert len(set(tables.counts.tolist())) > 2
    out = torch.full_like(query, float("nan"))
    scale = d**-0.5
    reference_executor(
        query, layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache), tables, plan, scale, out
    )
    for r, req in enumerate(plan.requests):
        visible = []
        for kh in range(hkv):
            row = r * hkv + kh
            c = int(sel.counts[row])
            assert int(tables.counts[row]) == req.forced.numel() + c
            visible.append(set(req.forced.tolist()) | set(sel.indices[row, :c].tolist()))
        toks = slice(req.query_start, req.query_start + req.query_len)
        want = brute_attention(query[toks], batch.keys[r], batch.values[r], req.context_len, scale, visible, n)
        torch.testing.assert_close(out[toks].double(), want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Policy: the method-specific cap
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [0.05, 0.1, 0.25, 0.9])
@pytest.mark.parametrize("max_tokens", [None, 256])
def test_policy_candidates_are_the_candidate_fraction(cap, max_tokens):
    """Twilight's candidates are ``candidate_fraction`` of the context (clamped by the budget's
    max_tokens), whatever the budget's fraction (which only decides sparse vs dense)."""
    n = 16

    def policy(c):
        return LayerPolicy(False, Budget(fraction=0.125, min_tokens=0, max_tokens=max_tokens), 16, 32, 0, c)

    for ql, seq in [(1, 1000), (100, 2100), (37, 4000)]:
        a, b = plan_request(policy(None), n, 0, ql, seq), plan_request(policy(cap), n, 0, ql, seq)
        assert a.sparse == b.sparse and torch.equal(a.forced, b.forced)
        forced_past = int((a.forced < a.num_past_pages).sum())
        selectable = a.num_past_pages - forced_past
        tokens = int(cap * a.context_len) if max_tokens is None else min(int(cap * a.context_len), max_tokens)
        assert b.num_select == min(selectable, max(0, math.ceil(tokens / n) - forced_past))
    if max_tokens is None:  # 25% candidates exceed a 12.5% budget
        big = plan_request(policy(0.25), n, 0, 1, 8001)
        assert big.num_select > plan_request(policy(None), n, 0, 1, 8001).num_select


def test_twilight_config_sets_the_cap_and_full_budget_stays_dense():
    c = SparseConfig(method="twilight", twilight={"candidate_fraction": 0.2})
    assert c.for_layer(1).select_fraction == 0.2
    assert SparseConfig(method="quest").for_layer(1).select_fraction is None
    full = SparseConfig(
        method="twilight", budget={"fraction": 1.0, "min_tokens": 0}, dense_layers=[], dense_below_tokens=0
    )
    assert not plan_request(full.for_layer(0), 16, 0, 1, 3000).sparse


@pytest.mark.parametrize("prune_prefill", [False, True])
def test_unpruned_chunks_select_the_budget_and_decode_rows_the_candidates(prune_prefill):
    """A decode row selects ``candidate_fraction`` (its top-p prunes them); a prefill chunk that
    attends what it selects (``prune_prefill`` off) selects the budget's pages, as Quest's does."""
    kw = dict(budget={"fraction": 0.125, "min_tokens": 0}, dense_layers=[], dense_below_tokens=0)
    tw = SparseConfig(method="twilight", twilight={"candidate_fraction": 0.25, "prune_prefill": prune_prefill}, **kw)
    quest = SparseConfig(method="quest", **kw).for_layer(1)
    n, ctx = 16, 8000
    decode = plan_request(tw.for_layer(1), n, 0, 1, ctx + 1)
    chunk = plan_request(tw.for_layer(1), n, 0, 512, ctx + 512)
    quest_chunk = plan_request(quest, n, 0, 512, ctx + 512)
    assert decode.sparse and chunk.sparse
    assert decode.num_select > plan_request(quest, n, 0, 1, ctx + 1).num_select  # 25% candidates
    if prune_prefill:
        assert chunk.num_select > quest_chunk.num_select
    else:
        assert chunk.num_select == quest_chunk.num_select
        assert torch.equal(chunk.forced, quest_chunk.forced)


# ---------------------------------------------------------------------------------------------
# Decode batching: the step's decode requests estimated together == one request at a time
# ---------------------------------------------------------------------------------------------

# decode requests of different lengths, a prefill chunk, a dense decode (too short) and a dense chunk
MIXED = [(1, 97), (13, 120), (1, 83), (1, 9), (1, 150), (9, 9), (1, 61), (1, 130)]


def assert_same_selection(got, want):
    assert torch.equal(got.counts, want.counts)
    for row in range(want.counts.numel()):
        k = int(want.counts[row])
        assert set(got.indices[row, :k].tolist()) == set(want.indices[row, :k].tolist()), row
        assert len(set(got.indices[row, :k].tolist())) == k, row


def mixed_step(hkv, group, seed, order="planes", n=4, d=16, reqs=MIXED):
    seq_lens = [s for _, s in reqs]
    batch, layout, meta = paged_batch_with_meta(seq_lens, hkv, n, d, order, seed=seed)
    qsl = query_start_loc([ql for ql, _ in reqs])
    plan = plan_step(sparse_policy(), n, qsl, seq_lens)
    query = randn(qsl[-1], hkv * group, d, g=gen(seed + 1)) * 3  # peaked: top-p keeps few pages
    return (query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)


@pytest.mark.parametrize("rule", ["max", "sum", "union"])
@pytest.mark.parametrize("top_p", [0.5, 0.9])
@pytest.mark.parametrize("hkv,group", [(2, 2), (1, 3)])
def test_decode_batch_selects_like_per_request(rule, top_p, hkv, group, monkeypatch):
    from vllm_sparse.selectors import twilight

    args = mixed_step(hkv, group, seed=hkv + 5 * group + int(10 * top_p))
    plan = args[4]
    assert sum(r.sparse and r.query_len == 1 for r in plan.requests) >= 4
    assert any(r.sparse and r.query_len > 1 for r in plan.requests) and not all(r.sparse for r in plan.requests)
    reference = TwilightSelector(QuestSelector(rule, batch_decode=False), top_p, batch_decode=False, prune_prefill=True)
    want = reference(*args)
    calls = []
    per_request = twilight._page_mass
    monkeypatch.setattr(twilight, "_page_mass", lambda q, *a: calls.append(q.shape[0]) or per_request(q, *a))
    got = TwilightSelector(QuestSelector(rule), top_p, prune_prefill=True)(*args)
    assert calls == [13]  # only the prefill chunk went one request at a time
    assert_same_selection(got, want)
    sparse_rows = [r * hkv + h for r, q in enumerate(plan.requests) if q.sparse for h in range(hkv)]
    assert len(set(got.counts[sparse_rows].tolist())) > 2  # variable counts
    k = {r * hkv + h: q.num_select for r, q in enumerate(plan.requests) for h in range(hkv)}
    cand = QuestSelector(rule)(*args)
    for row in sparse_rows:  # the first num_select entries stay a permutation of the candidates
        assert set(got.indices[row, : k[row]].tolist()) == set(cand.indices[row, : k[row]].tolist())


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_decode_batch_with_given_candidates(top_p):
    """Padding candidates of the base (out-of-range page numbers past each row's count) are ignored."""
    hkv, group = 2, 2
    args = mixed_step(hkv, group, seed=31)
    plan = args[4]
    g = gen(32)
    picks = {}
    for r, req in enumerate(plan.requests):
        if req.sparse:
            free = [p for p in range(req.num_past_pages) if p not in set(req.forced.tolist())]
            for kh in range(hkv):
                perm = torch.randperm(len(free), generator=g)[: req.num_select].tolist()
                picks[r * hkv + kh] = [free[i] for i in perm]
    want = TwilightSelector(FixedCandidates(picks), top_p, batch_decode=False)(*args)
    got = TwilightSelector(FixedCandidates(picks), top_p)(*args)
    assert_same_selection(got, want)


def test_decode_mass_rows_match_per_request_twin():
    from vllm_sparse.selectors.twilight import estimate_page_mass_rows

    n, d, hkv, group = 4, 16, 2, 2
    batch, _, meta = paged_batch_with_meta([200], hkv, n, d, seed=6)
    gg = gen(7)
    q = randn(3, hkv * group, d, g=gg) * 2
    lens = [5, 9, 2, 9, 7, 1]  # valid pages per row, then -1 padding
    blocks = torch.full((6, 9), -1, dtype=torch.int64)
    for row, m in enumerate(lens):
        blocks[row, :m] = batch.block_table[0, torch.randperm(40, generator=gg)[:m]].long()
    got = estimate_page_mass_rows(q, meta, blocks, n, 0.3)
    for row, m in enumerate(lens):
        s, h = divmod(row, hkv)
        keys = dequantize_int4(
            meta.codes[blocks[row, :m], h], meta.scale[blocks[row, :m], h], meta.zero[blocks[row, :m], h]
        )
        want = estimate_page_mass(q[s : s + 1, h * group : (h + 1) * group], keys.flatten(0, 1)[None], n, 0.3)[0]
        torch.testing.assert_close(got[row, :, :m], want)
        assert bool((got[row, :, m:] == 0).all())
