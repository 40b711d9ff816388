"""Stage 1 (policy): vllm_sparse/policy.py against a brute-force per-token definition."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from helpers import single_thread  # noqa: F401  (autouse fixture: one torch thread)

from vllm_sparse.config import Budget, LayerPolicy, SparseConfig
from vllm_sparse.policy import RequestPlan, StepPlan, plan_request, plan_step


def policy(fraction=0.25, lo=0, hi=None, sink=16, local=32, dense=False, dense_below=0) -> LayerPolicy:
    return LayerPolicy(dense, Budget(fraction=fraction, min_tokens=lo, max_tokens=hi), sink, local, dense_below)


def brute_plan(p: LayerPolicy, n: int, query_len: int, seq_len: int) -> dict:
    """Per-token definition: which token positions are forced, how many pages are picked."""
    ctx = seq_len - query_len
    total = math.ceil(seq_len / n)

    def page_of(pos: int) -> int:
        return pos // n

    page_tokens = {pg: [pos for pos in range(pg * n, min((pg + 1) * n, seq_len))] for pg in range(total)}
    # a past page: a page all of whose n slots are positions before the chunk
    past = {pg for pg in range(total) if all(pos < ctx for pos in range(pg * n, (pg + 1) * n))}
    chunk = {page_of(pos) for pos in range(ctx, seq_len)}
    sink = {page_of(pos) for pos in range(ctx) if pos < p.sink_tokens} & past
    local = {page_of(pos) for pos in range(ctx) if pos >= ctx - p.local_tokens} & past
    forced_past = sink | local
    budget = p.budget.tokens(ctx)
    past_attended = min(len(past), max(math.ceil(budget / n), len(forced_past)))
    num_select = past_attended - len(forced_past)
    selectable = len(past) - len(forced_past)
    dense = p.dense or ctx == 0 or ctx < p.dense_below_tokens or budget >= ctx or num_select >= selectable
    assert set(page_tokens) == past | chunk  # every page is past or chunk
    if dense:
        return {"sparse": False, "num_select": 0, "forced": list(range(total)), "num_past": len(past), "ctx": ctx}
    return {
        "sparse": True,
        "num_select": num_select,
        "forced": sorted(forced_past | chunk),
        "num_past": len(past),
        "ctx": ctx,
        "chunk": sorted(chunk),
        "selectable": selectable,
    }


def check_against_brute(p: LayerPolicy, n: int, query_start: int, query_len: int, seq_len: int) -> RequestPlan:
    got = plan_request(p, n, query_start, query_len, seq_len)
    want = brute_plan(p, n, query_len, seq_len)
    where = f"n={n} ql={query_len} seq={seq_len} {p}"
    assert got.query_start == query_start and got.query_len == query_len, where
    assert got.context_len == want["ctx"] and got.seq_len == seq_len, where
    assert got.sparse == want["sparse"], where
    assert got.num_select == want["num_select"], where
    assert got.num_past_pages == want["num_past"], where
    assert got.forced.dtype == torch.int64 and got.forced.dim() == 1, where
    forced = got.forced.tolist()
    assert forced == want["forced"], where
    # ascending, never duplicated
    assert all(a < b for a, b in itertools.pairwise(forced)), where
    assert got.num_pages == len(forced) + got.num_select, where
    assert got.total_pages == math.ceil(seq_len / n), where
    assert got.num_pages <= got.total_pages, where
    if got.sparse:
        # the selector's choice never exceeds the selectable (non-forced past) pages, and something is skipped
        assert 0 <= got.num_select < want["selectable"], where
        assert got.num_pages < got.total_pages, where
        # chunk pages are the last forced pages
        k = len(want["chunk"])
        assert forced[-k:] == want["chunk"], where
        assert all(pg < got.num_past_pages for pg in forced[:-k]), where
    else:
        assert got.num_pages == got.total_pages, where
    return got


CONTEXTS = [0, 1, 5, 15, 16, 17, 31, 32, 33, 63, 64, 100, 127, 128, 129, 200, 255, 256, 257, 300, 401]


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("sink", [0, 1, 16, 33])
@pytest.mark.parametrize("local", [0, 5, 32, 100])
@pytest.mark.parametrize("query_len", [1, 3, 16, 37])
def test_plan_request_matches_brute_force(n, sink, local, query_len):
    p = policy(fraction=0.2, lo=8, hi=120, sink=sink, local=local)
    for ctx in CONTEXTS:
        check_against_brute(p, n, 7, query_len, ctx + query_len)


@pytest.mark.parametrize("n", [4, 16])
@pytest.mark.parametrize(
    "budget", [(0.01, 0, None), (0.125, 0, 64), (0.5, 16, 160), (1.0, 0, None), (0.3, 0, 1), (0.05, 200, 200)]
)
@pytest.mark.parametrize("query_len", [1, 20])
def test_plan_request_budgets(n, budget, query_len):
    fraction, lo, hi = budget
    p = policy(fraction=fraction, lo=lo, hi=hi, sink=4, local=8)
    for ctx in CONTEXTS:
        check_against_brute(p, n, 0, query_len, ctx + query_len)


def test_random_sweep():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.choice([1, 2, 8, 16, 32])
        p = policy(
            fraction=rng.choice([0.05, 0.125, 0.25, 0.6]),
            lo=rng.choice([0, 8, 64]),
            hi=rng.choice([None, 64, 256]),
            sink=rng.choice([0, 3, 16, 40]),
            local=rng.choice([0, 10, 64, 200]),
            dense_below=rng.choice([0, 0, 50, 300]),
        )
        if p.budget.max_tokens is not None and p.budget.min_tokens > p.budget.max_tokens:
            continue
        ql = rng.choice([1, 1, 2, rng.randint(1, 90)])
        ctx = rng.randint(0, 600)
        check_against_brute(p, n, rng.randint(0, 50), ql, ctx + ql)


# ---------------------------------------------------------------------------------------------
# named cases
# ---------------------------------------------------------------------------------------------


def test_sparse_example_by_hand():
    # n=16, ctx=200 (12 complete past pages + 8 past tokens in page 12), chunk of 40 -> seq 240, 15 pages
    p = policy(fraction=0.25, lo=0, hi=None, sink=16, local=32)
    r = plan_request(p, 16, 0, 40, 240)
    # sink: page 0; local: positions 168..199 -> pages 10, 11 (page 12 is a chunk page); chunk: 12..14
    assert r.sparse
    assert r.forced.tolist() == [0, 10, 11, 12, 13, 14]
    assert r.num_past_pages == 12
    # budget int(0.25 * 200) = 50 tokens -> 4 pages, 3 of them forced -> 1 to select
    assert r.num_select == 1
    assert (r.num_pages, r.total_pages) == (7, 15)


def test_decode_example_by_hand():
    # decode token at position 1000 (ctx=1000), n=16: page 62 holds 992..1000 (partial tail)
    p = policy(fraction=0.125, lo=0, hi=None, sink=16, local=64)
    r = plan_request(p, 16, 3, 1, 1001)
    assert r.sparse and r.query_start == 3
    # local: 936..999 -> pages 58..61 (62 is the chunk page)
    assert r.forced.tolist() == [0, 58, 59, 60, 61, 62]
    # budget 125 tokens -> 8 pages, 5 forced past -> 3 selected
    assert r.num_select == 3
    assert r.total_pages == 63


@pytest.mark.parametrize(
    "kw,ql,seq",
    [
        ({"dense": True}, 10, 5000),  # dense layer
        ({"dense_below": 4096}, 10, 4105),  # ctx 4095 < 4096
        ({"fraction": 1.0}, 1, 5000),  # budget >= context
        ({"lo": 2000}, 1, 2001),  # min_tokens >= context
        ({}, 50, 50),  # context 0 (first chunk)
        ({}, 1, 1),  # context 0, single token
        ({"sink": 64, "local": 64}, 1, 129),  # everything forced: nothing to select
    ],
)
def test_dense_cases(kw, ql, seq):
    p = policy(**kw)
    r = check_against_brute(p, 16, 0, ql, seq)
    assert not r.sparse
    assert r.num_select == 0
    assert r.forced.tolist() == list(range(math.ceil(seq / 16)))
    assert r.num_pages == r.total_pages


def test_dense_below_threshold_boundary():
    p = policy(dense_below=4096, fraction=0.125)
    assert not plan_request(p, 16, 0, 1, 4096).sparse  # ctx 4095
    assert plan_request(p, 16, 0, 1, 4097).sparse  # ctx 4096


def test_budget_equal_context_is_dense():
    p = policy(fraction=0.01, lo=160, hi=160, sink=0, local=0)
    assert not plan_request(p, 16, 0, 1, 161).sparse  # ctx == budget
    r = plan_request(p, 16, 0, 1, 177)  # ctx 176 > budget 160
    assert r.sparse and r.num_select == 10


def test_budget_below_forced_selects_nothing():
    # forced past pages already exceed the budget: sparse, zero pages to select
    p = policy(fraction=0.01, lo=0, hi=16, sink=32, local=64)
    r = check_against_brute(p, 16, 0, 1, 1001)
    assert r.sparse and r.num_select == 0


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_policy_from_config_for_layer(layer):
    c = SparseConfig(dense_layers=[0], sparse_decode=True, layers={2: {"budget": {"fraction": 0.5}}})
    p = c.for_layer(layer)
    r = check_against_brute(p, 16, 0, 1, 20001)
    assert r.sparse == (layer != 0)
    if layer:
        assert r.num_past_pages == 1250
        budget_pages = math.ceil(p.budget.tokens(20000) / 16)  # 2500 (0.125) or 10000 (0.5) tokens
        assert r.num_select + (r.forced < 1250).sum().item() == budget_pages


# ---------------------------------------------------------------------------------------------
# plan_step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 16])
def test_plan_step_mixed_batch(n):
    p = policy(fraction=0.2, lo=0, hi=None, sink=8, local=24, dense_below=64)
    # (query_len, seq_len): decode, prefill chunk inside a page, first chunk, short dense, long decode
    reqs = [(1, 300), (37, 333), (20, 20), (5, 40), (1, 1000), (64, 576)]
    qsl = [0]
    for ql, _ in reqs:
        qsl.append(qsl[-1] + ql)
    step = plan_step(p, n, qsl, [s for _, s in reqs])
    assert isinstance(step, StepPlan) and step.page_size == n
    assert len(step.requests) == len(reqs)
    for i, (ql, s) in enumerate(reqs):
        r = check_against_brute(p, n, qsl[i], ql, s)
        got = step.requests[i]
        assert (got.query_start, got.query_len, got.seq_len) == (qsl[i], ql, s)
        assert got.sparse == r.sparse and got.num_select == r.num_select
        assert torch.equal(got.forced, r.forced)
    assert step.max_select == max(r.num_select for r in step.requests)
    assert step.any_sparse == any(r.sparse for r in step.requests)
    assert step.any_sparse


def test_plan_step_all_dense_and_empty():
    p = policy(dense=True)
    step = plan_step(p, 16, [0, 1, 11], [500, 610])
    assert not step.any_sparse and step.max_select == 0
    empty = plan_step(p, 16, [0], [])
    assert empty.requests == () and empty.max_select == 0 and not empty.any_sparse


def test_sparse_decode_off_makes_decode_dense_but_not_chunks():
    from vllm_sparse.config import Budget, LayerPolicy
    from vllm_sparse.policy import plan_request

    pol = LayerPolicy(False, Budget(fraction=0.1, min_tokens=0, max_tokens=None), 16, 64, 0, sparse_decode=False)
    decode = plan_request(pol, 16, 0, 1, 5000)
    chunk = plan_request(pol, 16, 0, 300, 5000)
    assert not decode.sparse and decode.num_pages == decode.total_pages
    assert chunk.sparse and chunk.num_pages < chunk.total_pages
    on = plan_request(LayerPolicy(False, pol.budget, 16, 64, 0), 16, 0, 1, 5000)
    assert on.sparse


def test_split_dense_tails():
    from vllm_sparse.policy import split_dense_tails

    # decode, a chunk longer than the tail, a chunk of at most the tail, a first chunk, a short context
    qsl, seqs = [0, 1, 101, 131, 231, 281], [5000, 9000, 9030, 100, 1049]
    s = split_dense_tails(qsl, seqs, 32, min_context=1000)
    assert s.query_start_loc == [0, 1, 69, 101, 131, 231, 281]
    assert s.seq_lens == [5000, 8968, 9000, 9030, 100, 1049]
    assert s.rows == [0, 1, 1, 2, 3, 4]
    assert s.dense == (False, False, True, True, False, False)
    assert split_dense_tails(qsl, seqs, 0) is None
    assert split_dense_tails([0, 1, 2], [5000, 6000], 32) is None  # decodes only
    p = policy(dense_below=0)
    plan = plan_step(p, 16, s.query_start_loc, s.seq_lens, dense=s.dense)
    assert [r.sparse for r in plan.requests] == [True, True, False, False, False, True]
    assert plan.requests[1].seq_len == 8968 and plan.requests[2].context_len == 8968
    assert plan.requests[2].forced.tolist() == list(range(-(-9000 // 16)))  # the tail attends every page


def test_metadata_builder_splits_dense_tails():
    """The builder's split (``dense_tail_tokens``): the step's requests, seq lens and block-table rows, then
    plans where the tails run dense."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_sparse.backend.metadata import SparseAttentionMetadata, SparseMetadataBuilder

    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    meta = SparseAttentionMetadata(80, [0, 40, 41, 80], [6000, 7000, 8039], table, torch.zeros(80), 16)
    builder = SimpleNamespace(_dense_tail=16, _dense_below=4096)
    SparseMetadataBuilder._split_dense_tails(builder, meta)
    assert meta.query_start_loc == [0, 24, 40, 41, 64, 80]
    assert meta.seq_lens == [5984, 6000, 7000, 8023, 8039]
    assert meta.dense == (False, True, False, False, True)
    assert meta.block_table.tolist() == [table[i].tolist() for i in (0, 0, 1, 2, 2)]
    plan = meta.plan_for(policy())
    assert [r.sparse for r in plan.requests] == [True, False, True, True, False]
